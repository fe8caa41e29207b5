"""Continuous batching for offline generation (self-distillation): B rows that never wait.

Static batching (``generate_ar`` on B prompts) runs until its longest row stops, so short answers
leave rows idle, and a new batch re-pays prefill for every row at once. Here a fixed set of B
**slots** decodes in one compiled program; a slot whose row stopped is **refilled** with the next
prompt by a second compiled program that prefills only the rows being refilled, without touching
the others and without recompiling (static shapes: the cache is [L, B, S], a row's position is
its cache length, as in the AR loop). The host only decides which prompt goes into which slot.

**Prefix reuse (multi-turn).** A request may name a ``session`` (a conversation). When a request
of a session finishes, its slot is *parked*: the cache keeps what the row fed (prompt + answer,
all but the last emitted token). The session's next request (the next turn, whose prompt is the
previous prompt + the answer + the next user turn) goes into that same slot and prefills only the
tokens past the longest common prefix of what the slot fed and the new prompt, attending the
slot's cache for the rest; a multi-turn conversation then prefills each token once instead of
re-prefilling its whole context every turn. The comparison is on token ids, so a prompt whose
tokenisation differs from what was fed (the answer's text re-tokenised differently) reuses only
the common part. A parked slot is free: a request without a parked slot takes a never-used slot
first, else the least recently parked one. ``reuse_prefix=False`` refills every request from
position 0.

**Several rows per fill.** The rows refilled at one host sync are grouped by padded width
(``requests.bucket_length``) and prefilled together, up to ``max_fill_rows`` per call (split in
powers of two, one compiled program per width, row count and with/without a cache prefix).

Why it is faster: a decode step of B rows streams the weights once for B tokens; on a CPU, where
a step is bound by weight traffic, B = 32 rows cost a few times one row (docs/RESULTS.md).

Each row is what ``generate_ar`` would produce for its prompt alone with the same cache size
(same stop rule, ``decode.stopping``): sampled rows draw from per-row keys
(``fold_in(key_of_row, n_generated)``), so a row's tokens do not depend on which other prompts
share the batch. With ``reuse_prefix`` a continued row's prompt is computed in two pieces (the
cached prefix, then the new tokens attending it) instead of one block: the same arithmetic up to
float rounding, so greedy tokens can differ from a from-scratch prefill only where two logits tie
to within that rounding (tests check equality on the tiny model, where no such near-tie occurs).
Prefilling several rows together is exact (rows never mix).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode.generate import decode_step
from confu_jax.decode.requests import bucket_length, check_settings, default_unroll_layers
from confu_jax.decode.sampling import next_token
from confu_jax.decode.stopping import PAD_OUT, StopReason, emit, is_eos, update_stop
from confu_jax.models.kv_cache import KVCache, init_cache
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.unrolled import SplitParams, apply_target, split_layers, target_logits
from confu_jax.kernels.attention_reference import AttendTo


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


def _choose_per_row(key_b, n_generated_b, logits_bv, temperature, top_p):
    """Each row's next token with its own key (``fold_in(key, n_generated)``). The greedy/sampled
    choice is one ``lax.cond`` for the whole batch: under ``vmap`` a cond would run both branches,
    and the sampling branch computes the softmax (and nucleus) of every row."""

    def sampled():
        keys = jax.vmap(jax.random.fold_in)(key_b, n_generated_b)
        return jax.vmap(lambda k, l: next_token(k, l[None], temperature, top_p)[0])(keys, logits_bv)

    return jax.lax.cond(temperature <= 0.0, lambda: jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), sampled)


def _write_rows(buf, rows_k, starts_k, n_new_k, new_kwhd):
    """Row ``rows_k[i]``'s slots [start, start + n_new) of a per-layer cache buffer [B, Hkv, S, hd]
    <- ``new_kwhd[i, :n_new]`` (token-major [K, W, Hkv, hd]); other slots keep their values. One
    scatter (updated in place when nothing else in the program reads the buffer); entries past
    n_new or past the cache's end are dropped."""
    w = new_kwhd.shape[1]
    j = jnp.arange(w)[None, :]
    dest_kw = jnp.where(j < n_new_k[:, None], starts_k[:, None] + j, buf.shape[2])  # out of bounds: dropped
    # advanced indices (rows, slots) around a slice: their [K, W] axes come first, as in new_kwhd
    return buf.at[rows_k[:, None], :, dest_kw].set(new_kwhd.astype(buf.dtype), mode="drop")


def _fill_forward(params, cache: KVCache, rows_k, starts_k, tokens_kw, n_new_k, key_k, temperature, top_p, *,
                  cfg: LlamaConfig, attend_cache: bool, unroll_layers: bool):
    """The prefill of K rows -> (K/V of their new tokens [L, K, W, Hkv, hd] each, first tokens [K]).

    Row ``rows_k[i]`` feeds ``tokens_kw[i, :n_new_k[i]]`` at positions ``starts_k[i]...``,
    attending its cache slots [0, starts_k[i]) (``attend_cache``; without it every start must be
    0). Reads the cache, writes nothing: ``_fill_commit`` writes, in a separate program, because
    XLA:CPU copied every [B, Hkv, S, hd] buffer (1.1 GB at B = 32, S = 768) when one program both
    read the cache for attention and updated it in place. ``params``: the stacked tree or
    ``split_layers``' (the split form skips splitting, a copy of every weight, on each call).
    """
    if unroll_layers and not isinstance(params, SplitParams):
        params = split_layers(params, cfg)
    k, w = tokens_kw.shape
    positions_kw = starts_k[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    kw = {}
    if attend_cache:
        def take(kv):
            if cache.per_layer:
                return tuple(x[rows_k] for x in kv)
            return kv[:, rows_k]

        kw = dict(attend=AttendTo(k_cache=take(cache.k_lbhsd), v_cache=take(cache.v_lbhsd), cache_len=starts_k))
    out = apply_target(params, cfg, tokens_kw, positions_kw, return_logits=False, **kw)
    last_k1d = out.hidden_btd[jnp.arange(k), n_new_k - 1][:, None]
    logits_kv = target_logits(params, cfg, last_k1d)[:, 0]
    tok_k = _choose_per_row(key_k, jnp.zeros((k,), jnp.int32), logits_kv, temperature, top_p)
    return out.k_new_lbthd, out.v_new_lbthd, tok_k


def _fill_commit(slots: Slots, rows_k, starts_k, n_new_k, k_new_lkwhd, v_new_lkwhd, tok_k, key_k, eos_e, *,
                 max_new_tokens: int, max_len: int) -> Slots:
    """Write ``_fill_forward``'s K/V to rows ``rows_k`` (distinct) at slots [start, start + n_new),
    set their lengths to start + n_new, and emit each row's first token ``tok_k``."""
    b = slots.done_b.shape[0]
    cache = slots.cache

    def put(buf, new_lkwhd):
        if cache.per_layer:
            return tuple(_write_rows(x, rows_k, starts_k, n_new_k, new_lkwhd[i]) for i, x in enumerate(buf))
        return jax.vmap(_write_rows, in_axes=(0, None, None, None, 0))(buf, rows_k, starts_k, n_new_k, new_lkwhd)

    length_b = cache.length_b.at[rows_k].set(starts_k + n_new_k)
    cache = KVCache(put(cache.k_lbhsd, k_new_lkwhd), put(cache.v_lbhsd, v_new_lkwhd), length_b)
    one = jnp.zeros((b,), bool).at[rows_k].set(True)
    tok_b = jnp.zeros((b,), jnp.int32).at[rows_k].set(tok_k)
    tokens_bn = jnp.where(one[:, None], PAD_OUT, slots.tokens_bn)
    n_gen = jnp.where(one, 0, slots.n_generated_b)
    tokens_bn, n_gen = emit(tokens_bn, n_gen, tok_b, one)
    done_b, reason_b = update_stop(one, one & is_eos(tok_b, eos_e), n_gen, length_b + 1,
                                   slots.done_b & ~one, jnp.where(one, StopReason.RUNNING, slots.reason_b),
                                   max_new_tokens=max_new_tokens, max_len=max_len)
    return Slots(cache, tokens_bn, n_gen, jnp.where(one, tok_b, slots.last_b), done_b, reason_b,
                 slots.key_b.at[rows_k].set(key_k))


def _decode_steps(params, slots: Slots, temperature, top_p, eos_e, *, cfg: LlamaConfig, n_steps: int,
                  max_new_tokens: int, max_len: int, unroll_layers: bool) -> Slots:
    """Up to ``n_steps`` AR steps of every running row (stops early once all rows are done)."""
    if unroll_layers and not isinstance(params, SplitParams):
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


_forward_jit = jax.jit(_fill_forward, static_argnames=("cfg", "attend_cache", "unroll_layers"))
_commit_jit = jax.jit(_fill_commit, static_argnames=("max_new_tokens", "max_len"), donate_argnums=(0,))
_steps_jit = jax.jit(_decode_steps, static_argnames=("cfg", "n_steps", "max_new_tokens", "max_len",
                                                     "unroll_layers"), donate_argnums=(1,))


class Finished(NamedTuple):
    request_id: object
    tokens: list  # generated ids, EOS included when it stopped at EOS
    reason: StopReason


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pow2_chunks(n: int, most: int) -> list:
    """``n`` split into powers of two, each <= ``most`` (largest first): 7, 4 -> [4, 2, 1]."""
    out = []
    while n > 0:
        c = min(1 << (n.bit_length() - 1), 1 << (max(most, 1).bit_length() - 1))
        out.append(c)
        n -= c
    return out


class ContinuousGenerator:
    """Host driver: keeps B slots busy with a stream of prompts, yields each finished request.

    ``max_len`` (cache slots per row) bounds prompt + answer: a prompt needs len + 1 <= max_len.
    ``steps_per_sync`` decode steps run between host checks for finished rows: larger amortises the
    host round trip, smaller refills freed rows sooner. ``reuse_prefix``: a request's ``session``
    continues in its parked slot, prefilling only what the slot's cache lacks (module doc).
    ``max_fill_rows``: rows prefilled together in one call at most. ``profile``: wait for each
    fill and each decode call to finish and add their wall times to ``stats`` (costs a few
    host round trips).

    ``stats``: ``fill_calls``, ``fill_rows``, ``prefill_tokens`` (real tokens prefilled),
    ``padded_tokens`` (width x rows computed), ``reused_tokens`` (prompt tokens found in a
    parked slot's cache), ``decode_calls``; with ``profile`` also ``fill_s``, ``decode_s``.
    ``timeline``: one ``(time, tokens emitted so far, rows running)`` per decode call (throughput
    over any window, e.g. while every slot had work).
    """

    def __init__(self, params, cfg: LlamaConfig, *, batch: int = 32, max_len: int = 1024,
                 max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                 eos_ids: Optional[Sequence[int]] = None, steps_per_sync: int = 16, min_bucket: int = 16,
                 unroll_layers: Optional[bool] = None, reuse_prefix: bool = True, max_fill_rows: int = 1,
                 profile: bool = False):
        if batch < 1 or steps_per_sync < 1 or max_fill_rows < 1:
            raise ValueError(f"need batch, steps_per_sync, max_fill_rows >= 1; got {batch}, {steps_per_sync}, "
                             f"{max_fill_rows}")
        eos_e = check_settings(cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               eos_ids=eos_ids, max_len=max_len)
        self.params, self.cfg, self.batch, self.max_len = params, cfg, batch, int(max_len)
        self.max_new_tokens, self.steps_per_sync, self.min_bucket = int(max_new_tokens), steps_per_sync, min_bucket
        self.temperature, self.top_p = jnp.float32(temperature), jnp.float32(top_p)
        self.eos_e = jnp.asarray(eos_e)
        self.unroll = default_unroll_layers(unroll_layers)
        # the compiled programs read per-layer weight buffers, split once here (not on every call)
        self.program_params = split_layers(params, cfg) if self.unroll else params
        self.reuse_prefix, self.max_fill_rows, self.profile = bool(reuse_prefix), int(max_fill_rows), bool(profile)
        self.tokens_generated = 0
        self.stats = collections.Counter()
        self.timeline: list = []  # per decode call: (perf_counter, tokens emitted so far, rows running)

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not 1 <= len(prompt) < self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: need 1 <= length < max_len={self.max_len}")
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise ValueError(f"prompt has token ids outside [0, {self.cfg.vocab_size})")

    def _width(self, n: int) -> int:
        return min(bucket_length(n, self.min_bucket), self.max_len)

    def _fill(self, slots: Slots, fills: list) -> Slots:
        """Prefill ``fills`` = [(row, start, new_tokens, seed)]: grouped by (width, start > 0), up
        to ``max_fill_rows`` rows a call."""
        groups = collections.defaultdict(list)
        for f in fills:
            groups[(self._width(len(f[2])), f[1] > 0)].append(f)
        for (w, attend), group in sorted(groups.items()):
            at = 0
            for k in pow2_chunks(len(group), self.max_fill_rows):
                part, at = group[at:at + k], at + k
                tokens = np.zeros((k, w), np.int32)
                for i, (_, _, new, _) in enumerate(part):
                    tokens[i, :len(new)] = new
                rows = np.asarray([f[0] for f in part], np.int32)
                starts = np.asarray([f[1] for f in part], np.int32)
                n_new = np.asarray([len(f[2]) for f in part], np.int32)
                keys = jnp.stack([jax.random.PRNGKey(int(f[3])) for f in part])
                t0 = time.perf_counter()
                rows, starts, n_new = jnp.asarray(rows), jnp.asarray(starts), jnp.asarray(n_new)
                k_new, v_new, tok = _forward_jit(self.program_params, slots.cache, rows, starts, jnp.asarray(tokens),
                                                 n_new, keys, self.temperature, self.top_p, cfg=self.cfg,
                                                 attend_cache=attend, unroll_layers=self.unroll)
                slots = _commit_jit(slots, rows, starts, n_new, k_new, v_new, tok, keys, self.eos_e,
                                    max_new_tokens=self.max_new_tokens, max_len=self.max_len)
                if self.profile:
                    jax.block_until_ready(slots.done_b)
                    self.stats["fill_s"] += time.perf_counter() - t0
                self.stats["fill_calls"] += 1
                self.stats["fill_rows"] += k
                self.stats["prefill_tokens"] += int(sum(len(f[2]) for f in part))
                self.stats["padded_tokens"] += k * w
        return slots

    def warm_up(self, max_prompt_len: int) -> float:
        """Compile (by running them once on throwaway slots) every program a run with prompts of at
        most ``max_prompt_len`` tokens can call: a fill per width, row count and prefix mode, and
        the decode call. Returns the seconds spent; ``stats`` are left as they were."""
        t0, saved = time.perf_counter(), self.stats.copy()
        slots = init_slots(self.cfg, self.batch, self.max_len, self.max_new_tokens, per_layer=self.unroll)
        widths = sorted({self._width(n) for n in range(1, max(1, min(max_prompt_len, self.max_len - 1)) + 1)})
        counts = sorted({c for n in range(1, min(self.max_fill_rows, self.batch) + 1)
                         for c in pow2_chunks(n, self.max_fill_rows)})
        for w in widths:
            for k in counts:
                for start in ((0, 1) if self.reuse_prefix else (0,)):
                    slots = self._fill(slots, [(r, start, [1] * min(w, self.max_len - 1 - start), 0)
                                               for r in range(k)])
        slots = _steps_jit(self.program_params, slots, self.temperature, self.top_p, self.eos_e, cfg=self.cfg,
                           n_steps=self.steps_per_sync, max_new_tokens=self.max_new_tokens,
                           max_len=self.max_len, unroll_layers=self.unroll)
        jax.block_until_ready(slots)
        self.stats = saved
        return time.perf_counter() - t0

    def run(self, requests: Iterable[tuple], more: Optional[Callable[[], Iterable[tuple]]] = None):
        """Generate for ``(request_id, prompt_ids, seed)`` or ``(request_id, prompt_ids, seed,
        session)`` tuples; yields ``Finished`` as rows stop.

        ``more()`` (optional) is polled for new requests whenever a slot is free, so a caller can
        queue follow-ups (a conversation's next turn) as earlier answers finish. A request whose
        ``session`` matches a finished request's continues in that request's parked slot
        (``reuse_prefix``); queue it in the ``more()`` poll right after its predecessor finished,
        before a new request may take the slot.
        """
        queue = collections.deque(requests)
        owner: list = [None] * self.batch  # request id of the running row
        session: list = [None] * self.batch  # session of the row's cache (running or parked)
        fed: list = [[] for _ in range(self.batch)]  # token ids whose K/V the row's cache holds
        parked_at = [-1] * self.batch  # order in which rows were parked (-1: never used)
        n_parked = 0
        slots = init_slots(self.cfg, self.batch, self.max_len, self.max_new_tokens, per_layer=self.unroll)
        while True:
            if more is not None:
                queue.extend(more())
            fills, waiting = [], collections.deque()
            by_session = {session[r]: r for r in range(self.batch) if owner[r] is None and session[r] is not None}
            # continuations first: a new request must not take the slot a follow-up is queued for
            for req in queue:
                sess = req[3] if len(req) > 3 else None
                row = by_session.pop(sess, None) if self.reuse_prefix and sess is not None else None
                if row is None:
                    waiting.append(req)
                    continue
                rid, prompt, seed = req[:3]
                self.check_prompt(prompt)
                p = min(common_prefix(fed[row], prompt), len(prompt) - 1)
                self.stats["reused_tokens"] += p
                fills.append((row, p, prompt[p:], seed))
                owner[row], fed[row] = rid, list(prompt)
            free = sorted((r for r in range(self.batch) if owner[r] is None), key=lambda r: parked_at[r])
            queue = collections.deque()
            for req in waiting:
                if not free:
                    queue.append(req)
                    continue
                row = free.pop(0)
                rid, prompt, seed = req[:3]
                self.check_prompt(prompt)
                fills.append((row, 0, list(prompt), seed))
                owner[row], fed[row] = rid, list(prompt)
                session[row] = req[3] if len(req) > 3 else None
            if fills:
                slots = self._fill(slots, fills)
            if all(o is None for o in owner):
                return
            t0 = time.perf_counter()
            slots = _steps_jit(self.program_params, slots, self.temperature, self.top_p, self.eos_e, cfg=self.cfg,
                               n_steps=self.steps_per_sync, max_new_tokens=self.max_new_tokens,
                               max_len=self.max_len, unroll_layers=self.unroll)
            done_host, n_gen, reasons = jax.device_get((slots.done_b, slots.n_generated_b, slots.reason_b))
            if self.profile:
                self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decode_calls"] += 1
            running = [r for r in range(self.batch) if owner[r] is not None]
            self.timeline.append((time.perf_counter(), self.tokens_generated + int(sum(n_gen[r] for r in running)),
                                  len(running)))
            finished = [r for r in range(self.batch) if owner[r] is not None and done_host[r]]
            if finished:
                toks = np.asarray(jax.device_get(slots.tokens_bn))
                for r in finished:
                    n = int(n_gen[r])
                    self.tokens_generated += n
                    out = toks[r, :n].tolist()
                    fed[r] = fed[r] + out[:-1]  # the last emitted token is never fed
                    rid, owner[r] = owner[r], None
                    parked_at[r], n_parked = n_parked, n_parked + 1
                    yield Finished(rid, out, StopReason(int(reasons[r])))
