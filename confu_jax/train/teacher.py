"""The training teacher: the target's distribution renormalised over the draft vocabulary.

EAGLE-3's teacher is ``softmax(target_logits[..., d2t])``. It is computed from the LM-head rows in d2t
order, so only [B, N, V_draft] logits ever exist; the full-vocabulary argmax (which decides whether a
position is trained at all: EAGLE-3's ``t2d`` mask) and log-sum-exp come from a scan over vocabulary
chunks (``full_vocab_argmax_lse``). Online (``teacher_from_hidden``, from a target pass) or offline
(``teacher_from_offline``, from stored target features). Every family whose loss is a distillation to
the target reads it from here; the ConFu / EAGLE-3 objective is ``train.loss``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from confu_jax.models.spec import ModelSpec
from confu_jax.models.target import lm_head_matrix


class Teacher(NamedTuple):
    logp_bnv: jax.Array  # [B,N,V_draft] float32 log target probs renormalised over the draft vocab
    in_draft_bn: jax.Array  # [B,N] bool: the target's full-vocabulary argmax has a draft id
    argmax_bn: jax.Array  # [B,N] int32 the target's full-vocabulary argmax (target ids)
    draft_mass_bn: jax.Array  # [B,N] float32 target probability mass inside the draft vocab


def lm_head_layout(spec: ModelSpec, target_params: dict) -> tuple[jax.Array, int]:
    """The target's LM-head matrix and its vocabulary axis (``models.target.lm_head_matrix``)."""
    return lm_head_matrix(spec.target, target_params)


def _scores(hidden_bnd: jax.Array, w: jax.Array, vocab_axis: int) -> jax.Array:
    """float32 logits of hidden states against LM-head columns.

    Same dtypes (e.g. a bf16 target): multiply natively with float32 accumulation — products of
    bf16 values are exact in float32, so this equals ``Llama.logits``' upcast-then-multiply up to
    summation order, without a float32 copy of the (gathered) LM head. Mixed dtypes: upcast both.
    """
    if hidden_bnd.dtype != w.dtype:
        hidden_bnd, w = hidden_bnd.astype(jnp.float32), w.astype(jnp.float32)
    eq = "bnd,vd->bnv" if vocab_axis == 0 else "bnd,dv->bnv"
    return jnp.einsum(eq, hidden_bnd, w, preferred_element_type=jnp.float32)


def full_vocab_argmax_lse(hidden_bnd: jax.Array, w: jax.Array, vocab_axis: int, vocab_chunk: int):
    """(argmax [B,N] int32, log-sum-exp [B,N] float32) of the full-vocabulary logits, chunk by chunk.

    A ``lax.scan`` over ceil(V / C) chunks keeps a running max, its index and a rescaled sum of
    exponentials (online softmax), so only [B, N, C] logits exist at a time. The last chunk is
    slid back to end at V (no padded copy of a 128k-row matrix); its columns that an earlier chunk
    already covered are masked out. Ties resolve to the smallest id, like ``jnp.argmax``.
    """
    v = w.shape[vocab_axis]
    c = v if vocab_chunk <= 0 else min(int(vocab_chunk), v)
    n_chunks = -(-v // c)
    b, n, _ = hidden_bnd.shape

    def body(carry, i):
        best, best_id, m, s = carry
        nominal = i * c
        start = jnp.minimum(nominal, v - c)
        w_c = jax.lax.dynamic_slice_in_dim(w, start, c, axis=vocab_axis)
        l_bnc = _scores(hidden_bnd, w_c, vocab_axis)
        ids_c = start + jnp.arange(c, dtype=jnp.int32)
        l_bnc = jnp.where(ids_c >= nominal, l_bnc, -jnp.inf)  # columns already seen
        c_best = jnp.max(l_bnc, axis=-1)
        c_id = start + jnp.argmax(l_bnc, axis=-1).astype(jnp.int32)
        take = c_best > best  # strict: an earlier (smaller) id wins ties
        m_new = jnp.maximum(m, c_best)
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(l_bnc - m_new[..., None]), axis=-1)
        return (jnp.where(take, c_best, best), jnp.where(take, c_id, best_id), m_new, s), None

    init = (jnp.full((b, n), -jnp.inf, jnp.float32), jnp.zeros((b, n), jnp.int32),
            jnp.full((b, n), -jnp.inf, jnp.float32), jnp.zeros((b, n), jnp.float32))
    (_, arg, m, s), _ = jax.lax.scan(body, init, jnp.arange(n_chunks, dtype=jnp.int32))
    return arg, m + jnp.log(s)


class TeacherStats(NamedTuple):
    """What the teacher is made of (and what ``launch.target_features`` stores per token)."""

    logits_bnv: jax.Array  # [B,N,V_draft] float32 target logits at the d2t columns
    lse_draft_bn: jax.Array  # [B,N] float32 log-sum-exp of those
    argmax_bn: jax.Array  # [B,N] int32 full-vocabulary argmax (target ids)
    lse_full_bn: jax.Array  # [B,N] float32 full-vocabulary log-sum-exp


def teacher_stats(spec: ModelSpec, target_params: dict, draft_vocab: dict, hidden_bnd: jax.Array,
                  vocab_chunk: int) -> TeacherStats:
    """Draft-vocabulary logits and the full-vocabulary argmax / log-sum-exp (no gradient)."""
    hidden_bnd = jax.lax.stop_gradient(hidden_bnd)
    w, axis = lm_head_layout(spec, jax.lax.stop_gradient(target_params))
    d2t = draft_vocab["d2t"]
    if d2t.shape[0] != spec.head.draft_vocab_size:
        raise ValueError(f"draft_vocab['d2t'] has {d2t.shape[0]} ids; spec.head.draft_vocab_size is "
                         f"{spec.head.draft_vocab_size}")
    if draft_vocab["t2d"].shape[0] != w.shape[axis]:
        raise ValueError(f"draft_vocab['t2d'] covers {draft_vocab['t2d'].shape[0]} target ids; the target "
                         f"LM head has {w.shape[axis]}")
    logits_bnv = _scores(hidden_bnd, jnp.take(w, d2t, axis=axis), axis)  # [B,N,V_draft]
    arg, lse_full = full_vocab_argmax_lse(hidden_bnd, w, axis, vocab_chunk)
    return TeacherStats(logits_bnv, jax.nn.logsumexp(logits_bnv, axis=-1), arg, lse_full)


def teacher_from_hidden(spec: ModelSpec, target_params: dict, draft_vocab: dict, hidden_bnd: jax.Array,
                        vocab_chunk: int) -> Teacher:
    """The EAGLE-3 teacher from the target's final-normed hidden states (no gradient)."""
    st = teacher_stats(spec, target_params, draft_vocab, hidden_bnd, vocab_chunk)
    return Teacher(logp_bnv=st.logits_bnv - st.lse_draft_bn[..., None],
                   in_draft_bn=jnp.take(draft_vocab["t2d"], st.argmax_bn, axis=0),
                   argmax_bn=st.argmax_bn,
                   draft_mass_bn=jnp.exp(st.lse_draft_bn - st.lse_full_bn))


OFFLINE_KEYS = ("h_cat", "teacher_topk_logp", "teacher_topk_ids", "teacher_argmax", "teacher_lse_draft",
                "teacher_lse_full")
_ABSENT = -1e30  # log-probability of a draft id outside the stored top-k (exp -> exactly 0, finite)


def teacher_from_offline(batch: dict, draft_vocab: dict, v_draft: int) -> Teacher:
    """The teacher from stored target features (``launch.target_features``) instead of a target pass.

    The stored top-k log-probabilities (of the target renormalised over the draft vocabulary) are
    scattered into [B,N,V_draft]; ids outside the top-k get probability 0 and the k kept are
    renormalised (``logsumexp`` over them), so with k = V_draft the teacher is the online one (up to
    the stored dtype) and with k < V_draft it is the online teacher truncated to its top-k.
    """
    ids_bnk = batch["teacher_topk_ids"].astype(jnp.int32)
    lp_bnk = batch["teacher_topk_logp"].astype(jnp.float32)
    lp_bnk = lp_bnk - jax.nn.logsumexp(lp_bnk, axis=-1, keepdims=True)
    b, n, _ = ids_bnk.shape
    dense = jnp.full((b, n, v_draft), _ABSENT, jnp.float32)
    dense = dense.at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], ids_bnk].set(lp_bnk)
    arg = batch["teacher_argmax"].astype(jnp.int32)
    lse_d, lse_f = batch["teacher_lse_draft"].astype(jnp.float32), batch["teacher_lse_full"].astype(jnp.float32)
    return Teacher(logp_bnv=jax.lax.stop_gradient(dense), in_draft_bn=jnp.take(draft_vocab["t2d"], arg, axis=0),
                   argmax_bn=arg, draft_mass_bn=jnp.exp(lse_d - lse_f))


def taps_and_teacher(spec: ModelSpec, target_params: dict, draft_vocab: dict, batch: dict, tokens_bn: jax.Array,
                     rows, vocab_chunk: int, who: str):
    """(h_cat [B,N,3d], the teacher, the target pass or None) of a head's batch: the stored features of an
    offline batch (``launch.target_features``: ``OFFLINE_KEYS``), else one target pass (``rows``: the batch's
    ``train.rows.RowLayout``). ``who`` names the loss in errors. No gradient reaches the target."""
    from confu_jax.models.target import real_forward
    from confu_jax.train.rows import pin_rows

    if "h_cat" in batch:
        missing = [k for k in OFFLINE_KEYS if k not in batch]
        if missing:
            raise ValueError(f"{who}: offline batch lacks {missing} (has {sorted(batch)})")
        h_cat_bnc = pin_rows(batch["h_cat"].astype(jnp.dtype(spec.target.dtype)))
        return h_cat_bnc, teacher_from_offline(batch, draft_vocab, spec.head.draft_vocab_size), None
    out = real_forward(spec, target_params, tokens_bn, rows.positions_bn, return_logits=False,
                       segment_ids_bt=rows.segment_ids_bn)
    h_cat_bnc = pin_rows(jax.lax.stop_gradient(out.taps_btc))
    return h_cat_bnc, teacher_from_hidden(spec, target_params, draft_vocab, pin_rows(out.hidden_btd), vocab_chunk), out
