"""EAGLE-3's training-time test (TTT): the draft unrolled over its own predictions, for training.

At inference the draft feeds on its own hidden states after the first step; training it only on
the target's features (teacher forcing) leaves it unprepared for that. TTT unrolls L_ttt steps
over a whole sequence at once: step r at index j reads (embed(x[j+1+r]), g[j] at r = 0, else the
step r-1 output at j) and predicts x[j+2+r] (docs/DESIGN.md §3, §4 "Training objective").
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax import sharding as shd
from confu_jax.models.draft import (DraftHead, apply_head, draft_features, draft_future_entry,
                                    draft_future_input, draft_logits, embed_tokens)
from confu_jax.models.draft_attention import draft_attention_flash
from confu_jax.models.spec import ModelSpec


def _rows(x):
    """Pin a [B, ...] activation to batch-sharded rows (no-op outside the sharded step compiler).

    Besides steering layout propagation, this avoids an XLA:CPU gradient miscompile seen with
    jax 0.10.2 on meshes whose three axes are all > 1 (``confu_jax.sharding.constrain``).
    """
    return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))


class TTTFuture(NamedTuple):
    """Per-position future entries for ``draft_ttt``.

    ``f_bkd`` [B,K,F]: f of each anchor's contemplate (F = d, 3d with future_taps); ``anchor_bk`` [B,K]: anchor positions t;
    ``index_bn`` [B,N] int: which anchor's entry draft position j sees (-1: none). ConFu's
    replication window makes positions t..t+l share anchor t; one entry per position.
    """

    f_bkd: jax.Array
    anchor_bk: jax.Array
    index_bn: jax.Array


class DraftTTTOutput(NamedTuple):
    logits_rbnv: Optional[jax.Array]  # [R,B,N,V_draft] float32 (None if return_logits=False)
    hidden_rbnd: jax.Array  # [R,B,N,d] final-normed (LM-head input); draft_logits() on a slice
    h_out_rbnd: jax.Array  # [R,B,N,d] pre-norm output (the recurrent state)
    # [R,B,N,Hq] float32: each query head's softmax weight on the future entry (future_weights=True)
    future_weight_rbnh: Optional[jax.Array] = None


def draft_ttt(spec: ModelSpec, draft_params: dict, embed_vd: jax.Array, tokens_bn: jax.Array,
              h_cat_bnc: jax.Array, n_steps: int, *, positions_bn: Optional[jax.Array] = None,
              future: Optional[TTTFuture] = None, return_logits: bool = True,
              segment_ids_bn: Optional[jax.Array] = None, future_weights: bool = False,
              remat_mlp: bool = False) -> DraftTTTOutput:
    """EAGLE-3 training-time test over a sequence, ``n_steps`` (L_ttt) unrolled steps.

    ``tokens_bn`` [B,N]: the sequence x (unshifted); ``h_cat_bnc`` [B,N,3d]: target taps at each
    position. Step r, index j: input (embed(x[j+1+r]), g[j] if r == 0 else h_out[r-1, j]), RoPE
    position positions[j]+r, predicts x[j+2+r]; it attends step-0 keys at indices <= j and the
    diagonal entries (j, 1..r), plus j's future entry (every step). With ``HeadConfig.future_input``
    step 0's queries and residual read g[j] + future_in(f of j's anchor); its keys (what the decode
    cache keeps for accepted positions) read g[j] alone. Token indices past N read
    token 0: those outputs have no target and must be masked by the loss.

    Packed rows (several conversations per row): ``segment_ids_bn`` makes step-0 attention
    block-diagonal causal (a query sees only its own segment) and ``positions_bn`` restart at 0 per
    segment (the future entry's key sits at the anchor's in-segment position + 1). A step whose
    input token x[j+1+r] lies in the next segment computes garbage that no trained query reads:
    the loss masks (j, r) unless x[j+2+r] is in j's segment, and query (j, r) only sees step-0
    keys of its own segment at indices <= j and its own index's diagonal.

    Attention runs in flash form (``models.draft_attention.draft_attention_flash``): the step-0 keys
    under the causal / same-segment structure without a [N, N] mask or scores, the per-query keys
    merged by log-sum-exp, so a step's memory is linear in N.

    ``future_weights``: also return the softmax weight each query head gives its future entry
    (``future_weight_rbnh``; 0 where a position has none) — the future probe's attention figure.

    ``remat_mlp``: recompute each step's output projection and MLP in the backward pass instead of
    keeping their [B, N, ffn] activations for all L_ttt steps (Llama-3.1-8B's draft MLP is 14336 wide:
    ~10 GB per row of 8192 tokens); same values and gradients, one draft MLP forward more per step.
    """
    if future is not None and not spec.head.has_future:
        raise ValueError("draft_ttt: variant 'eagle3' takes no future entries")
    if future_weights and future is None:
        raise ValueError("draft_ttt: future_weights needs future entries")
    b, n = tokens_bn.shape
    if positions_bn is None:
        positions_bn = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    g_bnd = _rows(draft_features(spec, draft_params, h_cat_bnc))
    tok_pad = jnp.concatenate([tokens_bn, jnp.zeros((b, n_steps + 1), tokens_bn.dtype)], axis=1)

    extra_k, extra_v, extra_m = [], [], []
    future_bias_h = None  # [Hq] learned logit of the future entry (HeadConfig.future_bias)
    delta_bnd = None  # [B,N,d] what f adds to step 0's hidden input (HeadConfig.future_input)
    if future is not None:
        rows = jnp.arange(b)[:, None]
        anchor_bk = future.anchor_bk.astype(jnp.int32)
        fut = draft_future_entry(spec, draft_params, future.f_bkd, g_bnd[rows, anchor_bk],
                                 positions_bn[rows, anchor_bk])  # key at the anchor's position + 1
        idx = jnp.maximum(future.index_bn, 0)
        extra_k.append(fut.k_bnhd[rows, idx])
        extra_v.append(fut.v_bnhd[rows, idx])
        extra_m.append(future.index_bn >= 0)
        future_bias_h = fut.bias_h
        delta_bkd = draft_future_input(spec, draft_params, future.f_bkd)
        if delta_bkd is not None:
            delta_bnd = jnp.where(extra_m[0][..., None], delta_bkd[rows, idx], 0).astype(g_bnd.dtype)

    hidden = g_bnd
    k0 = v0 = None

    def finish(dp, attn, hidden):
        return apply_head(spec, dp, attn, hidden, method=DraftHead.finish)

    if remat_mlp:
        finish = jax.checkpoint(finish)
    logits_r, hid_r, hout_r, weight_r = [], [], [], []
    for r in range(n_steps):
        emb = embed_tokens(embed_vd, tok_pad[:, 1 + r:1 + r + n])
        hidden_q = None  # step 0 with future_input: queries and residual read g + delta, keys g alone
        if r == 0 and delta_bnd is not None:
            hidden_q = _rows(hidden + delta_bnd)
        q, k, v = apply_head(spec, draft_params, emb, hidden, positions_bn + r, hidden_q, method=DraftHead.project)
        q, k, v = _rows(q), _rows(k), _rows(v)
        if r == 0:
            k0, v0 = k, v
        else:
            extra_k.append(k)
            extra_v.append(v)
            extra_m.append(jnp.ones((b, n), bool))
        if extra_k:
            bias_hx = None
            if future_bias_h is not None:  # the future entry is per-query key 0, then the diagonal
                bias_hx = jnp.pad(future_bias_h.astype(jnp.float32)[:, None], ((0, 0), (0, len(extra_k) - 1)))
            attn = draft_attention_flash(q, k0, v0, segment_ids_bn, jnp.stack(extra_k, 2), jnp.stack(extra_v, 2),
                                         jnp.stack(extra_m, 2), bias_hx=bias_hx, extra_weights=future_weights)
            if future_weights:
                attn, w_bthx = attn
                weight_r.append(w_bthx[..., 0])
        else:
            attn = draft_attention_flash(q, k0, v0, segment_ids_bn)
        h_out, hid = finish(draft_params, _rows(attn), hidden if hidden_q is None else hidden_q)
        h_out, hid = _rows(h_out), _rows(hid)
        hid_r.append(hid)
        hout_r.append(h_out)
        if return_logits:
            logits_r.append(draft_logits(spec, draft_params, hid))
        hidden = h_out
    return DraftTTTOutput(jnp.stack(logits_r) if return_logits else None, jnp.stack(hid_r), jnp.stack(hout_r),
                          jnp.stack(weight_r) if future_weights else None)
