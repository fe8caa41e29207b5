"""The EAGLE-3 draft head (one decoder layer of the target's width) and the pieces every use shares.

EAGLE-3 drafts with a single Llama layer that reads the target's own features instead of running
the target: draft position j reads ``[input_norm(embed(x[j+1])) ; hidden_norm(h_j)]`` (2d), where
h_j is g[j] = fc(h_cat[j]) (3d -> d) at the first draft step and the draft's own pre-norm output
after that; q/k/v project from 2d, o back to d, the residual is h_j, then post-norm -> SwiGLU ->
(+ residual) = ``h_out`` (the recurrent state), final norm -> LM head over the draft vocabulary.
Token embeddings are the target's (frozen, passed in as ``embed_vd``). Index conventions:
docs/DESIGN.md §3; the future entry of ConFu: §4.

ConFu adds one transient key/value per query, the **future entry**, built like a draft input with
token slot [f] = MoE_f(g[p]) and hidden slot f[p] at RoPE position p+1 (``draft_future_entry``);
``eagle3`` has no future path and no extra parameters. ``HeadConfig.future_bias`` (not the paper's)
adds a learned per-head logit to the entry's attention score (param ``future_bias`` [Hq]);
``HeadConfig.future_input`` (not the paper's) also adds a learned map of f (param ``future_in``,
zero at init) to the first draft step's hidden input (``draft_future_input``).

The forwards that use this module live beside it: ``models.draft_ttt`` (training-time test over
a whole sequence) and ``models.draft_decode`` (incremental forward of the decode loop); the
draft/target vocabulary maps are in ``models.vocab_map``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from confu_jax.models.llama import F32_ACCUMULATE, PackableDense, RMSNorm, apply_rope, rope_cos_sin
from confu_jax.models.moe import make_token_embedder
from confu_jax.models.spec import ModelSpec


# ----------------------------------------------------------------------------- module


# The head's plain projections: what the CPU decode path may pack (models.unrolled.prepared_dense).
DENSE_NAMES = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class DraftHead(nn.Module):
    spec: ModelSpec

    def setup(self):
        t, h = self.spec.target, self.spec.head
        d, pd, cd = t.d_model, jnp.dtype(h.param_dtype), jnp.dtype(h.dtype)
        eps = self.spec.draft_rms_eps

        def dense(n, name, **kw):  # packable: the CPU decode path may pack these (DENSE_NAMES)
            return PackableDense(n, use_bias=False, dtype=cd, param_dtype=pd,
                            kernel_init=nn.initializers.normal(h.init_std), name=name, **kw)

        self.fc = dense(d, "fc")
        if h.norm_before_fc:  # speculators' norm-placement flags (DESIGN.md §10)
            self.fc_input_norm = RMSNorm(eps, pd)
        if h.fc_norm:
            self.fc_tap_norms = [RMSNorm(eps, pd) for _ in self.spec.taps]
        self.input_norm = RMSNorm(eps, pd)
        self.hidden_norm = RMSNorm(eps, pd)
        self.q_proj = dense(t.n_heads * t.head_dim, "q_proj")
        self.k_proj = dense(t.n_kv_heads * t.head_dim, "k_proj")
        self.v_proj = dense(t.n_kv_heads * t.head_dim, "v_proj")
        self.o_proj = dense(d, "o_proj")
        self.post_attn_norm = RMSNorm(eps, pd)
        self.gate_proj = dense(self.spec.draft_ffn_dim, "gate_proj")
        self.up_proj = dense(self.spec.draft_ffn_dim, "up_proj")
        self.down_proj = dense(d, "down_proj")
        self.final_norm = RMSNorm(eps, pd)
        self.lm_head = dense(h.draft_vocab_size, "lm_head", dot_general=F32_ACCUMULATE)  # f32 logits
        if h.has_future:
            self.moe_f = make_token_embedder(h.uses_moe, h.n_expert, h.expert_top_k, d, h.init_std, cd, pd)
        if h.future_input:  # zero at init: the head starts as the paper's, and the loss reaches the map directly
            self.future_in = nn.Dense(d, use_bias=False, dtype=cd, param_dtype=pd, kernel_init=nn.initializers.zeros,
                                      name="future_in")
        if h.has_future and h.future_bias is not None:
            self.future_bias = self.param("future_bias", nn.initializers.constant(h.future_bias), (t.n_heads,), pd)
        if h.parallel:  # P-EAGLE: the target features of every slot after the first (speculators: torch.randn)
            self.mask_hidden = self.param("mask_hidden", nn.initializers.normal(1.0), (len(self.spec.taps) * d,), pd)

    def features(self, h_cat_btc):
        x = h_cat_btc.astype(jnp.dtype(self.spec.head.dtype))
        if self.spec.head.norm_before_fc:
            x = self.fc_input_norm(x)
        if self.spec.head.fc_norm:
            x = jnp.concatenate([n(c) for n, c in zip(self.fc_tap_norms, jnp.split(x, len(self.fc_tap_norms), -1))], -1)
        return self.fc(x)

    def project(self, emb_btd, hidden_btd, positions_bt, query_hidden_btd=None):
        """q [B,T,Hq,hd], k/v [B,T,Hkv,hd] (post-RoPE) of draft inputs (embedding, hidden state).
        ``query_hidden_btd``: the queries' hidden input where it differs from the keys' (``future_input``)."""
        t = self.spec.target
        cd = jnp.dtype(self.spec.head.dtype)
        e = self.input_norm(emb_btd.astype(cd))
        x = jnp.concatenate([e, self.hidden_norm(hidden_btd.astype(cd))], -1)
        xq = x if query_hidden_btd is None else jnp.concatenate([e, self.hidden_norm(query_hidden_btd.astype(cd))], -1)
        b, n, _ = x.shape
        q = self.q_proj(xq).reshape(b, n, t.n_heads, t.head_dim)
        k = self.k_proj(x).reshape(b, n, t.n_kv_heads, t.head_dim)
        v = self.v_proj(x).reshape(b, n, t.n_kv_heads, t.head_dim)
        cos, sin = rope_cos_sin(positions_bt, self.spec.draft_rope)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_bthd, residual_btd):
        """(h_out, hidden): pre-norm output (next step's hidden input) and final-normed state."""
        b, n = attn_bthd.shape[:2]
        residual = residual_btd.astype(jnp.dtype(self.spec.head.dtype))
        if self.spec.head.norm_before_residual:
            residual = self.hidden_norm(residual)
        x = residual + self.o_proj(attn_bthd.reshape(b, n, -1))
        hmlp = self.post_attn_norm(x)
        x = x + self.down_proj(nn.silu(self.gate_proj(hmlp)) * self.up_proj(hmlp))
        if self.spec.head.norm_output:  # "EAGLE 3.1": the normed state is both recurrent state and LM-head input
            x = self.final_norm(x)
            return x, x
        return x, self.final_norm(x)

    def logits(self, hidden_btd):
        return self.lm_head(hidden_btd).astype(jnp.float32)

    def future_token(self, g_nd):
        return self.moe_f(g_nd)

    def future_input(self, f_nd):
        return self.future_in(f_nd.astype(jnp.dtype(self.spec.head.dtype)))

    def init_all(self, h_cat_btc, emb_btd, positions_bt):
        g = self.features(h_cat_btc)
        q, k, v = self.project(emb_btd, g, positions_bt)
        if self.spec.head.has_future:
            self.future_token(g)
        if self.spec.head.future_input:
            self.future_input(g)
        h_out, hidden = self.finish(q, g)
        return self.logits(hidden)


# ----------------------------------------------------------------------------- parameters


def init_draft_params(spec: ModelSpec, rng: jax.Array) -> dict:
    t = spec.target
    b, n = 1, 2
    h_cat = jnp.zeros((b, n, len(spec.taps) * t.d_model), jnp.float32)
    emb = jnp.zeros((b, n, t.d_model), jnp.float32)
    return DraftHead(spec).init(rng, h_cat, emb, jnp.zeros((b, n), jnp.int32), method=DraftHead.init_all)["params"]


# ----------------------------------------------------------------------------- shared pieces


def apply_head(spec: ModelSpec, params: dict, *args, method):
    """``DraftHead(spec).apply`` on ``params`` with one of its methods (features, project, finish, ...)."""
    return DraftHead(spec).apply({"params": params}, *args, method=method)


def embed_tokens(embed_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """The target's (frozen) token embeddings: the draft never trains them."""
    return jnp.take(jax.lax.stop_gradient(embed_vd), tokens_bt, axis=0)


def draft_features(spec: ModelSpec, draft_params: dict, h_cat_btc: jax.Array) -> jax.Array:
    """g = fc(h_cat): [..., 3d] -> [..., d]."""
    return apply_head(spec, draft_params, h_cat_btc, method=DraftHead.features)


def draft_logits(spec: ModelSpec, draft_params: dict, hidden_btd: jax.Array) -> jax.Array:
    """Draft-vocab logits (float32) of final-normed hidden states (e.g. ``DraftTTTOutput.hidden``)."""
    return apply_head(spec, draft_params, hidden_btd, method=DraftHead.logits)


class DraftFuture(NamedTuple):
    k_bnhd: jax.Array  # [B,N,Hkv,hd] post-RoPE key of each future entry
    v_bnhd: jax.Array
    bias_h: Optional[jax.Array] = None  # [Hq] logit added to every query head's score of the entry (HeadConfig.future_bias)


def future_hidden(spec: ModelSpec, draft_params: dict, f_bnf: jax.Array) -> jax.Array:
    """f as the draft reads it, [B,N,d]: the contemplate's last layer as it comes, or with
    ``HeadConfig.future_taps`` its taps [B,N,3d] through the draft's fc (``draft_features``), the way
    the draft reads every real position's h_cat."""
    return draft_features(spec, draft_params, f_bnf) if spec.head.future_taps else f_bnf


def draft_future_entry(spec: ModelSpec, draft_params: dict, f_bnd: jax.Array, g_bnd: jax.Array,
                       anchor_bn: jax.Array) -> DraftFuture:
    """K/V of future entries: token slot MoE_f(g[p]), hidden slot f[p], key at position p+1.

    ``f_bnd`` from the target's contemplate (``contemplate_queries`` / ``verify`` / ``prefill``; [B,N,3d]
    with ``future_taps``, read through ``future_hidden``),
    ``g_bnd`` = fc(h_cat[p]) of the anchor, ``anchor_bn`` = p. N anchors per row (decode: N=1).
    """
    if not spec.head.has_future:
        raise ValueError("draft_future_entry: variant 'eagle3' has no future token")
    tok = apply_head(spec, draft_params, g_bnd, method=DraftHead.future_token)
    _, k, v = apply_head(spec, draft_params, tok, future_hidden(spec, draft_params, f_bnd),
                         anchor_bn.astype(jnp.int32) + 1, method=DraftHead.project)
    return DraftFuture(k, v, draft_params["future_bias"] if spec.head.future_bias is not None else None)


def draft_future_input(spec: ModelSpec, draft_params: dict, f_bnd: jax.Array) -> Optional[jax.Array]:
    """What f adds to the first draft step's hidden input (``HeadConfig.future_input``): [B,N,d], or
    None for heads without it. Training adds it at step 0 of every index with an anchor
    (``draft_ttt``), decoding at ingestion (``decode.drafting``); the keys the cache keeps never carry it."""
    if not spec.head.future_input:
        return None
    return apply_head(spec, draft_params, future_hidden(spec, draft_params, f_bnd), method=DraftHead.future_input)
