"""Speculative decoding (EAGLE-3, ConFu) as one jitted ``lax.while_loop`` with static shapes.

One program per (model spec, draft plan, verification rule, batch, prompt bucket, cache size,
max_new_tokens); temperature, top-p, EOS ids and the RNG key are traced. Nothing leaves the device
between iterations: the host sees the prompt going in and the finished token buffer coming out.

Positions. p is the last accepted position of a row; the target cache holds positions 0..p (its
length is p+1) and the **root** of the next tree is the bonus token x[p+1], emitted but not yet
fed to the target. The draft cache holds the draft's step-0 entries j = 0..p-1 — entry j reads
(token x[j+1], g[j] = fc(h_cat[j])) at draft position j — and the entries whose h_cat became known
in the last verification wait in a small **ingestion buffer** (at most D+1 of them, D = tree
depth). One iteration:

1. **Draft.** Depth 0 ingests the buffer as one causal block (committing it to the draft cache);
   its output at the last entry (the anchor p) scores the root's children. Deeper levels feed
   (embed(node), parent's draft state) at draft position p+depth and attend the draft cache, their
   ancestors' entries in a per-iteration scratch buffer, themselves, and — for ConFu — the
   transient future entry built from f[p] (never stored). Chain, static tree, EAGLE-2 dynamic tree
   or a sampled chain (``confu_jax.decode.tree``).
2. **Verify** the T nodes in one target pass (``confu_jax.models.target.verify``; 2T tokens with
   ConFu's contemplates, whose [con] reads h_cat[p]) and apply the rule
   (``confu_jax.decode.verify``): greedy; sequential residual sampling for deterministic drafts;
   min(1, p/q) for sampled chains.
3. **Commit** the accepted path's target K/V to contiguous cache slots, emit the accepted tokens
   and the bonus (clipped at EOS and max_new_tokens), and refill the ingestion buffer with the
   accepted nodes' h_cat; f for the next iteration is the contemplate after the last accepted node.

Stopping: per row at EOS (emitted and counted), max_new_tokens, or when the cache cannot hold
another verification (length + D + 1 > max_len: ``StopReason.CACHE_FULL``; every commit is a
``mode='drop'`` scatter, so nothing is ever written out of bounds). Done rows ride along.

Counters: ``accept_log_bi[b, i]`` = tokens emitted by row b's i-th target pass (bonus included:
Spec-Bench's τ is their mean); the first token comes from prefill and is not in the log.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode import tree as tree_lib
from confu_jax.decode import verify as verify_lib
from confu_jax.decode.cache import KVCache, commit, init_cache
from confu_jax.decode.generate import (PAD_OUT, StopReason, _sample, emit, pad_prompts,
                                       update_stop)
from confu_jax.models import draft as draft_lib
from confu_jax.models import target as target_lib
from confu_jax.models.spec import ModelSpec
from confu_jax.models.unrolled import split_layers

METHODS = ("ar", "eagle3", "confu")


# ----------------------------------------------------------------------------- draft plans


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """How the draft proposes tokens each iteration (hashable: a static jit argument).

    kinds: ``chain`` (k greedy tokens), ``sampled_chain`` (k tokens sampled from the draft; the
    Leviathan rule at temperature > 0), ``static`` (EAGLE/Medusa "choices" paths filled with the
    draft's top-k), ``dynamic`` (EAGLE-2: depth, top_k per expansion, n_nodes including the root).
    """

    kind: str
    k: int = 0
    depth: int = 0
    top_k: int = 0
    n_nodes: int = 0
    paths: tuple = ()

    def __post_init__(self):
        if self.kind in ("chain", "sampled_chain"):
            if self.k < 1:
                raise ValueError(f"{self.kind} needs k >= 1, got {self.k}")
        elif self.kind == "dynamic":
            if self.depth < 1 or self.top_k < 1 or self.n_nodes < 2:
                raise ValueError(f"dynamic tree needs depth>=1, top_k>=1, n_nodes>=2; got {self}")
        elif self.kind == "static":
            if not self.paths:
                raise ValueError("static tree needs a non-empty list of paths")
        else:
            raise ValueError(f"unknown draft plan kind {self.kind!r}; expected chain, sampled_chain, "
                             "static or dynamic")

    @property
    def max_depth(self) -> int:
        if self.kind in ("chain", "sampled_chain"):
            return self.k
        if self.kind == "dynamic":
            return self.depth
        return max(len(p) for p in self.paths)

    @property
    def n_nodes_total(self) -> int:
        """T: tree nodes per verification, root included."""
        if self.kind in ("chain", "sampled_chain"):
            return self.k + 1
        if self.kind == "dynamic":
            return self.n_nodes
        return len(tree_lib.static_structure(self.paths).parents_t)


def parse_plan(text: str) -> DraftPlan:
    """``chain:K`` | ``sampled_chain:K`` | ``dynamic:DEPTH,TOPK,NODES`` (NODES excludes the root,
    as EAGLE-2's total_tokens) -> DraftPlan. Errors say which form was expected."""
    kind, _, arg = text.partition(":")
    try:
        if kind in ("chain", "sampled_chain"):
            return DraftPlan(kind, k=int(arg))
        if kind == "dynamic":
            d, k, t = (int(x) for x in arg.split(","))
            return DraftPlan("dynamic", depth=d, top_k=k, n_nodes=t + 1)
    except ValueError as e:
        raise ValueError(f"bad draft plan {text!r}: {e}. Expected chain:K, sampled_chain:K or "
                         "dynamic:DEPTH,TOPK,NODES (e.g. chain:4, dynamic:6,8,30)") from None
    raise ValueError(f"bad draft plan {text!r}: expected chain:K, sampled_chain:K or "
                     "dynamic:DEPTH,TOPK,NODES (e.g. chain:4, dynamic:6,8,30)")


# ----------------------------------------------------------------------------- loop state


class SpecResult(NamedTuple):
    tokens_bn: jax.Array  # [B, max_new_tokens] int32; PAD_OUT after n_generated_b
    n_generated_b: jax.Array  # [B]
    stop_reason_b: jax.Array  # [B] StopReason
    accept_log_bi: jax.Array  # [B, max_new_tokens] tokens emitted per target pass; 0 past n_passes
    n_passes_b: jax.Array  # [B] verification passes (prefill excluded)


class SpecState(NamedTuple):
    tokens_bn: jax.Array
    n_generated_b: jax.Array
    done_b: jax.Array
    reason_b: jax.Array
    cache: KVCache  # target
    dcache: KVCache  # draft (one layer)
    root_b: jax.Array  # [B] bonus token x[p+1]
    ing_tok_ba: jax.Array  # [B,A] ingestion buffer: token slot x[j+1] of entries j = p-a+1..p
    ing_hcat_bac: jax.Array  # [B,A,3d] their h_cat
    ing_n_b: jax.Array  # [B] number of valid entries (>= 1)
    f_bd: jax.Array  # [B,d] ConFu future vector f[p] (zeros, unused, for eagle3)
    accept_log_bi: jax.Array
    n_passes_b: jax.Array
    it: jax.Array
    key: jax.Array


def _rule(plan: DraftPlan, greedy: bool) -> str:
    if greedy:
        return "greedy"
    return "sampled_chain" if plan.kind == "sampled_chain" else "sampled_tree"


# ----------------------------------------------------------------------------- one iteration


def _draft_tree(spec: ModelSpec, params: dict, plan: DraftPlan, s: SpecState, anchor_b, key,
                temperature, top_p):
    """Run the draft for one iteration -> (DraftTree, q_btv or None, updated draft cache)."""
    dp, embed_vd, d2t = params["draft"], params["embed_vd"], params["draft_vocab"]["d2t"]
    b, a = s.ing_tok_ba.shape
    rows = jnp.arange(b)
    future = None
    if spec.head.has_future:
        g_anchor = draft_lib.draft_features(spec, dp, s.ing_hcat_bac[rows, s.ing_n_b - 1])
        future = draft_lib.draft_future_entry(spec, dp, s.f_bd[:, None], g_anchor[:, None],
                                              anchor_b[:, None])
    t = spec.target
    n_scratch = {"dynamic": tree_lib.dynamic_scratch_size(plan.depth, plan.top_k)}.get(plan.kind)
    if n_scratch is None:
        structure = (tree_lib.static_structure(plan.paths) if plan.kind == "static"
                     else tree_lib.chain_structure(plan.k))
        n_scratch = tree_lib._static_frontiers(structure, b)[1]
    scratch0 = jnp.zeros((b, n_scratch, t.n_kv_heads, t.head_dim), jnp.dtype(spec.head.dtype))

    def expand_fn(state, fr: tree_lib.Frontier):
        dcache, sk, sv, hidden_bkd = state
        if fr.depth == 0:
            g_bad = draft_lib.draft_features(spec, dp, s.ing_hcat_bac)
            pos = dcache.length_b[:, None] + jnp.arange(a, dtype=jnp.int32)[None]
            out = draft_lib.draft_block(spec, dp, embed_vd, s.ing_tok_ba, g_bad, pos, cache=dcache,
                                        future=future)
            active = (~s.done_b).astype(jnp.int32)
            dcache = commit(dcache, out.k_new_bthd[None], out.v_new_bthd[None], s.ing_n_b * active)
            last = s.ing_n_b - 1
            logits = out.logits_btv[rows, last][:, None]
            hidden = out.h_out_btd[rows, last][:, None]
        else:
            k = fr.tokens_bk.shape[1]
            h_in = jnp.take_along_axis(hidden_bkd, fr.parent_slot_bk[..., None], axis=1)
            pos = jnp.broadcast_to((anchor_b + fr.depth)[:, None], (b, k))
            slot = jnp.arange(n_scratch)
            usable = (slot > 0) & ((slot < fr.slot_offset) | (slot >= fr.slot_offset + k))
            out = draft_lib.draft_block(
                spec, dp, embed_vd, fr.tokens_bk, h_in, pos, cache=dcache,
                block_mask_btt=jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k)),
                scratch_k_bmhd=sk, scratch_v_bmhd=sv,
                scratch_mask_btm=fr.ancestor_bkn & usable[None, None], future=future)
            sk = jax.lax.dynamic_update_slice_in_dim(sk, out.k_new_bthd.astype(sk.dtype), fr.slot_offset, 1)
            sv = jax.lax.dynamic_update_slice_in_dim(sv, out.v_new_bthd.astype(sv.dtype), fr.slot_offset, 1)
            logits, hidden = out.logits_btv, out.h_out_btd
        return jax.nn.log_softmax(logits, axis=-1), (dcache, sk, sv, hidden)

    state0 = (s.dcache, scratch0, scratch0, jnp.zeros((b, 1, t.d_model), jnp.dtype(spec.head.dtype)))
    q = None
    if plan.kind == "dynamic":
        tree, _, state = tree_lib.draft_dynamic_tree(expand_fn, state0, s.root_b, depth=plan.depth,
                                                     top_k=plan.top_k, n_nodes=plan.n_nodes, d2t_v=d2t)
    elif plan.kind == "sampled_chain":
        tree, q, state = tree_lib.draft_sampled_chain(expand_fn, state0, s.root_b, plan.k, key,
                                                      temperature, top_p, d2t_v=d2t,
                                                      target_vocab=t.vocab_size)
    else:
        structure = (tree_lib.static_structure(plan.paths) if plan.kind == "static"
                     else tree_lib.chain_structure(plan.k))
        tree, state = tree_lib.draft_static_tree(expand_fn, state0, s.root_b, structure, d2t_v=d2t)
    return tree, q, state[0]


def _iteration(spec: ModelSpec, params: dict, plan: DraftPlan, rule: str, s: SpecState,
               temperature, top_p, eos_e, *, max_new_tokens: int, max_len: int) -> SpecState:
    b, a = s.ing_tok_ba.shape
    rows = jnp.arange(b)
    active = ~s.done_b
    k_draft, k_verify = jax.random.split(jax.random.fold_in(jax.random.fold_in(s.key, 1), s.it))
    anchor_b = s.cache.length_b - 1  # p: the last accepted position

    tree, q_btv, dcache = _draft_tree(spec, params, plan, s, anchor_b, k_draft, temperature, top_p)

    hcat_anchor = s.ing_hcat_bac[rows, s.ing_n_b - 1]  # h_cat[p]: what [con] reads
    vo = target_lib.verify(spec, params["target"], params["confu"], s.cache, tree.tokens_bt,
                           tree.ancestor_btt, con_src_bc=hcat_anchor if spec.head.has_future else None,
                           depth_bt=tree.depth_bt)
    if rule == "greedy":
        ver = verify_lib.verify_greedy(tree, vo.logits_btv)
    elif rule == "sampled_tree":
        ver = verify_lib.verify_sampled_tree(tree, vo.logits_btv, k_verify, temperature, top_p)
    else:
        ver = verify_lib.verify_sampled_chain(tree, vo.logits_btv, q_btv, k_verify, temperature, top_p)

    path = jnp.maximum(ver.path_bd, 0)  # [B,A]
    cache = commit(s.cache, vo.k_new_lbthd, vo.v_new_lbthd,
                   jnp.where(active, ver.n_accepted_b, 0), src_idx_bt=path)

    # emit accepted tokens + bonus, clipped at the first EOS and at max_new_tokens
    j = jnp.arange(a)[None]
    in_path = j < ver.n_accepted_b[:, None]
    is_eos = jnp.any(ver.emitted_bd[..., None] == eos_e[None, None], axis=-1) & in_path
    first_eos = jnp.argmax(is_eos, axis=1)
    n_emit = jnp.where(jnp.any(is_eos, axis=1), first_eos + 1, ver.n_accepted_b)
    n_emit = jnp.minimum(n_emit, max_new_tokens - s.n_generated_b)
    n_emit = jnp.where(active, n_emit, 0).astype(jnp.int32)
    n_out = s.tokens_bn.shape[1]
    cols = jnp.where(j < n_emit[:, None], s.n_generated_b[:, None] + j, n_out)
    tokens_bn = s.tokens_bn.at[rows[:, None], cols].set(ver.emitted_bd, mode="drop")
    n_gen = s.n_generated_b + n_emit
    log_col = jnp.where(active, s.n_passes_b, s.accept_log_bi.shape[1])
    accept_log = s.accept_log_bi.at[rows, log_col].set(n_emit, mode="drop")

    hit_eos = jnp.any(is_eos & (j < n_emit[:, None]), axis=1)
    reason_new = jnp.where(
        hit_eos, StopReason.EOS,
        jnp.where(n_gen >= max_new_tokens, StopReason.MAX_NEW_TOKENS,
                  jnp.where(cache.length_b + a > max_len, StopReason.CACHE_FULL, StopReason.RUNNING)))
    newly = active & (reason_new != StopReason.RUNNING)

    keep = active[:, None]
    hcat_path = jnp.take_along_axis(vo.h_cat_btc, path[..., None], axis=1)
    f_new = vo.f_btd[rows, ver.last_node_b] if spec.head.has_future else s.f_bd
    return SpecState(
        tokens_bn=tokens_bn,
        n_generated_b=n_gen,
        done_b=s.done_b | newly,
        reason_b=jnp.where(newly, reason_new.astype(jnp.int32), s.reason_b),
        cache=cache,
        dcache=dcache,
        root_b=jnp.where(active, ver.bonus_b, s.root_b),
        ing_tok_ba=jnp.where(keep, jnp.maximum(ver.emitted_bd, 0), s.ing_tok_ba),
        ing_hcat_bac=jnp.where(keep[..., None], hcat_path.astype(s.ing_hcat_bac.dtype), s.ing_hcat_bac),
        ing_n_b=jnp.where(active, ver.n_accepted_b, s.ing_n_b),
        f_bd=jnp.where(keep, f_new.astype(s.f_bd.dtype), s.f_bd),
        accept_log_bi=accept_log,
        n_passes_b=s.n_passes_b + active.astype(jnp.int32),
        it=s.it + 1,
        key=s.key,
    )


# ----------------------------------------------------------------------------- prefill + loop

_TRACE_COUNT = [0]


def trace_count() -> int:
    """Times the speculative program was traced (= compiled) in this process."""
    return _TRACE_COUNT[0]


def _speculative_padded(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                        spec: ModelSpec, plan: DraftPlan, rule: str, max_new_tokens: int,
                        max_len: int, unroll_layers: bool) -> SpecResult:
    _TRACE_COUNT[0] += 1
    t = spec.target
    if unroll_layers:  # per-layer weight buffers, split once outside the loop (models.unrolled)
        params = dict(params, target=split_layers(params["target"], t))
    b, width = tokens_bt.shape
    a = plan.max_depth + 1
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    rows = jnp.arange(b)

    cache = init_cache(t.n_layers, b, max_len, t.n_kv_heads, t.head_dim, jnp.dtype(t.dtype))
    # attend_cache=False: the cache is empty, and attending to a freshly zeroed cache makes XLA
    # constant-fold a batch-sized, fully masked score block (seconds of compile time)
    pre, cache = target_lib.prefill(spec, params["target"], params["confu"], cache, tokens_bt, lengths_b,
                                    attend_cache=False)
    first_b = _sample(jax.random.fold_in(key, 0), pre.last_logits_bv, temperature, top_p)

    # draft prefill: entries j = 0..n-2 (token x[j+1], g[j]); entry n-1 waits in the buffer
    dp = params["draft"]
    nxt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros((b, 1), tokens_bt.dtype)], axis=1)
    g_btd = draft_lib.draft_features(spec, dp, pre.h_cat_btc)
    out = draft_lib.draft_block(spec, dp, params["embed_vd"], nxt, g_btd,
                                jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width)))
    dcache = draft_lib.init_draft_cache(spec, b, max_len)
    dcache = commit(dcache, out.k_new_bthd[None], out.v_new_bthd[None], lengths_b - 1)

    c = pre.h_cat_btc.shape[-1]
    ing_tok = jnp.zeros((b, a), jnp.int32).at[:, 0].set(first_b)
    ing_hcat = jnp.zeros((b, a, c), pre.h_cat_btc.dtype).at[:, 0].set(pre.h_cat_btc[rows, lengths_b - 1])
    f_bd = pre.f_bd if spec.head.has_future else jnp.zeros((b, t.d_model), jnp.float32)

    all_b = jnp.ones((b,), bool)
    tokens_bn, n_gen = emit(jnp.full((b, max_new_tokens), PAD_OUT, jnp.int32),
                            jnp.zeros((b,), jnp.int32), first_b, all_b)
    # a row stops before its first verification if the cache cannot hold one
    done_b, reason_b = update_stop(first_b, all_b, n_gen, cache.length_b + a - 1,
                                   jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), eos_e,
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    state = SpecState(tokens_bn, n_gen, done_b, reason_b, cache, dcache, first_b, ing_tok, ing_hcat,
                      jnp.ones((b,), jnp.int32), f_bd,
                      jnp.zeros((b, max_new_tokens), jnp.int32), jnp.zeros((b,), jnp.int32),
                      jnp.int32(0), key)

    def cond(s: SpecState):
        return ~jnp.all(s.done_b) & (s.it < max_new_tokens)

    def body(s: SpecState):
        return _iteration(spec, params, plan, rule, s, temperature, top_p, eos_e,
                          max_new_tokens=max_new_tokens, max_len=max_len)

    state = jax.lax.while_loop(cond, body, state)
    return SpecResult(state.tokens_bn, state.n_generated_b, state.reason_b, state.accept_log_bi,
                      state.n_passes_b)


speculative_padded_jit = jax.jit(
    _speculative_padded,
    static_argnames=("spec", "plan", "rule", "max_new_tokens", "max_len", "unroll_layers"))


def spec_params(target_params: dict, trainable: dict, draft_vocab: dict) -> dict:
    """The parameter pytree the loop reads: frozen target, trainable {'draft', 'confu'}, vocab maps."""
    return {
        "target": target_params,
        "confu": trainable.get("confu", {}),
        "draft": trainable["draft"],
        "draft_vocab": draft_vocab,
        "embed_vd": target_params["embed"]["embedding"],
    }


def prepare_spec_inputs(spec: ModelSpec, plan: DraftPlan, prompts, *, max_new_tokens: int = 128,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                        eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                        min_bucket: int = 16, unroll_layers: Optional[bool] = None):
    """Host-side validation and padding -> (dynamic args after ``params``, static kwargs).

    ``unroll_layers`` (default: on for the CPU backend) runs the target layer-unrolled, as the AR
    baseline does, so speed-ups compare like with like."""
    tokens_bt, lengths_b = pad_prompts(prompts, min_bucket)
    vocab = spec.target.vocab_size
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (temperature >= 0.0 and 0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}")
    a = plan.max_depth + 1
    width = tokens_bt.shape[1]
    max_len = int(max_len) if max_len else width + int(max_new_tokens) + a
    if int(lengths_b.max()) + a > max_len:
        raise ValueError(f"KV cache of max_len={max_len} slots cannot hold a prompt of "
                         f"{int(lengths_b.max())} tokens plus one verification of depth {a - 1}")
    if max_len > spec.target.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds max_position_embeddings="
                         f"{spec.target.max_position_embeddings}")
    eos = [int(e) for e in (spec.target.eos_token_ids if eos_ids is None else eos_ids)]
    eos_e = np.asarray(eos or [-1], np.int32)
    rule = _rule(plan, temperature <= 0.0)
    args = (jnp.asarray(tokens_bt), jnp.asarray(lengths_b), jnp.float32(temperature),
            jnp.float32(top_p), jnp.asarray(eos_e), jax.random.PRNGKey(seed))
    if unroll_layers is None:
        unroll_layers = jax.default_backend() == "cpu"
    static = dict(spec=spec, plan=plan, rule=rule, max_new_tokens=int(max_new_tokens), max_len=max_len,
                  unroll_layers=bool(unroll_layers))
    return args, static


def generate_speculative(spec: ModelSpec, params: dict, plan: DraftPlan, prompts, **kw) -> SpecResult:
    """Speculative generation for a list of token-id prompts; ``params`` from ``spec_params``.

    Keyword arguments as ``generate_ar`` (max_new_tokens, temperature, top_p, seed, eos_ids,
    max_len, min_bucket). The method (EAGLE-3 or ConFu) is ``spec.head.variant``.
    """
    args, static = prepare_spec_inputs(spec, plan, prompts, **kw)
    return speculative_padded_jit(params, *args, **static)


def compile_speculative(spec: ModelSpec, params: dict, plan: DraftPlan, prompts, **kw):
    """Ahead-of-time compile -> (run, args): ``run(params, *args)`` neither traces nor compiles."""
    args, static = prepare_spec_inputs(spec, plan, prompts, **kw)
    return speculative_padded_jit.lower(params, *args, **static).compile(), args
