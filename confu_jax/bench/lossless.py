"""Greedy losslessness that survives accelerator numerics.

Greedy speculative decoding emits exactly AR's tokens *in exact arithmetic*. In floating point the
two programs evaluate the same target in different orders: AR feeds one token per step, a
verification pass feeds a block of tokens (and, on accelerators, other kernels and reduction
orders). Where the target's two best tokens are within rounding of each other, the two programs may
legitimately pick different ones — a numerical tie, not a bug. Token-for-token equality alone
cannot tell the two apart; the target's own logit margin at the first divergence can.

At the first position where the two outputs differ, ``divergence_margins`` recomputes the target's
next-token logits after ``prompt + common prefix`` in both arithmetics:

- ``stepwise``: the prompt in one block, then the common prefix one token at a time (the AR
  program's order),
- ``block``: the prompt in one block, then the whole common prefix in one block (a verification
  pass's order),

and reports ``gap = logit[AR's token] - logit[speculative token]`` for each. A divergence is a
**numerical tie** when both |gaps| are within ``tolerance = rtol(dtype) · max(1, |top logit|)``
(``TIE_RTOL``: a few units of the compute dtype's rounding, relative to the logits' scale);
anything larger is a real mismatch and the check fails.

The recomputation uses the stacked-layer target forward (``models.llama``), so it measures the
target's margin at that point, not the bit pattern of either compiled program; a tie in both
orders means the target cannot tell the two tokens apart at that precision.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Relative tie tolerance per compute dtype, as a fraction of the largest |logit|: ~4 units of the
# dtype's rounding (bf16 2^-7, fp16 2^-10) — what a bf16 forward accumulates over its layers (a
# tiny random bf16 target on CPU diverged between AR and verification at gaps of 0.3-1.8% of the top
# logit) — and ~80 units for fp32 (2^-23), whose programs differ only by summation order.
TIE_RTOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first position where AR's and the speculative output differ, with the target's margins."""

    position: int  # index in the generated tokens of the first difference
    ar_token: int
    spec_token: int
    gap_stepwise: float  # logit[ar_token] - logit[spec_token], context fed token by token (AR's order)
    gap_block: float  # the same with the common prefix fed as one block (a verification pass's order)
    tolerance: float  # |gap| <= tolerance in both orders: a numerical tie

    @property
    def numerical_tie(self) -> bool:
        return max(abs(self.gap_stepwise), abs(self.gap_block)) <= self.tolerance

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), numerical_tie=self.numerical_tie)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token; None when one sequence is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def tie_rtol(dtype) -> float:
    name = jnp.dtype(dtype).name
    if name not in TIE_RTOL:
        raise ValueError(f"no tie tolerance for compute dtype {name!r}; expected one of {sorted(TIE_RTOL)}")
    return TIE_RTOL[name]


def _bucket(n: int, quantum: int = 64) -> int:
    return max(quantum, -(-n // quantum) * quantum)


@partial(jax.jit, static_argnames=("cfg", "max_len"))
def _prefill_prompt(params, tokens_1t, length_1, *, cfg, max_len):
    from confu_jax.decode.generate import prefill
    from confu_jax.models.kv_cache import init_cache

    cache = init_cache(cfg.n_layers, 1, max_len, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    return prefill(params, cfg, cache, tokens_1t, length_1, attend_cache=False)


@partial(jax.jit, static_argnames=("cfg",))
def _continue_block(params, cache, tokens_1t, length_1, *, cfg):
    from confu_jax.decode.generate import prefill

    return prefill(params, cfg, cache, tokens_1t, length_1)[0]


@partial(jax.jit, static_argnames=("cfg",))
def _step(params, cache, token_1, *, cfg):
    from confu_jax.decode.generate import decode_step

    return decode_step(params, cfg, cache, token_1, jnp.ones((1,), bool))


def _pad(ids: Sequence[int], n: int) -> tuple[jax.Array, jax.Array]:
    out = np.zeros((1, n), np.int32)
    out[0, : len(ids)] = ids
    return jnp.asarray(out), jnp.asarray([len(ids)], jnp.int32)


def divergence_margins(params, cfg, prompt_ids: Sequence[int], ar_tokens: Sequence[int],
                       spec_tokens: Sequence[int], *, rtol: Optional[float] = None) -> Optional[Divergence]:
    """The first divergence of two greedy outputs for one prompt, with the target's logit gaps.

    ``params``: the target's stacked parameter tree (as ``Llama.init``); ``cfg``: its
    ``LlamaConfig``. Returns None when neither output has a differing token (equal, or one a
    prefix of the other: a length difference, which no margin explains).
    """
    pos = first_difference(ar_tokens, spec_tokens)
    if pos is None:
        return None
    prompt_ids, prefix = list(prompt_ids), [int(t) for t in ar_tokens[:pos]]
    if not prompt_ids:
        raise ValueError("divergence_margins needs a non-empty prompt")
    a, s = int(ar_tokens[pos]), int(spec_tokens[pos])
    p_pad = _bucket(len(prompt_ids))
    c_pad = _bucket(max(len(prefix), 1))
    max_len = p_pad + c_pad + 1
    tokens, length = _pad(prompt_ids, p_pad)
    logits_v, cache = _prefill_prompt(params, tokens, length, cfg=cfg, max_len=max_len)
    logits_block = logits_v
    if prefix:
        tokens, length = _pad(prefix, c_pad)
        logits_block = _continue_block(params, cache, tokens, length, cfg=cfg)
        for t in prefix:
            logits_v, cache = _step(params, cache, jnp.asarray([t], jnp.int32), cfg=cfg)
    stepwise = np.asarray(logits_v[0], np.float64)
    block = np.asarray(logits_block[0], np.float64)
    rtol = tie_rtol(cfg.dtype) if rtol is None else rtol
    tolerance = rtol * max(1.0, float(np.abs(stepwise).max()), float(np.abs(block).max()))
    return Divergence(position=pos, ar_token=a, spec_token=s, gap_stepwise=float(stepwise[a] - stepwise[s]),
                      gap_block=float(block[a] - block[s]), tolerance=tolerance)


def compare_greedy(params, cfg, turns: Sequence[tuple], ar: Sequence[tuple], spec: Sequence[tuple], *,
                   rtol: Optional[float] = None) -> dict:
    """Losslessness of a greedy run: ``ar`` and ``spec`` are per-turn ``(prompt_ids, tokens)`` of the
    same prompts (``turns``: a label per turn, e.g. ``(question_id, turn)``).

    A turn whose prompt differs between the two runs inherits an earlier turn's divergence
    (multi-turn replays each method's own answers) and is counted, not analysed. Returns
    ``lossless_greedy`` (every divergence is a numerical tie and no length differs),
    ``n_mismatched_turns``, ``n_numerical_ties`` and ``first_mismatch`` (label, position, tokens,
    both gaps, tolerance, tie or not) of the first mismatched turn.
    """
    if not (len(turns) == len(ar) == len(spec)):
        raise ValueError(f"turn counts differ: {len(turns)} labels, {len(ar)} AR, {len(spec)} speculative")
    mismatched, ties, real, first = 0, 0, 0, None
    for label, (p_ar, t_ar), (p_sp, t_sp) in zip(turns, ar, spec):
        if list(t_ar) == list(t_sp):
            continue
        mismatched += 1
        if list(p_ar) != list(p_sp):
            continue  # a consequence of an earlier turn's divergence
        d = divergence_margins(params, cfg, p_ar, t_ar, t_sp, rtol=rtol)
        if d is None:  # one output is a strict prefix of the other: lengths differ
            real += 1
            info = {"position": min(len(t_ar), len(t_sp)), "length_ar": len(t_ar), "length_spec": len(t_sp),
                    "numerical_tie": False}
        else:
            ties += d.numerical_tie
            real += not d.numerical_tie
            info = d.as_dict()
        if first is None:
            first = {"question_id": label[0], "turn": label[1], **info}
    return {"lossless_greedy": real == 0, "n_mismatched_turns": mismatched, "n_numerical_ties": ties,
            "first_mismatch": first}
