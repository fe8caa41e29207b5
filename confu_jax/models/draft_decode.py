"""The draft's incremental forward for the decode loop, and its one-layer KV cache.

During decoding the draft runs a few tokens at a time: the accepted tokens' first-step entries
(committed to the draft cache), then one tree level per call, attending the cache, the earlier
levels of this iteration's tree (a scratch buffer) and ConFu's transient future entry
(docs/DESIGN.md §5). ``draft_block`` computes and returns K/V but never writes anything.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.models.draft import DraftFuture, DraftHead, apply_head, draft_logits, embed_tokens
from confu_jax.kernels.blockwise_attention import merge_block_states, softmax_block_state
from confu_jax.models.kv_cache import KVCache, init_cache
from confu_jax.models.spec import ModelSpec


class DraftBlockOutput(NamedTuple):
    logits_btv: jax.Array  # [B,T,V_draft] float32 ([B,1,V_draft] with logits_index_b)
    hidden_btd: jax.Array  # [B,T,d] final-normed
    h_out_btd: jax.Array  # [B,T,d] pre-norm output: the hidden input of these nodes' children
    k_new_bthd: jax.Array  # [B,T,Hkv,hd] this block's keys: commit (step-0 entries) or keep as scratch
    v_new_bthd: jax.Array


def init_draft_cache(spec: ModelSpec, batch: int, max_len: int) -> KVCache:
    """The draft's KV cache: a one-layer ``KVCache`` (commit with ``cache.commit(c, k[None], v[None], n)``)."""
    t = spec.target
    return init_cache(1, batch, max_len, t.n_kv_heads, t.head_dim, jnp.dtype(spec.head.dtype))


def draft_block(spec: ModelSpec, draft_params: dict, embed_vd: jax.Array, tokens_bt: jax.Array,
                hidden_btd: jax.Array, positions_bt: jax.Array, *, cache: Optional[KVCache] = None,
                block_mask_btt: Optional[jax.Array] = None, scratch_k_bmhd: Optional[jax.Array] = None,
                scratch_v_bmhd: Optional[jax.Array] = None, scratch_mask_btm: Optional[jax.Array] = None,
                future: Optional[DraftFuture] = None,
                future_visible_bt: Optional[jax.Array] = None,
                future_input_bd: Optional[jax.Array] = None,
                logits_index_b: Optional[jax.Array] = None) -> DraftBlockOutput:
    """Incremental draft forward of T inputs; never writes anything.

    Input i: (embed(tokens[i]), hidden[i]) at RoPE ``positions[i]``. It attends:
    * ``cache`` (one-layer ``KVCache``): slots < ``cache.length_b`` — committed step-0 entries of
      accepted tokens (input token x[j+1], hidden g[j], position j at slot j);
    * scratch [B,M]: K/V of earlier drafted tree nodes of this iteration, under ``scratch_mask_btm``
      (typically ancestors);
    * the block itself under ``block_mask_btt`` (default causal; a tree level: identity);
    * ``future`` ([B,1,Hkv,hd] from ``draft_future_entry``): visible to every query unless
      ``future_visible_bt`` says otherwise. It is transient: nothing returned contains it.

    Decode use: (1) after verification, run the accepted tokens' step-0 inputs (token x[j+1],
    g[j] from the verification's h_cat) as a causal block and commit their K/V; the output at the
    last one (the anchor p) gives the root's children. (2) Draft tree levels with hidden = the
    parents' ``h_out``, positions = parents' + 1, scratch = earlier levels' K/V.
    ``logits_index_b`` [B]: run the LM head only at that row of the block (logits_btv is then
    [B,1,V_draft]) — ingestion uses one row of up to D+1.
    ``future_input_bd`` [B,d] (ConFu with ``HeadConfig.future_input``, ingestion only): added to every
    row's hidden input for its query and residual, not its key/value — the step-0 form of training,
    whose keys (the committed cache) never carry f; only the anchor row's output is read.
    """
    if future is not None and not spec.head.has_future:
        raise ValueError("draft_block: variant 'eagle3' takes no future entry")
    b, t = tokens_bt.shape
    emb = embed_tokens(embed_vd, tokens_bt)
    hidden_q = None if future_input_bd is None else hidden_btd + future_input_bd[:, None].astype(hidden_btd.dtype)
    q, k, v = apply_head(spec, draft_params, emb, hidden_btd, positions_bt.astype(jnp.int32), hidden_q,
                         method=DraftHead.project)
    if block_mask_btt is None:
        block_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    attn = attend_blocks(q, k, v, block_mask_btt, cache, scratch_k_bmhd, scratch_v_bmhd, scratch_mask_btm,
                         future, future_visible_bt)
    h_out, hidden = apply_head(spec, draft_params, attn, hidden_btd if hidden_q is None else hidden_q,
                               method=DraftHead.finish)
    at = hidden if logits_index_b is None else hidden[jnp.arange(b), logits_index_b][:, None]
    return DraftBlockOutput(draft_logits(spec, draft_params, at), hidden, h_out, k, v)


def attend_blocks(q_bthd, k_bthd, v_bthd, block_mask_btt, cache, scratch_k_bmhd, scratch_v_bmhd,
                  scratch_mask_btm, future=None, future_visible_bt=None):
    """Softmax over [cache | scratch | block | future] as per-block states merged by their maxima
    (``kernels.blockwise_attention``): the draft cache is read in place, in its head-major layout
    and its own dtype, at every tree depth — no transposed, concatenated or upcast copy of it —
    with float32 accumulation. The future entry is one key shared by a row's queries. Shared by
    every one-layer drafter with a KV cache (the EAGLE-3 / ConFu head, the MTP module)."""
    b, t, hq, d = q_bthd.shape
    hkv = k_bthd.shape[2]
    q = q_bthd.reshape(b, t, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    scale, f32 = 1.0 / d ** 0.5, jnp.float32

    def scores(keys, spec_):
        return jnp.einsum(f"bkgtd,{spec_}->bkgts", q, keys.astype(q.dtype), preferred_element_type=f32) * scale

    parts = []
    if cache is not None:
        k_c, v_c = cache.k_lbhsd[0], cache.v_lbhsd[0]  # [B,Hkv,S,hd]
        visible = jnp.arange(cache.max_len)[None, :] < cache.length_b[:, None]  # [B,S]
        parts.append(softmax_block_state(scores(k_c, "bksd"), visible[:, None, None, None], v_c, "bksd"))
    if scratch_k_bmhd is not None:
        parts.append(softmax_block_state(scores(scratch_k_bmhd, "bskd"), scratch_mask_btm[:, None, None],
                                         scratch_v_bmhd, "bskd"))
    parts.append(softmax_block_state(scores(k_bthd, "bskd"), block_mask_btt[:, None, None], v_bthd, "bskd"))
    if future is not None:
        vis = jnp.ones((b, t), bool) if future_visible_bt is None else future_visible_bt
        s_f = scores(future.k_bnhd[:, :1], "bskd")
        if future.bias_h is not None:  # HeadConfig.future_bias: a learned logit per query head
            s_f = s_f + future.bias_h.astype(f32).reshape(1, hkv, hq // hkv, 1, 1)
        parts.append(softmax_block_state(s_f, vis[:, None, None, :, None],
                                         future.v_bnhd[:, :1], "bskd"))
    out = merge_block_states(parts)  # [B,Hkv,G,T,D] f32
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q_bthd.dtype)
