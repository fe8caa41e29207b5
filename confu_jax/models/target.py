"""The frozen target with ConFu's contemplate machinery (docs/DESIGN.md §4; paper §3.1).

Everything here is a thin layer over ``confu_jax.models.llama.Llama``: the Llama forward already
attends to [cache slots < cache_len | prefix (soft prompts) for queries that may see it | the
block under a block mask], so ConFu reduces to choosing those arguments (the contemplate rules,
anchors and lags: docs/DESIGN.md §3-§4).

Parameter trees (kept separate so an optimizer can never touch the target):

* ``target_params`` — the frozen Llama parameters (``Llama.init`` / ``confu_jax.weights``), stacked
  or ``SplitParams``. Every function here wraps them in ``stop_gradient``: their gradient is zero.
* ``confu_params`` — trainable, ``{}`` for EAGLE-3, else::

      {'soft_prompt_k_lphd': [L, P, Hkv, hd],  # keys stored post-RoPE: no rotation is applied
       'soft_prompt_v_lphd': [L, P, Hkv, hd],
       'moe_con': {...}}                        # EmbeddingMoE (or StaticEmbedding) on h_cat (3d)

Three forms of the contemplate query, one per use:

* ``prefill``             prompt pass, commit, then one contemplate after the last prompt token;
* ``verify``              T tree nodes + T contemplates in one 2T block (``models.tree_layout``);
* ``contemplate_queries`` the training form: K contemplates against per-layer K/V of an already
  computed real-token pass (sequence cost N+K, not 2N), differentiable w.r.t. ``confu_params``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.kernels.flash_attention import CausalSegments
from confu_jax.models.kv_cache import KVCache, commit
from confu_jax.models.llama import Llama, LlamaConfig, LlamaOutput, rms_norm
from confu_jax.models.moe import make_token_embedder
from confu_jax.models.spec import ModelSpec
from confu_jax.models.tree_layout import depth_from_ancestors, verification_layout
from confu_jax.models.unrolled import apply_target, shared_params, target_logits


class VerifyOutput(NamedTuple):
    logits_btv: jax.Array  # [B,T,V] float32, target logits at each tree node
    h_cat_btc: jax.Array  # [B,T,3d] EAGLE-3 taps of each node (next draft features)
    # [B,M,F] f of each contemplate (M = T: one after each node; F = d, or 3d with future_taps); None for eagle3
    future_btd: Optional[jax.Array]
    k_new_lbthd: jax.Array  # [L,B,T,Hkv,hd] the nodes' post-RoPE keys (contemplates' are never kept)
    v_new_lbthd: jax.Array
    hidden_btd: Optional[jax.Array] = None  # [B,T,d] the nodes' final-normed hidden states (Medusa heads read them)


class PrefillOutput(NamedTuple):
    last_logits_bv: jax.Array  # [B,V] float32 logits at the last prompt token (samples the first bonus)
    h_cat_btc: jax.Array  # [B,T,3d] taps of every prompt token (draft features for the draft prefill)
    future_bd: Optional[jax.Array]  # [B,F] f of the contemplate after the last prompt token; None for eagle3
    last_hidden_bd: Optional[jax.Array] = None  # [B,d] final-normed hidden state at the last prompt token
    hidden_btd: Optional[jax.Array] = None  # [B,T,d] final-normed hidden states of every prompt token (MTP reads them)


# ----------------------------------------------------------------------------- parameters


def _con_embedder(spec: ModelSpec):
    h, t = spec.head, spec.target
    return make_token_embedder(h.uses_moe, h.n_expert, h.expert_top_k, t.d_model, h.init_std,
                               jnp.dtype(t.dtype), jnp.dtype(h.param_dtype))


def init_confu_params(spec: ModelSpec, rng: jax.Array) -> dict:
    """Random soft prompts (normal, ``soft_prompt_init_std``) and MoE_con; ``{}`` for eagle3."""
    if not spec.has_future:
        return {}
    t, h = spec.target, spec.head
    k_rng, v_rng, m_rng = jax.random.split(rng, 3)
    shape = (t.n_layers, h.n_soft_prompts, t.n_kv_heads, t.head_dim)
    pd = jnp.dtype(h.param_dtype)
    c = len(spec.taps) * t.d_model
    return {
        "soft_prompt_k_lphd": (h.soft_prompt_init_std * jax.random.normal(k_rng, shape)).astype(pd),
        "soft_prompt_v_lphd": (h.soft_prompt_init_std * jax.random.normal(v_rng, shape)).astype(pd),
        "moe_con": _con_embedder(spec).init(m_rng, jnp.zeros((1, c), jnp.float32))["params"],
    }


def con_embedding(spec: ModelSpec, confu_params: dict, h_cat_nc: jax.Array) -> jax.Array:
    """[con] = MoE_con(h_cat) (or the static embedding), in the target's compute dtype."""
    _require_future(spec, confu_params, "con_embedding")
    return _con_embedder(spec).apply({"params": confu_params["moe_con"]}, h_cat_nc)


def _require_future(spec: ModelSpec, confu_params, fn: str):
    if not spec.has_future:
        raise ValueError(f"{fn}: variant 'eagle3' has no contemplate path")
    if not confu_params or "soft_prompt_k_lphd" not in confu_params:
        raise ValueError(f"{fn}: confu_params lacks 'soft_prompt_k_lphd' (got keys {sorted(confu_params or {})})")


# ----------------------------------------------------------------------------- forwards


def _forward(spec: ModelSpec, target_params, tokens_bt, positions_bt, **kw) -> LlamaOutput:
    """The frozen target's forward on either parameter layout (``models.unrolled.apply_target``);
    the decode loop splits the layers once outside its while_loop. Gradients never reach the target."""
    return apply_target(jax.lax.stop_gradient(target_params), spec.target, tokens_bt, positions_bt, **kw)


def lm_logits(spec: ModelSpec, target_params: dict, hidden_btd: jax.Array) -> jax.Array:
    """The target's LM head (float32) on final-normed hidden states."""
    return target_logits(jax.lax.stop_gradient(target_params), spec.target, hidden_btd)


def future_readout(spec: ModelSpec, target_params, f_bkf: jax.Array) -> jax.Array:
    """[B,K,d] f as the target's LM head reads it (the auxiliary future loss, the f diagnostics): f
    itself — the contemplate's final-normed last layer — or, with ``HeadConfig.future_taps``, its top
    tap through the target's final norm (a logit lens on that layer; the taps are residual states)."""
    if not spec.head.future_taps:
        return f_bkf
    scale = shared_params(jax.lax.stop_gradient(target_params))["final_norm"]["scale"]
    return rms_norm(f_bkf[..., -spec.target.d_model:], scale, spec.target.rms_eps)


def embed_tokens(spec: ModelSpec, target_params: dict, tokens_bt: jax.Array) -> jax.Array:
    return Llama(spec.target).apply({"params": jax.lax.stop_gradient(shared_params(target_params))},
                                    tokens_bt, method=Llama.embed_tokens)


def embedding_table(target_params) -> jax.Array:
    """[V, d] token embeddings of either layout (the draft head reads the target's embeddings)."""
    return shared_params(target_params)["embed"]["embedding"]


def lm_head_matrix(cfg: LlamaConfig, target_params) -> tuple[jax.Array, int]:
    """The target's LM-head matrix and its vocabulary axis, as stored (no transpose, no copy): tied
    embeddings ``embed/embedding`` [V, d] (axis 0), otherwise ``lm_head/kernel`` [d, V] (axis 1). The
    one place that choice is made (the teacher, Medusa's initialisation and shapes read it)."""
    shared = shared_params(target_params)
    if cfg.tie_embeddings:
        return shared["embed"]["embedding"], 0
    if "lm_head" not in shared:
        raise KeyError(f"target params: untied config but no 'lm_head/kernel' (top-level keys: {sorted(shared)})")
    return shared["lm_head"]["kernel"], 1


def real_forward(spec: ModelSpec, target_params: dict, tokens_bt: jax.Array,
                 positions_bt: Optional[jax.Array] = None, *, return_logits: bool = True,
                 segment_ids_bt: Optional[jax.Array] = None) -> LlamaOutput:
    """Plain causal target pass with EAGLE-3 taps (the training form's real-token pass).

    Nothing in it is trainable; its K/V (``k_new_lbthd``) are what ``contemplate_queries`` attends.
    Packed rows pass ``segment_ids_bt`` (attention stays inside a segment) and ``positions_bt``
    restarting at 0 in each segment, so every conversation sees exactly what it would see alone.
    The mask goes down as its structure (``CausalSegments``), so the layers attend in flash form:
    memory linear in N, no [N, N] mask or scores (what lets rows of 8k tokens train on an 8B target).
    """
    b, n = tokens_bt.shape
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    # the mask by its structure, not its [B, N, N] entries: attention runs in flash form (kernels.flash_attention)
    return _forward(spec, target_params, tokens_bt, positions_bt, attend=AttendTo(mask=CausalSegments(segment_ids_bt)),
                    tap_layers=spec.taps, return_logits=return_logits)


def contemplate_queries(spec: ModelSpec, target_params: dict, confu_params: dict, k_lbhsd: jax.Array,
                        v_lbhsd: jax.Array, anchors_bk: jax.Array, con_src_bkc: jax.Array, *,
                        anchor_positions_bk: Optional[jax.Array] = None,
                        segment_start_bk: Optional[jax.Array] = None) -> jax.Array:
    """f for K contemplate tokens, each after its anchor, against precomputed real-token K/V.

    ``k_lbhsd``/``v_lbhsd`` [L,B,Hkv,S,hd], the cache layout: post-RoPE K/V of real tokens, slot
    i = position i (a committed cache, or a ``real_forward``'s ``k_new_lbthd`` through
    ``kv_cache.to_cache_layout``). ``anchors_bk`` [B,K] int: anchor
    positions q; contemplate k has position q+1 and sees slots <= q, the soft prompts and itself
    (not the other contemplates). ``con_src_bkc`` [B,K,3d]: the h_cat that MoE_con reads (training:
    h_cat[q - δ]). Returns f [B,K,F]: the contemplate's final-normed last layer (F = d), or with
    ``HeadConfig.future_taps`` its taps at the EAGLE-3 layers (F = 3d, what the draft's fc reads).
    Differentiable w.r.t. ``confu_params`` only.

    Packed rows: ``anchor_positions_bk`` is the anchor's RoPE position inside its segment (the
    contemplate sits at that + 1; default: the slot index) and ``segment_start_bk`` the first slot of
    its segment — the contemplate sees slots ``segment_start..q`` only, as if its conversation were alone.
    """
    _require_future(spec, confu_params, "contemplate_queries")
    b, k = anchors_bk.shape
    anchors_bk = anchors_bk.astype(jnp.int32)
    emb_bkd = con_embedding(spec, confu_params, con_src_bkc)
    eye = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))
    pos_bk = anchors_bk if anchor_positions_bk is None else anchor_positions_bk.astype(jnp.int32)
    out = _forward(
        spec, target_params,
        None,
        pos_bk + 1,
        embeds_btd=emb_bkd,
        attend=AttendTo(mask=eye, k_cache=jax.lax.stop_gradient(k_lbhsd), v_cache=jax.lax.stop_gradient(v_lbhsd),
                        cache_len=anchors_bk + 1,
                        cache_start=None if segment_start_bk is None else segment_start_bk.astype(jnp.int32),
                        k_prefix=confu_params["soft_prompt_k_lphd"], v_prefix=confu_params["soft_prompt_v_lphd"],
                        prefix_visible=jnp.ones((b, k), bool)),
        return_logits=False,
        remat_layers=True,  # training differentiates through every layer to the soft prompts
        **({"tap_layers": spec.taps} if spec.head.future_taps else {}),
    )
    return out.taps_btc if spec.head.future_taps else out.hidden_btd


def prefill(spec: ModelSpec, target_params: dict, confu_params: dict, cache: KVCache,
            tokens_bt: jax.Array, n_tokens_b: jax.Array, *,
            attend_cache: bool = True) -> tuple[PrefillOutput, KVCache]:
    """Run a (right-padded) prompt block, commit it, then the first contemplate query.

    Row b's prompt is ``tokens_bt[b, :n_tokens_b[b]]``, appended after the row's ``cache.length``
    tokens. The contemplate sits after the last prompt token (anchor q = its position) with
    [con] = MoE_con(h_cat of the token before it) — lag 1, clipped to the block's first token.
    Cost: T (+1 for ConFu) target tokens. Returns the outputs and the cache with the prompt committed.
    ``attend_cache=False`` declares the cache empty and skips attending to it (as ``generate.prefill``).
    """
    b, t = tokens_bt.shape
    n_tokens_b = n_tokens_b.astype(jnp.int32)
    positions = cache.length_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    out = _forward(
        spec, target_params,
        tokens_bt,
        positions,
        attend=AttendTo(k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd, cache_len=cache.length_b) if attend_cache
        else None,
        tap_layers=spec.taps,
        return_logits=False,
    )
    new_cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, n_tokens_b)
    rows = jnp.arange(b)
    last = jnp.maximum(n_tokens_b - 1, 0)
    last_logits = lm_logits(spec, target_params, out.hidden_btd[rows, last][:, None])[:, 0]
    future_bd = None
    if spec.has_future:
        src = out.taps_btc[rows, jnp.maximum(n_tokens_b - 2, 0)]  # h_cat of the token before the anchor
        anchor = (cache.length_b + last)[:, None]
        future_bd = contemplate_queries(spec, target_params, confu_params, new_cache.k_lbhsd, new_cache.v_lbhsd,
                                   anchor, src[:, None])[:, 0]
    return PrefillOutput(last_logits, out.taps_btc, future_bd, out.hidden_btd[rows, last], out.hidden_btd), new_cache


def verify(spec: ModelSpec, target_params: dict, confu_params: dict, cache: KVCache, tokens_bt: jax.Array,
           anc_btt: jax.Array, con_src_bc: Optional[jax.Array] = None,
           depth_bt: Optional[jax.Array] = None, con_nodes_bm: Optional[jax.Array] = None) -> VerifyOutput:
    """Score T tree nodes (and, for ConFu, their contemplates) in one target pass.

    ``tokens_bt`` [B,T]: node tokens, node 0 the root (the bonus token x[p+1]) at position
    ``cache.length_b`` (= p+1); ``anc_btt`` [B,T,T] ancestor-or-self mask (``ancestors_from_parents``);
    ``con_src_bc`` [B,3d]: h_cat[p] of the last accepted token (ConFu only), shared by all T
    contemplates. ``con_nodes_bm`` [B,M] (ConFu, optional): the nodes that get a contemplate
    (sparse contemplates; default every node, M = T); ``future_btd`` is then [B,M,F] in that order.
    Block layout: ``verification_layout``. Cost: T tokens (eagle3), T + M (ConFu).
    The caller commits accepted nodes with ``commit(cache, out.k_new_lbthd, out.v_new_lbthd, n,
    src_idx_bt=path)``.
    """
    b, t = tokens_bt.shape
    if depth_bt is None:
        depth_bt = depth_from_ancestors(anc_btt)
    tp = jax.lax.stop_gradient(target_params)
    cached = AttendTo(k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd, cache_len=cache.length_b)
    common = dict(tap_layers=spec.taps, return_logits=False)
    if not spec.has_future:
        positions = cache.length_b[:, None] + depth_bt.astype(jnp.int32)
        out = _forward(spec, tp, tokens_bt, positions, attend=dataclasses.replace(cached, mask=anc_btt), **common)
        return VerifyOutput(lm_logits(spec, tp, out.hidden_btd), out.taps_btc, None,
                            out.k_new_lbthd, out.v_new_lbthd, out.hidden_btd)
    _require_future(spec, confu_params, "verify")
    if con_src_bc is None:
        raise ValueError("verify: ConFu variants need con_src_bc [B,3d] (h_cat of the last accepted token)")
    positions, mask, prefix_visible = verification_layout(anc_btt, cache.length_b, depth_bt, con_nodes_bm)
    m = positions.shape[1] - t
    node_emb = embed_tokens(spec, tp, tokens_bt)
    con_emb = con_embedding(spec, confu_params, con_src_bc)[:, None].astype(node_emb.dtype)
    embeds = jnp.concatenate([node_emb, jnp.broadcast_to(con_emb, (b, m, node_emb.shape[-1]))], axis=1)
    out = _forward(
        spec, tp, None, positions, embeds_btd=embeds,
        attend=dataclasses.replace(cached, mask=mask, k_prefix=confu_params["soft_prompt_k_lphd"],
                                   v_prefix=confu_params["soft_prompt_v_lphd"], prefix_visible=prefix_visible),
        # the nodes' taps only (tap_rows=t), unless f is the contemplates' taps (future_taps)
        tap_rows=None if spec.head.future_taps else t, **common)
    return VerifyOutput(
        lm_logits(spec, tp, out.hidden_btd[:, :t]),
        out.taps_btc[:, :t],
        out.taps_btc[:, t:] if spec.head.future_taps else out.hidden_btd[:, t:],
        out.k_new_lbthd[:, :, :t],
        out.v_new_lbthd[:, :, :t],
        out.hidden_btd[:, :t],
    )
