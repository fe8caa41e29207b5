"""Continuous batching for offline generation (self-distillation): B rows that never wait.

Static batching (``generate_ar`` on B prompts) runs until its longest row stops, so short answers
leave rows idle, and a new batch re-pays prefill for every row at once. Here a fixed set of B
**slots** decodes in one compiled program; a slot whose row stopped is **refilled** with the next
prompt by a second compiled program that prefills one row, without touching the others and
without recompiling (static shapes: the cache is [L, B, S], a row's position is its cache length,
as in the AR loop). The host only decides which prompt goes into which free slot.

Why it is faster: a decode step of B rows streams the weights once for B tokens; on a CPU, where
a step is bound by weight traffic, B = 32 rows cost a few times one row (docs/RESULTS.md).

Each row is exactly what ``generate_ar`` would produce for its prompt alone with the same cache
size (greedy; same prefill bucket, same stop rule, ``decode.stopping``): sampled rows draw from
per-row keys (``fold_in(key_of_row, n_generated)``), so a row's tokens do not depend on which
other prompts share the batch.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode.generate import decode_step
from confu_jax.decode.requests import bucket_length, check_settings, default_unroll_layers
from confu_jax.decode.sampling import choose_token, next_token
from confu_jax.decode.stopping import PAD_OUT, StopReason, emit, is_eos, update_stop
from confu_jax.models.kv_cache import KVCache, init_cache, write_row
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.unrolled import apply_target, split_layers, target_logits


class Slots(NamedTuple):
    """Device state of the B slots (carried between calls; donated)."""

    cache: KVCache  # [L, B, Hkv, S, hd] (per-layer buffers when layer-unrolled); a row's length is its position
    tokens_bn: jax.Array  # [B, N] int32 the row's generated tokens (N = max_new_tokens), PAD_OUT after
    n_generated_b: jax.Array  # [B] int32
    last_b: jax.Array  # [B] int32 last emitted token (fed at the next step)
    done_b: jax.Array  # [B] bool: finished (or never filled): the host may refill the row
    reason_b: jax.Array  # [B] int32 StopReason (RUNNING for a row never filled)
    key_b: jax.Array  # [B, 2] uint32 per-row PRNG keys


def init_slots(cfg: LlamaConfig, batch: int, max_len: int, max_new_tokens: int, *, per_layer: bool = False) -> Slots:
    cache = init_cache(cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
                       per_layer=per_layer)
    return Slots(cache, jnp.full((batch, max_new_tokens), PAD_OUT, jnp.int32), jnp.zeros((batch,), jnp.int32),
                 jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32),
                 jnp.zeros((batch, 2), jnp.uint32))


def _fill_row(params, slots: Slots, row, tokens_w, length, key, temperature, top_p, eos_e, *,
              cfg: LlamaConfig, max_new_tokens: int, max_len: int) -> Slots:
    """Prefill one prompt ([W] tokens, ``length`` real) into slot ``row`` and emit its first token."""
    w = tokens_w.shape[0]
    out = apply_target(params, cfg, tokens_w[None], jnp.arange(w, dtype=jnp.int32)[None], return_logits=False)
    logits_v = target_logits(params, cfg, out.hidden_btd[:, length - 1][:, None])[0, 0]
    tok = choose_token(jax.random.fold_in(key, 0), logits_v[None], temperature, top_p)[0]
    n = min(w, slots.cache.max_len)  # slots past the row's length are never attended: padding may land there
    cache = write_row(slots.cache, row, out.k_new_lbthd[:, :, :n], out.v_new_lbthd[:, :, :n], length)
    one = jnp.arange(slots.done_b.shape[0]) == row
    tokens_bn = jnp.where(one[:, None], PAD_OUT, slots.tokens_bn)
    n_gen = jnp.where(one, 0, slots.n_generated_b)
    tokens_bn, n_gen = emit(tokens_bn, n_gen, jnp.where(one, tok, 0), one)
    done_b, reason_b = update_stop(one, one & is_eos(tok, eos_e), n_gen, cache.length_b + 1,
                                   slots.done_b & ~one, jnp.where(one, StopReason.RUNNING, slots.reason_b),
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    return Slots(cache, tokens_bn, n_gen, jnp.where(one, tok, slots.last_b), done_b, reason_b,
                 slots.key_b.at[row].set(key))


def _choose_per_row(key_b, n_generated_b, logits_bv, temperature, top_p):
    """Each row's next token with its own key (``fold_in(key, n_generated)``). The greedy/sampled
    choice is one ``lax.cond`` for the whole batch: under ``vmap`` a cond would run both branches,
    and the sampling branch computes the softmax (and nucleus) of every row."""

    def sampled():
        keys = jax.vmap(jax.random.fold_in)(key_b, n_generated_b)
        return jax.vmap(lambda k, l: next_token(k, l[None], temperature, top_p)[0])(keys, logits_bv)

    return jax.lax.cond(temperature <= 0.0, lambda: jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), sampled)


def _decode_steps(params, slots: Slots, temperature, top_p, eos_e, *, cfg: LlamaConfig, n_steps: int,
                  max_new_tokens: int, max_len: int, unroll_layers: bool) -> Slots:
    """Up to ``n_steps`` AR steps of every running row (stops early once all rows are done)."""
    if unroll_layers:
        params = split_layers(params, cfg)

    def cond(carry):
        i, s = carry
        return (i < n_steps) & ~jnp.all(s.done_b)

    def body(carry):
        i, s = carry
        active_b = ~s.done_b
        logits_bv, cache = decode_step(params, cfg, s.cache, s.last_b, active_b)
        tok_b = _choose_per_row(s.key_b, s.n_generated_b, logits_bv, temperature, top_p)
        tokens_bn, n_gen = emit(s.tokens_bn, s.n_generated_b, tok_b, active_b)
        done_b, reason_b = update_stop(active_b, is_eos(tok_b, eos_e), n_gen, cache.length_b + 1, s.done_b,
                                       s.reason_b, max_new_tokens=max_new_tokens, max_len=max_len)
        return i + 1, Slots(cache, tokens_bn, n_gen, jnp.where(active_b, tok_b, s.last_b), done_b, reason_b,
                            s.key_b)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), slots))[1]


_fill_jit = jax.jit(_fill_row, static_argnames=("cfg", "max_new_tokens", "max_len"), donate_argnums=(1,))
_steps_jit = jax.jit(_decode_steps, static_argnames=("cfg", "n_steps", "max_new_tokens", "max_len",
                                                     "unroll_layers"), donate_argnums=(1,))


class Finished(NamedTuple):
    request_id: object
    tokens: list  # generated ids, EOS included when it stopped at EOS
    reason: StopReason


class ContinuousGenerator:
    """Host driver: keeps B slots busy with a stream of prompts, yields each finished request.

    ``max_len`` (cache slots per row) bounds prompt + answer: a prompt needs len + 1 <= max_len.
    ``steps_per_sync`` decode steps run between host checks for finished rows: larger amortises the
    host round trip, smaller refills freed rows sooner.
    """

    def __init__(self, params, cfg: LlamaConfig, *, batch: int = 32, max_len: int = 1024,
                 max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                 eos_ids: Optional[Sequence[int]] = None, steps_per_sync: int = 16, min_bucket: int = 16,
                 unroll_layers: Optional[bool] = None):
        if batch < 1 or steps_per_sync < 1:
            raise ValueError(f"need batch, steps_per_sync >= 1; got {batch}, {steps_per_sync}")
        eos_e = check_settings(cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               eos_ids=eos_ids, max_len=max_len)
        self.params, self.cfg, self.batch, self.max_len = params, cfg, batch, int(max_len)
        self.max_new_tokens, self.steps_per_sync, self.min_bucket = int(max_new_tokens), steps_per_sync, min_bucket
        self.temperature, self.top_p = jnp.float32(temperature), jnp.float32(top_p)
        self.eos_e = jnp.asarray(eos_e)
        self.unroll = default_unroll_layers(unroll_layers)
        self.tokens_generated = 0

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not 1 <= len(prompt) < self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: need 1 <= length < max_len={self.max_len}")
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise ValueError(f"prompt has token ids outside [0, {self.cfg.vocab_size})")

    def _fill(self, slots: Slots, row: int, prompt: Sequence[int], seed: int) -> Slots:
        w = min(bucket_length(len(prompt), self.min_bucket), self.max_len)
        tokens = np.zeros((w,), np.int32)
        tokens[:len(prompt)] = prompt
        return _fill_jit(self.params, slots, jnp.int32(row), jnp.asarray(tokens), jnp.int32(len(prompt)),
                         jax.random.PRNGKey(seed), self.temperature, self.top_p, self.eos_e, cfg=self.cfg,
                         max_new_tokens=self.max_new_tokens, max_len=self.max_len)

    def run(self, requests: Iterable[tuple], more: Optional[Callable[[], Iterable[tuple]]] = None):
        """Generate for ``(request_id, prompt_ids, seed)`` tuples; yields ``Finished`` as rows stop.

        ``more()`` (optional) is polled for new requests whenever a slot is free, so a caller can
        queue follow-ups (a conversation's next turn) as earlier answers finish.
        """
        queue = collections.deque(requests)
        owner: list = [None] * self.batch
        slots = init_slots(self.cfg, self.batch, self.max_len, self.max_new_tokens, per_layer=self.unroll)
        done_host = np.ones((self.batch,), bool)
        while True:
            if more is not None:
                queue.extend(more())
            for row in np.nonzero(done_host & np.array([o is None for o in owner]))[0]:
                if not queue:
                    break
                rid, prompt, seed = queue.popleft()
                self.check_prompt(prompt)
                slots = self._fill(slots, int(row), prompt, int(seed))
                owner[row] = rid
            if all(o is None for o in owner):
                return
            slots = _steps_jit(self.params, slots, self.temperature, self.top_p, self.eos_e, cfg=self.cfg,
                               n_steps=self.steps_per_sync, max_new_tokens=self.max_new_tokens,
                               max_len=self.max_len, unroll_layers=self.unroll)
            done_host, n_gen, reasons = jax.device_get((slots.done_b, slots.n_generated_b, slots.reason_b))
            finished = [r for r in range(self.batch) if owner[r] is not None and done_host[r]]
            if finished:
                toks = np.asarray(jax.device_get(slots.tokens_bn))
                for r in finished:
                    n = int(n_gen[r])
                    self.tokens_generated += n
                    yield Finished(owner[r], toks[r, :n].tolist(), StopReason(int(reasons[r])))
                    owner[r] = None
