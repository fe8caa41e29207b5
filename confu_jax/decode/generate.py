"""Jitted autoregressive (AR) generation: one prefill, then one ``lax.while_loop`` of 1-token steps.

AR decoding is the baseline every speculative method is timed against and the reference its
lossless invariant is checked against (greedy speculative output == greedy AR output), so it
shares with the speculative loop the model forward, the cache commit, the logits processing
(``sampling``), the request validation (``requests``) and the stop rule (``stopping``).

One compiled program per (cfg, batch, prompt bucket, max_len, max_new_tokens, number of EOS ids);
temperature, top-p, the EOS ids and the RNG key are traced, so one program serves every sampling
setting. Nothing leaves the device between steps.

Cache-full rule: every token that is *fed* to the model has its K/V committed, so a row with a
prompt of P tokens and a cache of S slots can emit at most S - P + 1 tokens (the last emitted
token is never fed). Commits use ``mode='drop'`` scatters, so even a logic error could not write
out of bounds.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from confu_jax import sharding as shd

from confu_jax.decode.requests import default_unroll_layers, validate_request
from confu_jax.decode.sampling import choose_token
from confu_jax.decode.sharded import constrain_tree, place_request, place_target
from confu_jax.decode.stopping import PAD_OUT, emit, is_eos, update_stop
from confu_jax.models.kv_cache import KVCache, commit, init_cache
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.unrolled import SplitParams, apply_target, prepared_layers, split_layers, target_logits
from confu_jax.kernels.attention_reference import AttendTo


class GenerateResult(NamedTuple):
    tokens_bn: jax.Array  # [B, max_new_tokens] int32; PAD_OUT after n_generated_b[b]
    n_generated_b: jax.Array  # [B] int32, EOS included when a row stopped at EOS
    stop_reason_b: jax.Array  # [B] int32 (stopping.StopReason)


class ARState(NamedTuple):
    """Loop carry of the AR while_loop (all device arrays; static shapes)."""

    tokens_bn: jax.Array  # [B, N] int32 output buffer (N = max_new_tokens)
    n_generated_b: jax.Array  # [B] int32 tokens emitted
    last_b: jax.Array  # [B] int32 last emitted token: fed at the next step
    cache: KVCache
    done_b: jax.Array  # [B] bool
    reason_b: jax.Array  # [B] int32 StopReason
    step: jax.Array  # [] int32: tokens emitted by the most advanced row (the loop bound)
    key: jax.Array  # PRNG key; step i samples with fold_in(key, i)


# ----------------------------------------------------------------------------- device pieces


def prefill(params, cfg: LlamaConfig, cache: KVCache, tokens_bt: jax.Array, lengths_b: jax.Array,
            *, attend_cache: bool = True):
    """Run right-padded prompts through the model in one block and commit their true lengths.

    Prompts continue whatever the cache already holds (positions start at ``cache.length_b``), so
    the same function serves a fresh prompt and a follow-up turn. ``attend_cache=False`` asserts
    the cache is empty and skips attention over its slots: cheaper, and it keeps XLA from
    constant-folding a batch-sized, fully masked score block of a freshly zeroed cache (seconds
    of compile time at large batch). Only the hidden state at each row's last real token goes
    through the LM head: [B, V] logits, not [B, T, V].
    Returns (logits_bv at position length-1 of each row, updated cache).
    """
    b, t = tokens_bt.shape
    positions_bt = cache.length_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cache_kw = {}
    if attend_cache:
        cache_kw = dict(attend=AttendTo(k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd, cache_len=cache.length_b))
    out = apply_target(params, cfg, tokens_bt, positions_bt, return_logits=False, **cache_kw)
    last_b1d = out.hidden_btd[jnp.arange(b), lengths_b - 1][:, None, :]
    logits_bv = target_logits(params, cfg, last_b1d)[:, 0]
    cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, lengths_b)
    return logits_bv, cache


def decode_step(params, cfg: LlamaConfig, cache: KVCache, tokens_b: jax.Array, active_b: jax.Array):
    """Feed one token per row at position ``cache.length_b``; commit it only for active rows.

    Returns (logits_bv for the next token, updated cache). Inactive rows compute (static shapes)
    but leave their cache untouched.
    """
    out = apply_target(params, cfg, tokens_b[:, None], cache.length_b[:, None],
                       attend=AttendTo(k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd, cache_len=cache.length_b))
    cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, active_b.astype(jnp.int32))
    return out.logits_btv[:, 0], cache


# ----------------------------------------------------------------------------- the jitted loop

_TRACE_COUNT = [0]


def trace_count() -> int:
    """How many times the generation program has been traced (= compiled) in this process."""
    return _TRACE_COUNT[0]


def generate_padded(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                    cfg: LlamaConfig, max_new_tokens: int, max_len: int,
                    unroll_layers: bool, mesh: Optional[Mesh] = None) -> GenerateResult:
    """The AR program on a validated, padded request (``requests.DecodeRequest.device_args``).

    ``mesh``: decode over a device mesh (``decode.sharded``): the carry (KV cache, per-row state)
    is pinned to the training table's layouts; inputs must be placed on the same mesh."""
    _TRACE_COUNT[0] += 1  # Python side effect: runs once per trace, never per call
    with shd.activation_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _generate(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, cfg=cfg,
                         max_new_tokens=max_new_tokens, max_len=max_len, unroll_layers=unroll_layers)


def _generate(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *, cfg: LlamaConfig,
              max_new_tokens: int, max_len: int, unroll_layers: bool) -> GenerateResult:
    if unroll_layers and not isinstance(params, SplitParams):  # split once, outside the loop
        params = split_layers(params, cfg)
    b = tokens_bt.shape[0]
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    stop_kw = dict(max_new_tokens=max_new_tokens, max_len=max_len)

    cache = init_cache(cfg.n_layers, b, max_len, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
                       per_layer=unroll_layers)  # per-layer buffers: read in place (models.kv_cache)
    logits_bv, cache = prefill(params, cfg, cache, tokens_bt, lengths_b, attend_cache=False)
    tok_b = choose_token(jax.random.fold_in(key, 0), logits_bv, temperature, top_p)
    all_b = jnp.ones((b,), bool)
    tokens_bn, n_gen_b = emit(jnp.full((b, max_new_tokens), PAD_OUT, jnp.int32),
                              jnp.zeros((b,), jnp.int32), tok_b, all_b)
    # the emitted token is fed next: it needs slot `length`, i.e. length + 1 slots
    done_b, reason_b = update_stop(all_b, is_eos(tok_b, eos_e), n_gen_b, cache.length_b + 1,
                                   jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), **stop_kw)
    state = constrain_tree(ARState(tokens_bn, n_gen_b, tok_b, cache, done_b, reason_b, jnp.int32(1), key))

    def cond(s: ARState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done_b)

    def body(s: ARState) -> ARState:
        active_b = ~s.done_b
        logits_bv, cache = decode_step(params, cfg, s.cache, s.last_b, active_b)
        tok_b = choose_token(jax.random.fold_in(s.key, s.step), logits_bv, temperature, top_p)
        tokens_bn, n_gen_b = emit(s.tokens_bn, s.n_generated_b, tok_b, active_b)
        done_b, reason_b = update_stop(active_b, is_eos(tok_b, eos_e), n_gen_b, cache.length_b + 1,
                                       s.done_b, s.reason_b, **stop_kw)
        last_b = jnp.where(active_b, tok_b, s.last_b)
        return constrain_tree(ARState(tokens_bn, n_gen_b, last_b, cache, done_b, reason_b, s.step + 1, s.key))

    state = jax.lax.while_loop(cond, body, state)
    return GenerateResult(state.tokens_bn, state.n_generated_b, state.reason_b)


generate_padded_jit = jax.jit(
    generate_padded, static_argnames=("cfg", "max_new_tokens", "max_len", "unroll_layers", "mesh")
)


def prepare_ar_inputs(cfg: LlamaConfig, prompts, *, lengths=None, max_new_tokens: int = 128,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                      min_bucket: int = 16, unroll_layers: Optional[bool] = None,
                      mesh: Optional[Mesh] = None):
    """Validate and pad on the host -> (dynamic args after ``params``, static kwargs) of
    ``generate_padded_jit``. Arguments as in ``generate_ar``; with ``mesh`` the args are placed
    on it (rows over data × fsdp)."""
    req = validate_request(cfg, prompts, lengths=lengths, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, seed=seed, eos_ids=eos_ids,
                           max_len=max_len, min_bucket=min_bucket)
    static = dict(cfg=cfg, max_new_tokens=req.max_new_tokens, max_len=req.max_len,
                  unroll_layers=default_unroll_layers(unroll_layers, mesh), mesh=mesh)
    args = req.device_args()
    return (args if mesh is None else place_request(args, mesh)), static


def generate_ar(params, cfg: LlamaConfig, prompts, *, lengths=None, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                min_bucket: int = 16, unroll_layers: Optional[bool] = None,
                mesh: Optional[Mesh] = None) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per prompt with one compiled program.

    ``prompts``: a list of token-id lists (any lengths), or a [B, T] array of right-padded
    prompts together with ``lengths`` [B]. ``eos_ids`` defaults to ``cfg.eos_token_ids`` (pass
    ``()`` to disable EOS stopping). ``max_len`` is the KV-cache size in slots (default: bucket +
    max_new_tokens, enough that no row hits it). Temperature 0 is greedy. ``unroll_layers``
    runs the layers from per-layer weight buffers instead of the scan (default: on CPU only;
    same results; see ``confu_jax.models.unrolled``). ``mesh``: decode over a device mesh
    (``decode.sharded``; params are placed on it by the training table, rows over data × fsdp).
    """
    args, static = prepare_ar_inputs(
        cfg, prompts, lengths=lengths, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, seed=seed, eos_ids=eos_ids, max_len=max_len, min_bucket=min_bucket,
        unroll_layers=unroll_layers, mesh=mesh)
    if mesh is not None:
        params = place_target(params, cfg, mesh)
    elif static["unroll_layers"]:  # the split weights made once per target (models.unrolled)
        params = prepared_layers(params, cfg)
    return generate_padded_jit(params, *args, **static)


def compile_ar(params, cfg: LlamaConfig, prompts, **kw):
    """Ahead-of-time compile for these prompts/settings -> (run, args): ``run(params, *args)``
    returns a ``GenerateResult`` without tracing or compiling. Lets benchmarks time compilation
    separately; keyword arguments as in ``generate_ar``. With ``mesh=``, ``run`` expects params
    placed by ``decode.sharded.place_target``."""
    args, static = prepare_ar_inputs(cfg, prompts, **kw)
    if static["mesh"] is not None:
        params = place_target(params, cfg, static["mesh"])
        return generate_padded_jit.lower(params, *args, **static).compile(), args
    if not static["unroll_layers"]:
        return generate_padded_jit.lower(params, *args, **static).compile(), args
    compiled = generate_padded_jit.lower(prepared_layers(params, cfg), *args, **static).compile()
    return (lambda p, *a: compiled(prepared_layers(p, cfg), *a)), args
