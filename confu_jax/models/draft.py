"""EAGLE-3 draft head with ConFu's future token (DESIGN.md §4; EAGLE-3 ``cnets.py``; paper §3).

One decoder layer of the target's width d. Draft position j reads
``x_j = [input_norm(embed(x[j+1])) ; hidden_norm(h_j)]`` (2d) where h_j is the target feature
g[j] = fc(h_cat[j]) (3d -> d) at step 0, or the draft's own pre-norm output later; q/k/v project
from 2d, o back to d, the residual is h_j, then post-norm -> SwiGLU -> (+ residual) = ``h_out``
(the recurrent state), final norm -> ``hidden`` -> LM head over the draft vocabulary.
Position j predicts x[j+2]. Token embeddings are the target's (frozen, passed as ``embed_vd``).

ConFu's **future entry**: one extra key/value per query built like a draft input with token slot
[f] = MoE_f(g[p]) and hidden slot f[p], key rotated at position p+1 (p = the anchor). Only its K/V
are needed (one layer), it is visible to every draft query that has it, and it is never written
to the draft cache. ``eagle3`` has no future path and no extra parameters.

Parameters: ``draft_params`` (trainable: fc, norms, attention, MLP, lm_head, ``moe_f``) and the
non-trainable ``draft_vocab = {'d2t': int32 [V_draft] target id of each draft id,
't2d': bool [V_target] whether a target id is in the draft vocab}`` — the arrays of
``confu_jax.data.draft_vocab.DraftVocab`` (built from token frequencies; it also converts
EAGLE-3's offset-form d2t); ``draft_vocab_from_d2t(vocab.d2t, V_target)`` makes the tree.

Three entry points:

* ``draft_ttt``   — training-time test over a whole sequence (L_ttt unrolled steps, diagonal mask);
* ``draft_block`` — incremental forward of a block of draft inputs against a draft KV cache, a
  scratch of earlier tree nodes, the block itself under a mask, and the transient future entry;
* ``draft_future_entry`` / ``draft_features`` / ``draft_logits`` — the pieces both share.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from confu_jax import sharding as shd
from confu_jax.decode.cache import KVCache, init_cache
from confu_jax.models.attention import NEG_INF
from confu_jax.models.llama import RMSNorm, apply_rope, rope_cos_sin
from confu_jax.models.moe import make_token_embedder
from confu_jax.models.spec import ModelSpec


# ----------------------------------------------------------------------------- module


class DraftHead(nn.Module):
    spec: ModelSpec

    def setup(self):
        t, h = self.spec.target, self.spec.head
        d, pd, cd = t.d_model, jnp.dtype(h.param_dtype), jnp.dtype(h.dtype)

        def dense(n, name):
            return nn.Dense(n, use_bias=False, dtype=cd, param_dtype=pd,
                            kernel_init=nn.initializers.normal(h.init_std), name=name)

        self.fc = dense(d, "fc")
        self.input_norm = RMSNorm(t.rms_eps, pd)
        self.hidden_norm = RMSNorm(t.rms_eps, pd)
        self.q_proj = dense(t.n_heads * t.head_dim, "q_proj")
        self.k_proj = dense(t.n_kv_heads * t.head_dim, "k_proj")
        self.v_proj = dense(t.n_kv_heads * t.head_dim, "v_proj")
        self.o_proj = dense(d, "o_proj")
        self.post_attn_norm = RMSNorm(t.rms_eps, pd)
        self.gate_proj = dense(self.spec.draft_ffn_dim, "gate_proj")
        self.up_proj = dense(self.spec.draft_ffn_dim, "up_proj")
        self.down_proj = dense(d, "down_proj")
        self.final_norm = RMSNorm(t.rms_eps, pd)
        self.lm_head = dense(h.draft_vocab_size, "lm_head")
        if h.has_future:
            self.moe_f = make_token_embedder(h.uses_moe, h.n_expert, h.expert_top_k, d, h.init_std, cd, pd)

    def features(self, h_cat_btc):
        return self.fc(h_cat_btc.astype(jnp.dtype(self.spec.head.dtype)))

    def project(self, emb_btd, hidden_btd, positions_bt):
        """q [B,T,Hq,hd], k/v [B,T,Hkv,hd] (post-RoPE) of draft inputs (embedding, hidden state)."""
        t = self.spec.target
        cd = jnp.dtype(self.spec.head.dtype)
        x = jnp.concatenate([self.input_norm(emb_btd.astype(cd)), self.hidden_norm(hidden_btd.astype(cd))], -1)
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, t.n_heads, t.head_dim)
        k = self.k_proj(x).reshape(b, n, t.n_kv_heads, t.head_dim)
        v = self.v_proj(x).reshape(b, n, t.n_kv_heads, t.head_dim)
        cos, sin = rope_cos_sin(positions_bt, t)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_bthd, residual_btd):
        """(h_out, hidden): pre-norm output (next step's hidden input) and final-normed state."""
        b, n = attn_bthd.shape[:2]
        x = residual_btd.astype(jnp.dtype(self.spec.head.dtype)) + self.o_proj(attn_bthd.reshape(b, n, -1))
        hmlp = self.post_attn_norm(x)
        x = x + self.down_proj(nn.silu(self.gate_proj(hmlp)) * self.up_proj(hmlp))
        return x, self.final_norm(x)

    def logits(self, hidden_btd):
        return self.lm_head(hidden_btd).astype(jnp.float32)

    def future_token(self, g_nd):
        return self.moe_f(g_nd)

    def init_all(self, h_cat_btc, emb_btd, positions_bt):
        g = self.features(h_cat_btc)
        q, k, v = self.project(emb_btd, g, positions_bt)
        if self.spec.head.has_future:
            self.future_token(g)
        h_out, hidden = self.finish(q, g)
        return self.logits(hidden)


# ----------------------------------------------------------------------------- params and vocab


def init_draft_params(spec: ModelSpec, rng: jax.Array) -> dict:
    t = spec.target
    b, n = 1, 2
    h_cat = jnp.zeros((b, n, len(spec.taps) * t.d_model), jnp.float32)
    emb = jnp.zeros((b, n, t.d_model), jnp.float32)
    return DraftHead(spec).init(rng, h_cat, emb, jnp.zeros((b, n), jnp.int32), method=DraftHead.init_all)["params"]


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
    as ``train.loss.lm_head_layout`` returns it; only the V_draft rows are gathered, never the
    whole matrix transposed.
    """
    rows = jnp.take(target_lm_head, jnp.asarray(d2t), axis=vocab_axis)
    return rows.T if vocab_axis == 0 else rows


# ----------------------------------------------------------------------------- attention


def draft_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, mask_bts: jax.Array,
                    k_btehd: Optional[jax.Array] = None, v_btehd: Optional[jax.Array] = None,
                    mask_bte: Optional[jax.Array] = None) -> jax.Array:
    """Softmax attention over keys shared by all queries [B,S] and per-query keys [B,T,E].

    The per-query block is what makes TTT's diagonal (query (j,s) sees entries (j,1..s) of its
    own index only) and per-position future entries cost O(T·E) instead of a dense [T, T·L] mask.
    float32 scores; a query that sees nothing returns zeros.
    """
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32) * (1.0 / d ** 0.5)
    s_sh = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd.astype(jnp.float32))
    s_sh = jnp.where(mask_bts[:, None, None], s_sh, NEG_INF)
    parts = [s_sh]
    if k_btehd is not None:
        s_ex = jnp.einsum("btkgd,btekd->bkgte", q, k_btehd.astype(jnp.float32))
        parts.append(jnp.where(mask_bte[:, None, None], s_ex, NEG_INF))
    s_all = jnp.concatenate(parts, axis=-1)
    m = jnp.max(s_all, axis=-1, keepdims=True)
    p = jnp.where(s_all <= NEG_INF / 2, 0.0, jnp.exp(s_all - m))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den == 0, 1.0, den)
    n_sh = k_bshd.shape[1]
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :n_sh], v_bshd.astype(jnp.float32))
    if k_btehd is not None:
        out = out + jnp.einsum("bkgte,btekd->btkgd", p[..., n_sh:], v_btehd.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q_bthd.dtype)


# ----------------------------------------------------------------------------- shared pieces


def _apply(spec: ModelSpec, params: dict, *args, method):
    return DraftHead(spec).apply({"params": params}, *args, method=method)


def _embed(embed_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    return jnp.take(jax.lax.stop_gradient(embed_vd), tokens_bt, axis=0)


def draft_features(spec: ModelSpec, draft_params: dict, h_cat_btc: jax.Array) -> jax.Array:
    """g = fc(h_cat): [..., 3d] -> [..., d]."""
    return _apply(spec, draft_params, h_cat_btc, method=DraftHead.features)


def draft_logits(spec: ModelSpec, draft_params: dict, hidden_btd: jax.Array) -> jax.Array:
    """Draft-vocab logits (float32) of final-normed hidden states (e.g. ``DraftTTTOutput.hidden``)."""
    return _apply(spec, draft_params, hidden_btd, method=DraftHead.logits)


class DraftFuture(NamedTuple):
    k_bnhd: jax.Array  # [B,N,Hkv,hd] post-RoPE key of each future entry
    v_bnhd: jax.Array


def draft_future_entry(spec: ModelSpec, draft_params: dict, f_bnd: jax.Array, g_bnd: jax.Array,
                       anchor_bn: jax.Array) -> DraftFuture:
    """K/V of future entries: token slot MoE_f(g[p]), hidden slot f[p], key at position p+1.

    ``f_bnd`` from the target's contemplate (``contemplate_queries`` / ``verify`` / ``prefill``),
    ``g_bnd`` = fc(h_cat[p]) of the anchor, ``anchor_bn`` = p. N anchors per row (decode: N=1).
    """
    if not spec.head.has_future:
        raise ValueError("draft_future_entry: variant 'eagle3' has no future token")
    tok = _apply(spec, draft_params, g_bnd, method=DraftHead.future_token)
    _, k, v = _apply(spec, draft_params, tok, f_bnd, anchor_bn.astype(jnp.int32) + 1, method=DraftHead.project)
    return DraftFuture(k, v)


# ----------------------------------------------------------------------------- training-time test


def _rows(x):
    """Pin a [B, ...] activation to batch-sharded rows (no-op outside the sharded step compiler).

    Besides steering layout propagation, this avoids an XLA:CPU gradient miscompile seen with
    jax 0.10.2 on meshes whose three axes are all > 1 (``confu_jax.sharding.constrain``).
    """
    return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))



class TTTFuture(NamedTuple):
    """Per-position future entries for ``draft_ttt``.

    ``f_bkd`` [B,K,d]: f of each anchor's contemplate; ``anchor_bk`` [B,K]: anchor positions t;
    ``index_bn`` [B,N] int: which anchor's entry draft position j sees (-1: none). ConFu's
    replication window makes positions t..t+l share anchor t; one entry per position.
    """

    f_bkd: jax.Array
    anchor_bk: jax.Array
    index_bn: jax.Array


class DraftTTTOutput(NamedTuple):
    logits_sbnv: Optional[jax.Array]  # [S,B,N,V_draft] float32 (None if return_logits=False)
    hidden_sbnd: jax.Array  # [S,B,N,d] final-normed (LM-head input); draft_logits() on a slice
    h_out_sbnd: jax.Array  # [S,B,N,d] pre-norm output (the recurrent state)


def draft_ttt(spec: ModelSpec, draft_params: dict, embed_vd: jax.Array, tokens_bn: jax.Array,
              h_cat_bnc: jax.Array, n_steps: int, *, positions_bn: Optional[jax.Array] = None,
              future: Optional[TTTFuture] = None, return_logits: bool = True) -> DraftTTTOutput:
    """EAGLE-3 training-time test over a sequence, ``n_steps`` (L_ttt) unrolled steps.

    ``tokens_bn`` [B,N]: the sequence x (unshifted); ``h_cat_bnc`` [B,N,3d]: target taps at each
    position. Step s, index j: input (embed(x[j+1+s]), g[j] if s == 0 else h_out[s-1, j]), RoPE
    position positions[j]+s, predicts x[j+2+s]; it attends step-0 keys at indices <= j and the
    diagonal entries (j, 1..s), plus j's future entry (every step). Token indices past N read
    token 0: those outputs have no target and must be masked by the loss. Right padding only
    (no packing): step-0 attention is plain causal.
    """
    if future is not None and not spec.head.has_future:
        raise ValueError("draft_ttt: variant 'eagle3' takes no future entries")
    b, n = tokens_bn.shape
    if positions_bn is None:
        positions_bn = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    g_bnd = _rows(draft_features(spec, draft_params, h_cat_bnc))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    tok_pad = jnp.concatenate([tokens_bn, jnp.zeros((b, n_steps + 1), tokens_bn.dtype)], axis=1)

    extra_k, extra_v, extra_m = [], [], []
    if future is not None:
        rows = jnp.arange(b)[:, None]
        anchor_bk = future.anchor_bk.astype(jnp.int32)
        fut = draft_future_entry(spec, draft_params, future.f_bkd, g_bnd[rows, anchor_bk], anchor_bk)
        idx = jnp.maximum(future.index_bn, 0)
        extra_k.append(fut.k_bnhd[rows, idx])
        extra_v.append(fut.v_bnhd[rows, idx])
        extra_m.append(future.index_bn >= 0)

    hidden = g_bnd
    k0 = v0 = None
    logits_s, hid_s, hout_s = [], [], []
    for s in range(n_steps):
        emb = _embed(embed_vd, tok_pad[:, 1 + s:1 + s + n])
        q, k, v = _apply(spec, draft_params, emb, hidden, positions_bn + s, method=DraftHead.project)
        q, k, v = _rows(q), _rows(k), _rows(v)
        if s == 0:
            k0, v0 = k, v
        else:
            extra_k.append(k)
            extra_v.append(v)
            extra_m.append(jnp.ones((b, n), bool))
        if extra_k:
            attn = draft_attention(q, k0, v0, causal, jnp.stack(extra_k, 2), jnp.stack(extra_v, 2),
                                   jnp.stack(extra_m, 2))
        else:
            attn = draft_attention(q, k0, v0, causal)
        h_out, hid = _apply(spec, draft_params, _rows(attn), hidden, method=DraftHead.finish)
        h_out, hid = _rows(h_out), _rows(hid)
        hid_s.append(hid)
        hout_s.append(h_out)
        if return_logits:
            logits_s.append(draft_logits(spec, draft_params, hid))
        hidden = h_out
    return DraftTTTOutput(jnp.stack(logits_s) if return_logits else None, jnp.stack(hid_s), jnp.stack(hout_s))


# ----------------------------------------------------------------------------- incremental decode


class DraftBlockOutput(NamedTuple):
    logits_btv: jax.Array  # [B,T,V_draft] float32
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
                future_visible_bt: Optional[jax.Array] = None) -> DraftBlockOutput:
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
    """
    if future is not None and not spec.head.has_future:
        raise ValueError("draft_block: variant 'eagle3' takes no future entry")
    b, t = tokens_bt.shape
    emb = _embed(embed_vd, tokens_bt)
    q, k, v = _apply(spec, draft_params, emb, hidden_btd, positions_bt.astype(jnp.int32), method=DraftHead.project)
    if block_mask_btt is None:
        block_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ks, vs, ms = [k], [v], [block_mask_btt]
    if scratch_k_bmhd is not None:
        ks.insert(0, scratch_k_bmhd)
        vs.insert(0, scratch_v_bmhd)
        ms.insert(0, scratch_mask_btm)
    if cache is not None:
        s = cache.max_len
        ks.insert(0, cache.k_lbshd[0])
        vs.insert(0, cache.v_lbshd[0])
        ms.insert(0, jnp.broadcast_to(jnp.arange(s)[None, None, :] < cache.length_b[:, None, None], (b, t, s)))
    ks = [x.astype(k.dtype) for x in ks]
    vs = [x.astype(v.dtype) for x in vs]
    ek = ev = em = None
    if future is not None:
        ek = jnp.broadcast_to(future.k_bnhd[:, :1][:, None], (b, t, 1) + k.shape[2:])
        ev = jnp.broadcast_to(future.v_bnhd[:, :1][:, None], (b, t, 1) + v.shape[2:])
        em = jnp.ones((b, t, 1), bool) if future_visible_bt is None else future_visible_bt[:, :, None]
    attn = draft_attention(q, jnp.concatenate(ks, 1), jnp.concatenate(vs, 1), jnp.concatenate(ms, 2), ek, ev, em)
    h_out, hidden = _apply(spec, draft_params, attn, hidden_btd, method=DraftHead.finish)
    return DraftBlockOutput(draft_logits(spec, draft_params, hidden), hidden, h_out, k, v)
