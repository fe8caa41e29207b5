"""Maps between the draft vocabulary and the target vocabulary.

The draft head predicts over a smaller vocabulary (the most frequent answer tokens,
``confu_jax.data.draft_vocab``); ``d2t`` gives the target id of each draft id, ``t2d`` marks which
target ids have one. Our ``d2t`` holds ABSOLUTE target ids; EAGLE-3's published checkpoints store
offsets (``target = draft + d2t[draft]``), converted on import (docs/DESIGN.md §9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def identity_draft_vocab(target_vocab: int, draft_vocab: int) -> dict:
    """Draft id i = target id i for i < draft_vocab (tests; real maps come from token frequencies)."""
    d2t = np.arange(draft_vocab, dtype=np.int32)
    return draft_vocab_from_d2t(d2t, target_vocab)


def draft_vocab_from_d2t(d2t: np.ndarray, target_vocab: int) -> dict:
    """``{'d2t', 't2d'}`` from absolute target ids of each draft id (distinct, in range)."""
    d2t = np.asarray(d2t, np.int64)
    if d2t.ndim != 1 or d2t.min(initial=0) < 0 or d2t.max(initial=0) >= target_vocab:
        raise ValueError(f"d2t must be a 1-D array of target ids in [0, {target_vocab}); got shape {d2t.shape}, "
                         f"range [{d2t.min(initial=0)}, {d2t.max(initial=0)}]")
    if len(np.unique(d2t)) != len(d2t):
        raise ValueError("d2t maps two draft ids to the same target id")
    t2d = np.zeros((target_vocab,), bool)
    t2d[d2t] = True
    return {"d2t": jnp.asarray(d2t, jnp.int32), "t2d": jnp.asarray(t2d)}


def draft_to_target_ids(draft_vocab: dict, draft_ids: jax.Array) -> jax.Array:
    return jnp.take(draft_vocab["d2t"], draft_ids, axis=0)


def target_to_draft_logits(draft_vocab: dict, logits_btv: jax.Array) -> jax.Array:
    """Restrict target-vocab scores to the draft vocabulary, in draft-id order [..., V_draft]."""
    return jnp.take(logits_btv, draft_vocab["d2t"], axis=-1)


def lm_head_from_target(target_lm_head: jax.Array, vocab_axis: int, d2t) -> jax.Array:
    """Draft LM-head kernel [d, V_draft]: the target's vocabulary rows in d2t order.

    ``target_lm_head`` is [V, d] (tied embedding, ``vocab_axis=0``) or [d, V] (``vocab_axis=1``),
    as ``train.teacher.lm_head_layout`` returns it; only the V_draft rows are gathered, never the
    whole matrix transposed.
    """
    rows = jnp.take(target_lm_head, jnp.asarray(d2t), axis=vocab_axis)
    return rows.T if vocab_axis == 0 else rows


def to_target_vocab(logits_xv: jax.Array, vocab: int) -> jax.Array:
    """A draft model's logits over the target's ``vocab`` ids (they share the tokenizer): an
    embedding padded past the tokenizer's size is cut, a shorter one padded with -inf (those ids
    are never drafted)."""
    v = logits_xv.shape[-1]
    if v == vocab:
        return logits_xv
    if v > vocab:
        return logits_xv[..., :vocab]
    pad = jnp.full(logits_xv.shape[:-1] + (vocab - v,), -jnp.inf, logits_xv.dtype)
    return jnp.concatenate([logits_xv, pad], axis=-1)
