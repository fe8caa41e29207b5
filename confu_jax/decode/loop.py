"""Speculative decoding (EAGLE-3, ConFu) as one jitted ``lax.while_loop`` with static shapes.

One program per (model spec, draft plan, verification rule, batch, prompt bucket, cache size,
max_new_tokens); temperature, top-p, EOS ids and the RNG key are traced. Nothing leaves the device
between iterations: the host sees the prompt going in and the finished token buffer coming out.

One iteration (docs/DESIGN.md §5; positions and entries: §3):

1. **Draft** the tree (``decode.drafting``): chain, static tree, EAGLE-2 dynamic tree or a
   sampled chain.
2. **Verify** the T nodes in one target pass (``models.target.verify``; 2T queries with ConFu's
   contemplates, whose [con] reads h_cat[p]) and apply the lossless rule (``decode.verify``).
3. **Commit** the accepted path's target K/V to contiguous cache slots, emit the accepted tokens
   and the bonus (clipped at EOS and max_new_tokens), and refill the ingestion buffer with the
   accepted nodes' h_cat; f for the next iteration is the contemplate after the last accepted node.

Stopping (``decode.stopping``, shared with AR): EOS, max_new_tokens, or a cache that cannot hold
another verification (length + D + 1 > max_len). Counters: ``accept_log_bi[b, i]`` = tokens
emitted by row b's i-th target pass (bonus included: Spec-Bench's τ is their mean); the first
token comes from prefill and is not in the log.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from confu_jax import sharding as shd

from confu_jax.decode import verify as verify_lib
from confu_jax.decode.drafting import draft_tree
from confu_jax.decode.plans import DraftPlan, verification_rule
from confu_jax.decode.requests import default_unroll_layers, validate_request
from confu_jax.decode.sampling import choose_token
from confu_jax.decode.sharded import constrain_tree, place_request, place_spec_params
from confu_jax.decode.spec_params import SpecParams
from confu_jax.decode.spec_state import SpecResult, SpecState
from confu_jax.decode.stopping import PAD_OUT, emit, is_eos, update_stop
from confu_jax.models import draft as draft_lib
from confu_jax.models import target as target_lib
from confu_jax.models.draft_decode import draft_block, init_draft_cache
from confu_jax.models.kv_cache import commit, init_cache
from confu_jax.models.spec import ModelSpec
from confu_jax.models.unrolled import SplitParams, split_layers


# ----------------------------------------------------------------------------- one iteration


def _verify(spec: ModelSpec, params: SpecParams, rule: str, s: SpecState, tree, q_btv, key,
            temperature, top_p, con_nodes_bm=None):
    """Target pass over the tree and the acceptance rule -> (target outputs, Verification)."""
    rows = jnp.arange(s.root_b.shape[0])
    hcat_anchor = s.ingest_h_cat_bac[rows, s.ingest_count_b - 1]  # h_cat[p]: what [con] reads
    vo = target_lib.verify(spec, params.target, params.confu, s.cache, tree.tokens_bt, tree.ancestor_btt,
                           con_src_bc=hcat_anchor if spec.head.has_future else None, depth_bt=tree.depth_bt,
                           con_nodes_bm=con_nodes_bm)
    if rule == "greedy":
        ver = verify_lib.verify_greedy(tree, vo.logits_btv)
    elif rule == "sampled_tree":
        ver = verify_lib.verify_sampled_tree(tree, vo.logits_btv, key, temperature, top_p)
    else:
        ver = verify_lib.verify_sampled_chain(tree, vo.logits_btv, q_btv, key, temperature, top_p)
    return vo, ver


def _emit_accepted(s: SpecState, ver, active, eos_e, max_new_tokens: int):
    """Write the accepted tokens + bonus, clipped at the first EOS and at max_new_tokens
    -> (tokens_bn, n_generated_b, n_emit_b, hit_eos_b)."""
    b, a = ver.emitted_bd.shape
    rows = jnp.arange(b)
    j = jnp.arange(a)[None]
    in_path = j < ver.n_accepted_b[:, None]
    eos_bd = is_eos(ver.emitted_bd, eos_e) & in_path
    first_eos = jnp.argmax(eos_bd, axis=1)
    n_emit = jnp.where(jnp.any(eos_bd, axis=1), first_eos + 1, ver.n_accepted_b)
    n_emit = jnp.minimum(n_emit, max_new_tokens - s.n_generated_b)
    n_emit = jnp.where(active, n_emit, 0).astype(jnp.int32)
    cols = jnp.where(j < n_emit[:, None], s.n_generated_b[:, None] + j, s.tokens_bn.shape[1])
    tokens_bn = s.tokens_bn.at[rows[:, None], cols].set(ver.emitted_bd, mode="drop")
    hit_eos = jnp.any(eos_bd & (j < n_emit[:, None]), axis=1)
    return tokens_bn, s.n_generated_b + n_emit, n_emit, hit_eos


def _future_source(tree, last_node_b: jax.Array, con_nodes_bm) -> jax.Array:
    """Index of the contemplate whose f the next iteration uses: the last accepted node's own, or
    with sparse contemplates that of its deepest contemplated ancestor-or-self (the root always
    has one) -> [B] index into the verification's contemplates."""
    if con_nodes_bm is None:
        return last_node_b
    rows = jnp.arange(last_node_b.shape[0])
    on_path_bm = jnp.take_along_axis(tree.ancestor_btt[rows, last_node_b], con_nodes_bm, axis=1)
    depth_bm = jnp.take_along_axis(tree.depth_bt, con_nodes_bm, axis=1)
    return jnp.argmax(jnp.where(on_path_bm, depth_bm, -1), axis=1)


def iteration(spec: ModelSpec, params: SpecParams, plan: DraftPlan, rule: str, s: SpecState,
              temperature, top_p, eos_e, *, max_new_tokens: int, max_len: int) -> SpecState:
    """Draft, verify, commit and emit once for every row (done rows ride along unchanged)."""
    b, a = s.ingest_tokens_ba.shape
    rows = jnp.arange(b)
    active = ~s.done_b
    k_draft, k_verify = jax.random.split(jax.random.fold_in(jax.random.fold_in(s.key, 1), s.iteration))
    anchor_b = s.cache.length_b - 1  # p: the last accepted position

    tree, q_btv, draft_cache, con_nodes = draft_tree(spec, params, plan, s, anchor_b, k_draft, temperature, top_p)
    vo, ver = _verify(spec, params, rule, s, tree, q_btv, k_verify, temperature, top_p, con_nodes)

    path = jnp.maximum(ver.path_bd, 0)  # [B, A]
    cache = commit(s.cache, vo.k_new_lbthd, vo.v_new_lbthd, jnp.where(active, ver.n_accepted_b, 0),
                   src_idx_bt=path)
    tokens_bn, n_gen, n_emit, hit_eos = _emit_accepted(s, ver, active, eos_e, max_new_tokens)
    log_col = jnp.where(active, s.n_passes_b, s.accept_log_bi.shape[1])
    accept_log = s.accept_log_bi.at[rows, log_col].set(n_emit, mode="drop")
    done_b, reason_b = update_stop(active, hit_eos, n_gen, cache.length_b + a, s.done_b, s.reason_b,
                                   max_new_tokens=max_new_tokens, max_len=max_len)

    keep = active[:, None]
    hcat_path = jnp.take_along_axis(vo.h_cat_btc, path[..., None], axis=1)
    future_new, future_anchor = s.future_bd, s.future_anchor_b
    if spec.head.has_future:
        c = _future_source(tree, ver.last_node_b, con_nodes)
        future_new = vo.future_btd[rows, c]
        node = ver.last_node_b if con_nodes is None else con_nodes[rows, c]
        future_anchor = anchor_b + 1 + tree.depth_bt[rows, node]  # that node's position
    return s.replace(
        tokens_bn=tokens_bn,
        n_generated_b=n_gen,
        done_b=done_b,
        reason_b=reason_b,
        cache=cache,
        draft_cache=draft_cache,
        root_b=jnp.where(active, ver.bonus_b, s.root_b),
        ingest_tokens_ba=jnp.where(keep, jnp.maximum(ver.emitted_bd, 0), s.ingest_tokens_ba),
        ingest_h_cat_bac=jnp.where(keep[..., None], hcat_path.astype(s.ingest_h_cat_bac.dtype),
                                   s.ingest_h_cat_bac),
        ingest_count_b=jnp.where(active, ver.n_accepted_b, s.ingest_count_b),
        future_bd=jnp.where(keep, future_new.astype(s.future_bd.dtype), s.future_bd),
        future_anchor_b=jnp.where(active, future_anchor, s.future_anchor_b),
        accept_log_bi=accept_log,
        n_passes_b=s.n_passes_b + active.astype(jnp.int32),
        iteration=s.iteration + 1,
    )


# ----------------------------------------------------------------------------- prefill + loop

_TRACE_COUNT = [0]


def trace_count() -> int:
    """Times the speculative program was traced (= compiled) in this process."""
    return _TRACE_COUNT[0]


def _prefill(spec: ModelSpec, params: SpecParams, plan: DraftPlan, tokens_bt, lengths_b, temperature,
             top_p, eos_e, key, *, max_new_tokens: int, max_len: int) -> SpecState:
    """Target prefill (+ the first contemplate), the first token, and the draft prefill."""
    t = spec.target
    b, width = tokens_bt.shape
    a = plan.max_depth + 1
    rows = jnp.arange(b)
    cache = init_cache(t.n_layers, b, max_len, t.n_kv_heads, t.head_dim, jnp.dtype(t.dtype),
                       per_layer=isinstance(params.target, SplitParams))  # layer-unrolled: read in place
    # attend_cache=False: the cache is empty, and attending to a freshly zeroed cache makes XLA
    # constant-fold a batch-sized, fully masked score block (seconds of compile time)
    pre, cache = target_lib.prefill(spec, params.target, params.confu, cache, tokens_bt, lengths_b,
                                    attend_cache=False)
    first_b = choose_token(jax.random.fold_in(key, 0), pre.last_logits_bv, temperature, top_p)

    # draft prefill: entries j = 0..n-2 (token x[j+1], g[j]); entry n-1 waits in the ingestion buffer
    nxt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros((b, 1), tokens_bt.dtype)], axis=1)
    g_btd = draft_lib.draft_features(spec, params.draft, pre.h_cat_btc)
    out = draft_block(spec, params.draft, params.embed_vd, nxt, g_btd,
                      jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width)))
    draft_cache = init_draft_cache(spec, b, max_len)
    draft_cache = commit(draft_cache, out.k_new_bthd[None], out.v_new_bthd[None], lengths_b - 1)

    c = pre.h_cat_btc.shape[-1]
    all_b = jnp.ones((b,), bool)
    tokens_bn, n_gen = emit(jnp.full((b, max_new_tokens), PAD_OUT, jnp.int32), jnp.zeros((b,), jnp.int32),
                            first_b, all_b)
    # a row stops before its first verification if the cache cannot hold one
    done_b, reason_b = update_stop(all_b, is_eos(first_b, eos_e), n_gen, cache.length_b + a,
                                   jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32),
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    return SpecState(
        tokens_bn=tokens_bn, n_generated_b=n_gen, done_b=done_b, reason_b=reason_b,
        cache=cache, draft_cache=draft_cache, root_b=first_b,
        ingest_tokens_ba=jnp.zeros((b, a), jnp.int32).at[:, 0].set(first_b),
        ingest_h_cat_bac=jnp.zeros((b, a, c), pre.h_cat_btc.dtype).at[:, 0].set(
            pre.h_cat_btc[rows, lengths_b - 1]),
        ingest_count_b=jnp.ones((b,), jnp.int32),
        future_bd=pre.future_bd if spec.head.has_future else jnp.zeros((b, t.d_model), jnp.float32),
        future_anchor_b=lengths_b - 1,  # the prefill contemplate follows the last prompt token
        accept_log_bi=jnp.zeros((b, max_new_tokens), jnp.int32),
        n_passes_b=jnp.zeros((b,), jnp.int32),
        iteration=jnp.int32(0),
        key=key,
    )


def speculative_padded(params: SpecParams, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                       spec: ModelSpec, plan: DraftPlan, rule: str, max_new_tokens: int,
                       max_len: int, unroll_layers: bool, mesh: Optional[Mesh] = None) -> SpecResult:
    """The speculative program on a validated, padded request (``requests.DecodeRequest``).

    ``mesh``: decode over a device mesh (``decode.sharded``): the loop state (target and draft
    caches, per-row arrays) is pinned to the training table's layouts; inputs must be on the mesh."""
    _TRACE_COUNT[0] += 1
    with shd.activation_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _speculative(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, spec=spec,
                            plan=plan, rule=rule, max_new_tokens=max_new_tokens, max_len=max_len,
                            unroll_layers=unroll_layers)


def _speculative(params: SpecParams, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                 spec: ModelSpec, plan: DraftPlan, rule: str, max_new_tokens: int,
                 max_len: int, unroll_layers: bool) -> SpecResult:
    if unroll_layers:  # per-layer weight buffers, split once outside the loop (models.unrolled)
        params = params.replace(target=split_layers(params.target, spec.target))
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    state = constrain_tree(_prefill(spec, params, plan, tokens_bt, lengths_b, temperature, top_p, eos_e,
                                    key, max_new_tokens=max_new_tokens, max_len=max_len))

    def cond(s: SpecState):
        return ~jnp.all(s.done_b) & (s.iteration < max_new_tokens)

    def body(s: SpecState):
        return constrain_tree(iteration(spec, params, plan, rule, s, temperature, top_p, eos_e,
                                        max_new_tokens=max_new_tokens, max_len=max_len))

    state = jax.lax.while_loop(cond, body, state)
    return SpecResult(state.tokens_bn, state.n_generated_b, state.reason_b, state.accept_log_bi,
                      state.n_passes_b)


speculative_padded_jit = jax.jit(
    speculative_padded,
    static_argnames=("spec", "plan", "rule", "max_new_tokens", "max_len", "unroll_layers", "mesh"))


def prepare_spec_inputs(spec: ModelSpec, plan: DraftPlan, prompts, *, max_new_tokens: int = 128,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                        eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                        min_bucket: int = 16, unroll_layers: Optional[bool] = None,
                        mesh: Optional[Mesh] = None):
    """Host-side validation and padding -> (dynamic args after ``params``, static kwargs); with
    ``mesh`` the args are placed on it (rows over data × fsdp, ``decode.sharded``).

    The cache must hold the prompt plus one verification (D+1 slots). ``unroll_layers`` (default:
    on for the CPU backend) runs the target layer-unrolled, as the AR baseline does, so speed-ups
    compare like with like."""
    a = plan.max_depth + 1
    req = validate_request(spec.target, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, eos_ids=eos_ids, max_len=max_len, min_bucket=min_bucket,
                           reserve=a, reserve_what=f"one verification of depth {a - 1}")
    static = dict(spec=spec, plan=plan, rule=verification_rule(plan, temperature <= 0.0),
                  max_new_tokens=req.max_new_tokens, max_len=req.max_len,
                  unroll_layers=default_unroll_layers(unroll_layers), mesh=mesh)
    args = req.device_args()
    return (args if mesh is None else place_request(args, mesh)), static


def generate_speculative(spec: ModelSpec, params: SpecParams, plan: DraftPlan, prompts, **kw) -> SpecResult:
    """Speculative generation for a list of token-id prompts; ``params`` from ``spec_params``.

    Keyword arguments as ``generate_ar`` (max_new_tokens, temperature, top_p, seed, eos_ids,
    max_len, min_bucket, mesh). The method (EAGLE-3 or ConFu) is ``spec.head.variant``. With
    ``mesh`` the params are placed on it by the training table (``decode.sharded``).
    """
    args, static = prepare_spec_inputs(spec, plan, prompts, **kw)
    if static["mesh"] is not None:
        params = place_spec_params(params, spec, static["mesh"])
    return speculative_padded_jit(params, *args, **static)


def compile_speculative(spec: ModelSpec, params: SpecParams, plan: DraftPlan, prompts, **kw):
    """Ahead-of-time compile -> (run, args): ``run(params, *args)`` neither traces nor compiles.
    With ``mesh=``, ``run`` expects params placed by ``decode.sharded.place_spec_params``."""
    args, static = prepare_spec_inputs(spec, plan, prompts, **kw)
    if static["mesh"] is not None:
        params = place_spec_params(params, spec, static["mesh"])
    return speculative_padded_jit.lower(params, *args, **static).compile(), args
