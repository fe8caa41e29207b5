"""Speculative decoding with any drafter (every family of ``decode.families``) as one jitted
``lax.while_loop`` with static shapes.

The loop takes ``(target, drafter, drafter_params)`` and nothing else (``generate_speculative``): a
``params.Target``, a ``decode.drafter.Drafter`` (how to draft: a hashable static argument) and a
``params.DrafterParams`` (what it drafts with: its architecture as static fields and its weights).
One program per (target and drafter architecture, drafter, verification rule, batch, prompt bucket, cache size,
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
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from confu_jax import sharding as shd

from confu_jax.decode import cpu_packing
from confu_jax.decode import verify as verify_lib
from confu_jax.decode.drafter import DraftInput, Drafter, PrefillView, Proposal, VerifiedPass
from confu_jax.decode.requests import default_unroll_layers, validate_request
from confu_jax.decode.sampling import choose_token
from confu_jax.decode.params import DrafterParams, Target
from confu_jax.decode.sharded import constrain_tree, place_params, place_request
from confu_jax.decode.spec_state import SpecResult, SpecState
from confu_jax.decode.stopping import PAD_OUT, emit, is_eos, update_stop
from confu_jax.models import target as target_lib
from confu_jax.models.kv_cache import commit, init_cache
from confu_jax.models.unrolled import SplitParams, is_packed_split, prepared_dense, prepared_layers, split_layers


# ----------------------------------------------------------------------------- one iteration


def _verify(target: Target, dp: DrafterParams, rule: verify_lib.AcceptanceRule, s: SpecState, prop: Proposal, key,
            temperature, top_p):
    """Target pass over the proposed tree and the acceptance rule -> (target outputs, Verification).
    What verification reads of the drafter: its head (whether ConFu's contemplates run), their extras, and
    the proposal's own verification inputs (``Proposal.verify_inputs``, passed through as keywords)."""
    tree = prop.tree
    inputs = {} if prop.verify_inputs is None else prop.verify_inputs._asdict()
    vo = target_lib.verify(dp.spec(target.config), target.params, dp.verify_extras, s.cache, tree.tokens_bt,
                           tree.ancestor_btt, depth_bt=tree.depth_bt, **inputs)
    return vo, rule.accept(tree, vo.logits_btv, prop.q_btv, key, temperature, top_p)


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


def truncate_proposal(prop: Proposal, width: int) -> Proposal:
    """The proposal's first ``width`` nodes (a drafter lists the nodes it wants verified first;
    paths keep their D+1 columns, so every width yields the same Verification shapes)."""
    t = prop.tree.tokens_bt.shape[1]
    if width == t:
        return prop
    tr = prop.tree
    tree = tr._replace(tokens_bt=tr.tokens_bt[:, :width], parents_bt=tr.parents_bt[:, :width],
                       depth_bt=tr.depth_bt[:, :width], valid_bt=tr.valid_bt[:, :width],
                       ancestor_btt=tr.ancestor_btt[:, :width, :width], path_btd=tr.path_btd[:, :width])
    q = None if prop.q_btv is None else prop.q_btv[:, :width]
    inputs = None if prop.verify_inputs is None else prop.verify_inputs.truncated(width)
    return prop._replace(tree=tree, q_btv=q, verify_inputs=inputs)


def _finish(target: Target, dp: DrafterParams, drafter: Drafter, rule: verify_lib.AcceptanceRule, s: SpecState,
            prop: Proposal,
            k_verify, temperature, top_p, eos_e, *, width: int, max_new_tokens: int, max_len: int) -> SpecState:
    """Verify the proposal's first ``width`` nodes, commit, emit, and let the drafter ingest."""
    b = s.root_b.shape[0]
    rows = jnp.arange(b)
    a = drafter.max_depth + 1
    active = ~s.done_b
    anchor_b = s.cache.length_b - 1
    prop = truncate_proposal(prop, width)
    vo, ver = _verify(target, dp, rule, s, prop, k_verify, temperature, top_p)
    path = jnp.maximum(ver.path_bd, 0)  # [B, A]
    cache = commit(s.cache, vo.k_new_lbthd, vo.v_new_lbthd, jnp.where(active, ver.n_accepted_b, 0),
                   src_idx_bt=path)
    tokens_bn, n_gen, n_emit, hit_eos = _emit_accepted(s, ver, active, eos_e, max_new_tokens)
    log_col = jnp.where(active, s.n_passes_b, s.accept_log_bi.shape[1])
    accept_log = s.accept_log_bi.at[rows, log_col].set(n_emit, mode="drop")
    done_b, reason_b = update_stop(active, hit_eos, n_gen, cache.length_b + a, s.done_b, s.reason_b,
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    dstate = drafter.update(target, dp, prop.state,
                            VerifiedPass(prop.tree, ver, vo, prop.verify_inputs, active, anchor_b))
    return s.replace(
        tokens_bn=tokens_bn,
        n_generated_b=n_gen,
        done_b=done_b,
        reason_b=reason_b,
        cache=cache,
        root_b=jnp.where(active, ver.bonus_b, s.root_b),
        drafter=dstate,
        accept_log_bi=accept_log,
        n_passes_b=s.n_passes_b + active.astype(jnp.int32),
        iteration=s.iteration + 1,
    )


def pass_width_index(widths: Sequence[int], n_nodes_b: jax.Array, active_b: jax.Array) -> jax.Array:
    """Index of the smallest compiled width holding every active row's wanted nodes ([] int32)."""
    need = jnp.max(jnp.where(active_b, n_nodes_b, 1))
    return jnp.sum(jnp.asarray(widths, jnp.int32) < need).astype(jnp.int32)


def iteration(target: Target, dp: DrafterParams, drafter: Drafter, rule: verify_lib.AcceptanceRule, s: SpecState,
              temperature, top_p, eos_e, *, max_new_tokens: int, max_len: int) -> SpecState:
    """Draft, verify, commit and emit once for every row (done rows ride along unchanged).

    With several compiled widths the pass verifies the narrowest that holds every active row's
    proposal (``lax.switch``): an iteration where nothing was drafted costs one AR step."""
    k_draft, k_verify = jax.random.split(jax.random.fold_in(jax.random.fold_in(s.key, 1), s.iteration))
    anchor_b = s.cache.length_b - 1  # p: the last accepted position
    prop = drafter.propose(target, dp, s.drafter,
                           DraftInput(s.root_b, anchor_b, s.done_b, k_draft, temperature, top_p))
    kw = dict(max_new_tokens=max_new_tokens, max_len=max_len)
    widths = tuple(drafter.widths)
    operands = (s, prop, k_verify, temperature, top_p, eos_e)
    if len(widths) == 1:
        return _finish(target, dp, drafter, rule, *operands, width=widths[0], **kw)
    branches = [functools.partial(_finish, target, dp, drafter, rule, width=w, **kw) for w in widths]
    return jax.lax.switch(pass_width_index(widths, prop.n_nodes_b, ~s.done_b), branches, *operands)


# ----------------------------------------------------------------------------- prefill + loop

_TRACE_COUNT = [0]


def trace_count() -> int:
    """Times the speculative program was traced (= compiled) in this process."""
    return _TRACE_COUNT[0]


def _prefill(target: Target, dp: DrafterParams, drafter: Drafter, tokens_bt, lengths_b, temperature,
             top_p, eos_e, key, *, max_new_tokens: int, max_len: int) -> SpecState:
    """Target prefill (+ the first contemplate), the first token, and the drafter's ``init``."""
    t = target.config
    b, width = tokens_bt.shape
    a = drafter.max_depth + 1
    cache = init_cache(t.n_layers, b, max_len, t.n_kv_heads, t.head_dim, jnp.dtype(t.dtype),
                       per_layer=isinstance(target.params, SplitParams))  # layer-unrolled: read in place
    # attend_cache=False: the cache is empty, and attending to a freshly zeroed cache makes XLA
    # constant-fold a batch-sized, fully masked score block (seconds of compile time)
    pre, cache = target_lib.prefill(dp.spec(t), target.params, dp.verify_extras, cache, tokens_bt, lengths_b,
                                    attend_cache=False)
    first_b = choose_token(jax.random.fold_in(key, 0), pre.last_logits_bv, temperature, top_p)
    dstate = drafter.init(target, dp, PrefillView(tokens_bt, lengths_b, first_b, pre.h_cat_btc,
                                                    pre.future_bd, max_len, pre.last_hidden_bd, pre.hidden_btd))
    all_b = jnp.ones((b,), bool)
    tokens_bn, n_gen = emit(jnp.full((b, max_new_tokens), PAD_OUT, jnp.int32), jnp.zeros((b,), jnp.int32),
                            first_b, all_b)
    # a row stops before its first verification if the cache cannot hold one
    done_b, reason_b = update_stop(all_b, is_eos(first_b, eos_e), n_gen, cache.length_b + a,
                                   jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32),
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    return SpecState(
        tokens_bn=tokens_bn, n_generated_b=n_gen, done_b=done_b, reason_b=reason_b,
        cache=cache, root_b=first_b, drafter=dstate,
        accept_log_bi=jnp.zeros((b, max_new_tokens), jnp.int32),
        n_passes_b=jnp.zeros((b,), jnp.int32),
        iteration=jnp.int32(0),
        key=key,
    )


def speculative_padded(target: Target, dp: DrafterParams, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                       drafter: Drafter, rule: verify_lib.AcceptanceRule, max_new_tokens: int,
                       max_len: int, unroll_layers: bool, mesh: Optional[Mesh] = None) -> SpecResult:
    """The speculative program on a validated, padded request (``requests.DecodeRequest``).

    ``mesh``: decode over a device mesh (``decode.sharded``): the loop state (target and draft
    caches, per-row arrays) is pinned to the training table's layouts; inputs must be on the mesh."""
    _TRACE_COUNT[0] += 1
    with shd.activation_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _speculative(target, dp, tokens_bt, lengths_b, temperature, top_p, eos_e, key,
                            drafter=drafter, rule=rule, max_new_tokens=max_new_tokens, max_len=max_len,
                            unroll_layers=unroll_layers)


def _speculative(target: Target, dp: DrafterParams, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                 drafter: Drafter, rule: verify_lib.AcceptanceRule, max_new_tokens: int,
                 max_len: int, unroll_layers: bool) -> SpecResult:
    if unroll_layers and not isinstance(target.params, SplitParams):  # per-layer buffers, outside the loop
        target = target.replace(params=split_layers(target.params, target.config))
    dp = drafter.prepare_params(target, dp)  # once, outside the loop (e.g. the draft model's split)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    state = constrain_tree(_prefill(target, dp, drafter, tokens_bt, lengths_b, temperature, top_p, eos_e,
                                    key, max_new_tokens=max_new_tokens, max_len=max_len))

    def cond(s: SpecState):
        return ~jnp.all(s.done_b) & (s.iteration < max_new_tokens)

    def body(s: SpecState):
        return constrain_tree(iteration(target, dp, drafter, rule, s, temperature, top_p, eos_e,
                                        max_new_tokens=max_new_tokens, max_len=max_len))

    state = jax.lax.while_loop(cond, body, state)
    return SpecResult(state.tokens_bn, state.n_generated_b, state.reason_b, state.accept_log_bi,
                      state.n_passes_b)


speculative_padded_jit = jax.jit(
    speculative_padded,
    static_argnames=("drafter", "rule", "max_new_tokens", "max_len", "unroll_layers", "mesh"))


def check_drafter(drafter) -> Drafter:
    """``drafter`` if it is a ``Drafter``; a bare ``DraftPlan`` or anything else is refused (a plan says
    how deep and wide to draft, not with what: ``decode.families.parse_drafter(method, text)`` makes one)."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"expected a decode.drafter.Drafter (decode.families.parse_drafter(method, plan_text) makes "
                        f"one), got {type(drafter).__name__}: {drafter!r}")
    return drafter


def _check_params(target: Target, drafter_params: DrafterParams) -> None:
    if not isinstance(target, Target) or not isinstance(drafter_params, DrafterParams):
        raise TypeError(f"expected (Target, DrafterParams) from decode.params (decode.families.decode_head loads "
                        f"both), got ({type(target).__name__}, {type(drafter_params).__name__})")
    drafter_params.check()


def prepare_spec_inputs(target_cfg, drafter: Drafter, prompts, *, max_new_tokens: int = 128,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                        eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                        min_bucket: int = 16, unroll_layers: Optional[bool] = None,
                        mesh: Optional[Mesh] = None):
    """Host-side validation and padding for the target ``target_cfg`` -> (dynamic args after the two
    parameter trees, static kwargs); with ``mesh`` the args are placed on it (rows over data × fsdp,
    ``decode.sharded``).

    The cache must hold the prompt plus one verification (D+1 slots). ``unroll_layers`` (default:
    on for the CPU backend) runs the target layer-unrolled, as the AR baseline does, so speed-ups
    compare like with like."""
    drafter = check_drafter(drafter)
    a = drafter.max_depth + 1
    req = validate_request(target_cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, eos_ids=eos_ids, max_len=max_len, min_bucket=min_bucket,
                           reserve=a, reserve_what=f"one verification of depth {a - 1}")
    static = dict(drafter=drafter, rule=drafter.rule(temperature <= 0.0),
                  max_new_tokens=req.max_new_tokens, max_len=req.max_len,
                  unroll_layers=default_unroll_layers(unroll_layers, mesh), mesh=mesh)
    args = req.device_args()
    return (args if mesh is None else place_request(args, mesh)), static


def generate_speculative(target: Target, drafter: Drafter, drafter_params: DrafterParams, prompts,
                         **kw) -> SpecResult:
    """Speculative generation for a list of token-id prompts.

    ``target``: the frozen target (``params.Target``: config and weights); ``drafter``: any
    ``decode.drafter.Drafter`` (a head's plan, prompt lookup, hybrid, ...: how to draft, from
    ``decode.families.parse_drafter``); ``drafter_params``: what it drafts with
    (``params.DrafterParams``: its architecture and weights, ``decode.families.decode_head``).
    Keyword arguments as ``generate_ar`` (max_new_tokens, temperature, top_p, seed, eos_ids, max_len,
    min_bucket, mesh). With ``mesh`` the params are placed on it by the training table (``decode.sharded``).
    """
    _check_params(target, drafter_params)
    args, static = prepare_spec_inputs(target.config, drafter, prompts, **kw)
    return speculative_padded_jit(*_placed(target, drafter_params, static), *args, **static)


def compile_speculative(target: Target, drafter: Drafter, drafter_params: DrafterParams, prompts, **kw):
    """Ahead-of-time compile -> (run, args): ``run(target, drafter_params, *args)`` neither traces nor
    compiles (with ``mesh=``, it places what is not on the mesh yet)."""
    _check_params(target, drafter_params)
    args, static = prepare_spec_inputs(target.config, drafter, prompts, **kw)
    compiled = speculative_padded_jit.lower(*_placed(target, drafter_params, static), *args, **static).compile()

    def run(target_: Target, drafter_params_: DrafterParams, *a):
        return compiled(*_placed(target_, drafter_params_, static), *a)

    return run, args


def _placed(target: Target, dp: DrafterParams, static: dict) -> tuple:
    """(target, dp) as the compiled program takes them: on a mesh, placed by the training table; on the
    unrolled (CPU) path, the target's split weights made once per target
    (``models.unrolled.prepared_layers``), and where those are packed for the few-row matmul, the
    drafter's packable projections too (``cpu_packing.packable_draft``: a backend policy the families register
    with, not part of the ``Drafter`` contract)."""
    if static["mesh"] is not None:
        return place_params(target, dp, static["mesh"])
    if not static["unroll_layers"]:
        return target, dp
    target = target.replace(params=prepared_layers(target.params, target.config))
    names = cpu_packing.packable_draft(static["drafter"])
    if names and is_packed_split(target.params):  # the target went packed: the draft head's projections too
        return target, dp.replace(weights=prepared_dense(dp.weights, names))
    return target, dp
