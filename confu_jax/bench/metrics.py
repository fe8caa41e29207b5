"""Acceptance logs and the speculative-decoding metrics computed from them (Spec-Bench definitions).

Log format: one :class:`GenerationLog` per generated turn, holding ``accept_lengths`` — the number
of tokens *emitted* by each target verification pass, bonus token included (so every entry is
>= 1; an autoregressive step is a pass that emits exactly 1) and clipped at EOS / max_new_tokens —
plus the total emitted tokens and the wall time after compilation. The first token, sampled from
the prefill's logits, is emitted without a verification pass, so
``new_tokens == sum(accept_lengths) + 1`` for a normal turn (``+ 0`` is also accepted, for loops
that do not emit from prefill).

Definitions, matching Spec-Bench's ``evaluation/speed.py``:

* τ (mean accepted length) = total tokens emitted by verification passes / number of passes,
  **pooled over all passes** of all prompts in the group (Spec-Bench concatenates every pass's
  accept length and takes ``np.mean``). It is therefore weighted per pass, not an average of
  per-prompt τ: a long answer counts more than a short one.
* tokens/s = **mean over questions** of (question's tokens / question's wall time), the turns of a
  question summed first (Spec-Bench sums ``new_tokens`` and ``wall_time`` over a question's turns,
  then averages the per-question speeds).
* speed-up SR = method's mean tokens/s / AR baseline's mean tokens/s over the same questions,
  where the baseline is this framework's jitted AR decoding measured in the same run.
* the overall row ("AVG") pools all questions; it is not the mean of the category rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Iterable, Mapping, Sequence

import numpy as np


class AcceptanceLogError(ValueError):
    """An acceptance log that violates the format (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class GenerationLog:
    """What one generated turn contributes to the benchmark metrics."""

    question_id: int | str
    category: str
    accept_lengths: tuple[int, ...]  # tokens emitted per target pass, bonus included, each >= 1
    new_tokens: int  # all tokens emitted this turn, the prefill's first token included
    wall_s: float  # seconds from prompt in to last token out, after compilation
    turn: int = 0

    def __post_init__(self):
        object.__setattr__(self, "accept_lengths", tuple(int(a) for a in self.accept_lengths))
        where = f"GenerationLog(question_id={self.question_id!r}, turn={self.turn})"
        bad = [a for a in self.accept_lengths if a < 1]
        if bad:
            raise AcceptanceLogError(
                f"{where}: every accept length counts the bonus token, so must be >= 1; found {bad}"
            )
        slack = self.new_tokens - sum(self.accept_lengths)
        if slack not in (0, 1):
            raise AcceptanceLogError(
                f"{where}: new_tokens ({self.new_tokens}) must equal sum(accept_lengths) "
                f"({sum(self.accept_lengths)}) plus 0 or 1 (the prefill's token)"
            )
        if not (self.wall_s > 0 and math.isfinite(self.wall_s)):
            raise AcceptanceLogError(f"{where}: wall_s must be a positive finite time; got {self.wall_s}")

    @classmethod
    def autoregressive(cls, question_id, category, new_tokens: int, wall_s: float, turn: int = 0):
        """The log of an AR turn: the first token from prefill, then one pass per token."""
        return cls(question_id, category, (1,) * max(int(new_tokens) - 1, 0), int(new_tokens),
                   float(wall_s), turn)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"accept_lengths": list(self.accept_lengths)}

    @classmethod
    def from_json(cls, obj: Mapping) -> "GenerationLog":
        return cls(obj["question_id"], obj["category"], tuple(obj["accept_lengths"]),
                   int(obj["new_tokens"]), float(obj["wall_s"]), int(obj.get("turn", 0)))


def _select(logs: Iterable[GenerationLog], category: str | None) -> list[GenerationLog]:
    return [g for g in logs if category is None or g.category == category]


def tau(logs: Iterable[GenerationLog], category: str | None = None) -> float:
    """Mean accepted length τ, pooled over every verification pass (Spec-Bench); nan if no pass."""
    lengths = [a for g in _select(logs, category) for a in g.accept_lengths]
    return float(sum(lengths) / len(lengths)) if lengths else float("nan")


def per_question_speeds(logs: Iterable[GenerationLog], category: str | None = None) -> dict:
    """question_id -> tokens/s with the question's turns summed (tokens and seconds)."""
    tokens: dict = {}
    seconds: dict = {}
    for g in _select(logs, category):
        tokens[g.question_id] = tokens.get(g.question_id, 0) + g.new_tokens
        seconds[g.question_id] = seconds.get(g.question_id, 0.0) + g.wall_s
    return {q: tokens[q] / seconds[q] for q in tokens}


def tokens_per_s(logs: Iterable[GenerationLog], category: str | None = None) -> float:
    """Mean over questions of per-question tokens/s (Spec-Bench); nan for an empty group."""
    speeds = per_question_speeds(logs, category)
    return float(np.mean(list(speeds.values()))) if speeds else float("nan")


def speedup(
    logs: Sequence[GenerationLog], baseline: Sequence[GenerationLog], category: str | None = None
) -> float:
    """SR = tokens/s of ``logs`` over tokens/s of the AR ``baseline`` on the same questions.

    Both runs must cover the same question ids (in the group): a speed-up over different prompts
    would compare answer lengths and prompt lengths, not decoding methods.
    """
    ids = set(per_question_speeds(logs, category))
    base_ids = set(per_question_speeds(baseline, category))
    if ids != base_ids:
        raise AcceptanceLogError(
            f"speedup(category={category!r}): method and baseline must cover the same questions; "
            f"only in method: {sorted(ids - base_ids, key=str)[:10]}, only in baseline: "
            f"{sorted(base_ids - ids, key=str)[:10]}"
        )
    return tokens_per_s(logs, category) / tokens_per_s(baseline, category)


def accept_length_histogram(
    logs: Iterable[GenerationLog], max_length: int | None = None
) -> np.ndarray:
    """``hist[a]`` = number of passes that emitted ``a`` tokens (index 0 is always 0)."""
    counts = Counter(a for g in logs for a in g.accept_lengths)
    top = max(counts, default=0)
    if max_length is not None:
        if top > max_length:
            raise AcceptanceLogError(
                f"accept_length_histogram: a pass emitted {top} tokens, more than max_length "
                f"{max_length}"
            )
        top = max_length
    hist = np.zeros(top + 1, dtype=np.int64)
    for a, n in counts.items():
        hist[a] = n
    return hist


def depth_acceptance_rates(logs: Iterable[GenerationLog], depth: int) -> np.ndarray:
    """``rate[k-1]`` = P(the draft token at depth k is accepted | depth k-1 was), k = 1..depth.

    A pass that emitted ``a`` tokens accepted ``a - 1`` draft tokens (the rest is the bonus), so
    rate_k = #passes with a-1 >= k / #passes with a-1 >= k-1 (EAGLE's n-α). nan where no pass
    reached depth k-1. Passes clipped at EOS / max_new_tokens slightly lower the deepest rates.
    """
    if depth < 1:
        raise ValueError(f"depth_acceptance_rates: depth must be >= 1; got {depth}")
    accepted = np.array([a - 1 for g in logs for a in g.accept_lengths], dtype=np.int64)
    if accepted.size and accepted.max() > depth:
        raise AcceptanceLogError(
            f"depth_acceptance_rates: a pass accepted {int(accepted.max())} draft tokens, more "
            f"than the draft depth {depth}"
        )
    reached = np.array([(accepted >= k).sum() for k in range(depth + 1)], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(reached[:-1] > 0, reached[1:] / np.maximum(reached[:-1], 1), np.nan)


@dataclasses.dataclass(frozen=True)
class CategoryResult:
    tau: float
    speedup: float
    tokens_per_s: float
    n_questions: int


@dataclasses.dataclass(frozen=True)
class MethodResult:
    """One row of the benchmark: a method under one setting (draft budget, temperature, ...)."""

    method: str
    nodes: int | None  # draft nodes / budget per verification; None for AR
    temperature: float
    tau: float
    tokens_per_s: float
    speedup: float
    per_category: dict  # name -> CategoryResult
    n_questions: int
    n_target_passes: int
    new_tokens: int
    wall_s: float
    accept_length_histogram: tuple[int, ...]
    acceptance_rate_per_depth: tuple[float, ...] | None = None
    setting: dict = dataclasses.field(default_factory=dict)  # any further knobs (depth, top_k, top_p)


def summarize(
    method: str,
    logs: Sequence[GenerationLog],
    baseline: Sequence[GenerationLog],
    *,
    nodes: int | None = None,
    temperature: float = 0.0,
    depth: int | None = None,
    setting: Mapping | None = None,
) -> MethodResult:
    """All report numbers for one method/setting from its logs and the AR baseline's logs.

    Categories keep the order in which they first appear in ``logs`` (the question file's order).
    ``depth`` (the draft depth) enables per-depth acceptance rates.
    """
    if not logs:
        raise AcceptanceLogError(f"summarize({method!r}): no generation logs")
    names = list(dict.fromkeys(g.category for g in logs))
    per_category = {
        c: CategoryResult(
            tau=tau(logs, c),
            speedup=speedup(logs, baseline, c),
            tokens_per_s=tokens_per_s(logs, c),
            n_questions=len(per_question_speeds(logs, c)),
        )
        for c in names
    }
    return MethodResult(
        method=method,
        nodes=nodes,
        temperature=float(temperature),
        tau=tau(logs),
        tokens_per_s=tokens_per_s(logs),
        speedup=speedup(logs, baseline),
        per_category=per_category,
        n_questions=len(per_question_speeds(logs)),
        n_target_passes=sum(len(g.accept_lengths) for g in logs),
        new_tokens=sum(g.new_tokens for g in logs),
        wall_s=float(sum(g.wall_s for g in logs)),
        accept_length_histogram=tuple(int(n) for n in accept_length_histogram(logs)),
        acceptance_rate_per_depth=(
            None if depth is None else tuple(float(r) for r in depth_acceptance_rates(logs, depth))
        ),
        setting=dict(setting or {}),
    )
