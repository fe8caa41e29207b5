"""Jitted autoregressive (AR) generation: one prefill, then one ``lax.while_loop`` of 1-token steps.

AR decoding is the baseline every speculative method is timed against and the reference its
lossless invariant is checked against (greedy speculative output == greedy AR output), so it
shares the model forward, the cache commit and the logits processing (``sampling.next_token``)
with the speculative loop. The pieces are kept separate (``prefill``, ``decode_step``,
``update_stop``) so the speculative loop can reuse the same prefill and stopping rules.

Static shapes, no host round-trip per token:

* Prompts are right-padded to a **length bucket**: the smallest power of two >= the longest prompt
  (at least ``min_bucket``). A new prompt length therefore recompiles only when it crosses a power
  of two (log2(L) programs for all lengths up to L), at the price of at most 2x padding in prefill.
  Padded positions are computed in prefill but never committed: each row commits exactly its true
  length, so padding cannot leak into attention.
* One compiled program per (cfg, batch, bucket, max_len, max_new_tokens, number of EOS ids).
  Temperature, top-p, the EOS ids and the RNG key are traced, so one program serves every sampling
  setting.
* Per-row state: position (= cache length), number generated, done flag and stop reason. Rows stop
  independently at EOS (the EOS token is emitted and counted, like Hugging Face ``generate``), at
  ``max_new_tokens``, or when the cache is full. A done row keeps riding along in the batch (static
  shapes) but commits nothing and writes no tokens.

Cache-full rule: every token that is *fed* to the model has its K/V committed, so a row with a
prompt of P tokens and a cache of S slots can emit at most S - P + 1 tokens (the last emitted
token is never fed). A row that would need slot S stops with ``StopReason.CACHE_FULL``; commits
use ``mode='drop'`` scatters, so even a logic error could not write out of bounds.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode.cache import KVCache, commit, init_cache
from confu_jax.decode.sampling import next_token
from confu_jax.models.llama import Llama, LlamaConfig
from confu_jax.models.unrolled import SplitParams, apply_unrolled, split_layers

# Value of output slots past a row's last generated token (never a valid token id).
PAD_OUT = -1
# Token fed in right-padding positions of a prompt; never committed, so its value is irrelevant.
PAD_IN = 0


class StopReason(enum.IntEnum):
    RUNNING = 0  # only inside the loop; every returned row has one of the reasons below
    EOS = 1
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3


class GenerateResult(NamedTuple):
    tokens_bn: jax.Array  # [B, max_new_tokens] int32; PAD_OUT after n_generated_b[b]
    n_generated_b: jax.Array  # [B] int32, EOS included when a row stopped at EOS
    stop_reason_b: jax.Array  # [B] int32 (StopReason)


class ARState(NamedTuple):
    """Loop carry of the AR while_loop (all device arrays; static shapes)."""

    tokens_bn: jax.Array  # [B, N] output buffer
    n_generated_b: jax.Array  # [B]
    last_b: jax.Array  # [B] last emitted token: fed at the next step
    cache: KVCache
    done_b: jax.Array  # [B] bool
    reason_b: jax.Array  # [B] int32
    step: jax.Array  # [] int32: tokens emitted by the most advanced row (the loop bound)
    key: jax.Array


# ----------------------------------------------------------------------------- host-side helpers


def bucket_length(n: int, min_bucket: int = 16) -> int:
    """Smallest power of two >= max(n, min_bucket): the padded prompt width (see module doc)."""
    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    if min_bucket < 1:
        raise ValueError(f"min_bucket must be >= 1, got {min_bucket}")
    m = max(int(n), int(min_bucket))
    return 1 << (m - 1).bit_length()


def pad_prompts(prompts: Sequence[Sequence[int]], min_bucket: int = 16):
    """Right-pad token lists into one bucket -> (tokens_bt int32 [B, bucket], lengths_b int32 [B])."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty; expected at least one token list")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"every prompt needs >= 1 token; got lengths {lengths.tolist()}")
    width = bucket_length(int(lengths.max()), min_bucket)
    tokens = np.full((len(prompts), width), PAD_IN, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


# ----------------------------------------------------------------------------- device pieces


def forward(params, cfg: LlamaConfig, tokens_bt, positions_bt, **kw):
    """The target forward on stacked params (``Llama``'s layer scan) or ``SplitParams``
    (layer-unrolled, the faster schedule on CPU; see ``confu_jax.models.unrolled``)."""
    if isinstance(params, SplitParams):
        return apply_unrolled(params, cfg, tokens_bt, positions_bt, **kw)
    return Llama(cfg).apply({"params": params}, tokens_bt, positions_bt, **kw)


def lm_head(params, cfg: LlamaConfig, hidden_btd):
    shared = params.shared if isinstance(params, SplitParams) else params
    return Llama(cfg).apply({"params": shared}, hidden_btd, method=Llama.logits)


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
        cache_kw = dict(cache_k_lbshd=cache.k_lbshd, cache_v_lbshd=cache.v_lbshd,
                        cache_len_bt=cache.length_b)
    out = forward(params, cfg, tokens_bt, positions_bt, return_logits=False, **cache_kw)
    last_b1d = out.hidden_btd[jnp.arange(b), lengths_b - 1][:, None, :]
    logits_bv = lm_head(params, cfg, last_b1d)[:, 0]
    cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, lengths_b)
    return logits_bv, cache


def decode_step(params, cfg: LlamaConfig, cache: KVCache, tokens_b: jax.Array, active_b: jax.Array):
    """Feed one token per row at position ``cache.length_b``; commit it only for active rows.

    Returns (logits_bv for the next token, updated cache). Inactive rows compute (static shapes)
    but leave their cache untouched.
    """
    out = forward(
        params,
        cfg,
        tokens_b[:, None],
        cache.length_b[:, None],
        cache_k_lbshd=cache.k_lbshd,
        cache_v_lbshd=cache.v_lbshd,
        cache_len_bt=cache.length_b,
    )
    cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, active_b.astype(jnp.int32))
    return out.logits_btv[:, 0], cache


def update_stop(tok_b, active_b, n_generated_b, cache_len_b, done_b, reason_b, eos_e, *,
                max_new_tokens: int, max_len: int):
    """Stop rows after emitting ``tok_b``. Priority: EOS, then max_new_tokens, then cache full.

    ``n_generated_b`` and ``cache_len_b`` are the counts *after* emitting ``tok_b``; cache full
    means the emitted token would need slot ``max_len`` when fed next. ``eos_e`` [E] int32 holds
    the EOS ids (-1 entries match nothing).
    """
    is_eos = jnp.any(tok_b[:, None] == eos_e[None, :], axis=-1)
    reason_new = jnp.where(
        is_eos,
        StopReason.EOS,
        jnp.where(
            n_generated_b >= max_new_tokens,
            StopReason.MAX_NEW_TOKENS,
            jnp.where(cache_len_b >= max_len, StopReason.CACHE_FULL, StopReason.RUNNING),
        ),
    ).astype(jnp.int32)
    newly_b = active_b & (reason_new != StopReason.RUNNING)
    return done_b | newly_b, jnp.where(newly_b, reason_new, reason_b)


def emit(tokens_bn, n_generated_b, tok_b, active_b):
    """Write ``tok_b`` at each active row's next output slot (inactive rows: dropped write)."""
    n = tokens_bn.shape[1]
    col_b = jnp.where(active_b, n_generated_b, n)  # n is out of bounds -> dropped
    tokens_bn = tokens_bn.at[jnp.arange(tokens_bn.shape[0]), col_b].set(tok_b, mode="drop")
    return tokens_bn, n_generated_b + active_b.astype(jnp.int32)


def _sample(key, logits_bv, temperature, top_p):
    # Greedy skips the sort/softmax of the sampling path at run time (lax.cond on a traced
    # temperature); both branches are ``next_token``'s own definition, so results are identical.
    return jax.lax.cond(
        temperature <= 0.0,
        lambda: jnp.argmax(logits_bv, axis=-1).astype(jnp.int32),
        lambda: next_token(key, logits_bv, temperature, top_p),
    )


# ----------------------------------------------------------------------------- the jitted loop

_TRACE_COUNT = [0]


def trace_count() -> int:
    """How many times the generation program has been traced (= compiled) in this process."""
    return _TRACE_COUNT[0]


def _generate_padded(params, tokens_bt, lengths_b, temperature, top_p, eos_e, key, *,
                     cfg: LlamaConfig, max_new_tokens: int, max_len: int,
                     unroll_layers: bool) -> GenerateResult:
    _TRACE_COUNT[0] += 1  # Python side effect: runs once per trace, never per call
    if unroll_layers:  # split once, outside the loop: every step reads per-layer buffers
        params = split_layers(params, cfg)
    b = tokens_bt.shape[0]
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    stop_kw = dict(max_new_tokens=max_new_tokens, max_len=max_len)

    cache = init_cache(cfg.n_layers, b, max_len, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    logits_bv, cache = prefill(params, cfg, cache, tokens_bt, lengths_b, attend_cache=False)
    tok_b = _sample(jax.random.fold_in(key, 0), logits_bv, temperature, top_p)
    all_b = jnp.ones((b,), bool)
    tokens_bn, n_gen_b = emit(jnp.full((b, max_new_tokens), PAD_OUT, jnp.int32),
                              jnp.zeros((b,), jnp.int32), tok_b, all_b)
    done_b, reason_b = update_stop(tok_b, all_b, n_gen_b, cache.length_b,
                                   jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), eos_e,
                                   **stop_kw)
    state = ARState(tokens_bn, n_gen_b, tok_b, cache, done_b, reason_b, jnp.int32(1), key)

    def cond(s: ARState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done_b)

    def body(s: ARState) -> ARState:
        active_b = ~s.done_b
        logits_bv, cache = decode_step(params, cfg, s.cache, s.last_b, active_b)
        tok_b = _sample(jax.random.fold_in(s.key, s.step), logits_bv, temperature, top_p)
        tokens_bn, n_gen_b = emit(s.tokens_bn, s.n_generated_b, tok_b, active_b)
        done_b, reason_b = update_stop(tok_b, active_b, n_gen_b, cache.length_b, s.done_b,
                                       s.reason_b, eos_e, **stop_kw)
        last_b = jnp.where(active_b, tok_b, s.last_b)
        return ARState(tokens_bn, n_gen_b, last_b, cache, done_b, reason_b, s.step + 1, s.key)

    state = jax.lax.while_loop(cond, body, state)
    return GenerateResult(state.tokens_bn, state.n_generated_b, state.reason_b)


generate_padded_jit = jax.jit(
    _generate_padded, static_argnames=("cfg", "max_new_tokens", "max_len", "unroll_layers")
)


def prepare_ar_inputs(cfg: LlamaConfig, prompts, *, lengths=None, max_new_tokens: int = 128,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                      min_bucket: int = 16, unroll_layers: Optional[bool] = None):
    """Validate and pad on the host -> (dynamic args after ``params``, static kwargs) of
    ``generate_padded_jit``. Arguments as in ``generate_ar``."""
    if lengths is None:
        tokens_bt, lengths_b = pad_prompts(prompts, min_bucket)
    else:
        arr = np.asarray(prompts, np.int32)
        lengths_b = np.asarray(lengths, np.int32)
        if arr.ndim != 2 or lengths_b.shape != (arr.shape[0],):
            raise ValueError(f"padded prompts must be [B, T] with lengths [B]; got prompts "
                             f"{arr.shape} and lengths {lengths_b.shape}")
        if lengths_b.min() < 1 or lengths_b.max() > arr.shape[1]:
            raise ValueError(f"lengths must lie in [1, {arr.shape[1]}] (the padded width); "
                             f"got {lengths_b.tolist()}")
        width = bucket_length(int(arr.shape[1]), min_bucket)
        tokens_bt = np.full((arr.shape[0], width), PAD_IN, np.int32)
        tokens_bt[:, : arr.shape[1]] = arr
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (temperature >= 0.0 and 0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got temperature={temperature}, "
                         f"top_p={top_p}")
    bucket = tokens_bt.shape[1]
    max_len = int(max_len) if max_len else bucket + int(max_new_tokens)
    if int(lengths_b.max()) > max_len:
        raise ValueError(f"KV cache of max_len={max_len} slots cannot hold a prompt of "
                         f"{int(lengths_b.max())} tokens")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    eos = [int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids)]
    if any(e < 0 for e in eos):
        raise ValueError(f"eos_ids must be token ids >= 0, got {eos}")
    eos_e = np.asarray(eos or [-1], np.int32)  # -1 matches no token: EOS stopping off
    args = (jnp.asarray(tokens_bt), jnp.asarray(lengths_b), jnp.float32(temperature),
            jnp.float32(top_p), jnp.asarray(eos_e), jax.random.PRNGKey(seed))
    if unroll_layers is None:
        unroll_layers = jax.default_backend() == "cpu"
    static = dict(cfg=cfg, max_new_tokens=int(max_new_tokens), max_len=max_len,
                  unroll_layers=bool(unroll_layers))
    return args, static


def generate_ar(params, cfg: LlamaConfig, prompts, *, lengths=None, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                min_bucket: int = 16, unroll_layers: Optional[bool] = None) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per prompt with one compiled program.

    ``prompts``: a list of token-id lists (any lengths), or a [B, T] array of right-padded
    prompts together with ``lengths`` [B]. ``eos_ids`` defaults to ``cfg.eos_token_ids`` (pass
    ``()`` to disable EOS stopping). ``max_len`` is the KV-cache size in slots (default: bucket +
    max_new_tokens, enough that no row hits it). Temperature 0 is greedy. ``unroll_layers``
    runs the layers from per-layer weight buffers instead of the scan (default: on CPU only;
    same results, ~2x less weight traffic per step there; see ``confu_jax.models.unrolled``).
    """
    args, static = prepare_ar_inputs(
        cfg, prompts, lengths=lengths, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, seed=seed, eos_ids=eos_ids, max_len=max_len, min_bucket=min_bucket,
        unroll_layers=unroll_layers)
    return generate_padded_jit(params, *args, **static)


def compile_ar(params, cfg: LlamaConfig, prompts, **kw):
    """Ahead-of-time compile for these prompts/settings -> (run, args): ``run(params, *args)``
    returns a ``GenerateResult`` without tracing or compiling. Lets benchmarks time compilation
    separately; keyword arguments as in ``generate_ar``."""
    args, static = prepare_ar_inputs(cfg, prompts, **kw)
    return generate_padded_jit.lower(params, *args, **static).compile(), args
