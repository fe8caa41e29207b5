"""One validator for decode requests, AR and speculative: prompts, sampling settings, cache size.

Both loops are compiled for static shapes, so a request is checked and padded on the host before
it reaches a jitted program; an error here names the argument, what was expected and what came.

Prompts are right-padded to a **length bucket**: the smallest power of two >= the longest prompt
(at least ``min_bucket``). A new prompt length therefore recompiles only when it crosses a power
of two (log2(L) programs for all lengths up to L), at the price of at most 2x padding in prefill.
Padded positions are computed in prefill but never committed: each row commits exactly its true
length, so padding cannot leak into attention.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.llama import LlamaConfig

# Token fed in right-padding positions of a prompt; never committed, so its value is irrelevant.
PAD_IN = 0


def bucket_length(n: int, min_bucket: int = 16) -> int:
    """Smallest power of two >= max(n, min_bucket): the padded prompt width (see module doc)."""
    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    if min_bucket < 1:
        raise ValueError(f"min_bucket must be >= 1, got {min_bucket}")
    m = max(int(n), int(min_bucket))
    return 1 << (m - 1).bit_length()



def one_prompt_per_bucket(prompts: Sequence[Sequence[int]], min_bucket: int = 16) -> list:
    """The first prompt of every padded width (``bucket_length``) among ``prompts``: one warm-up call
    each compiles every program a timed run over ``prompts`` will use (the loops compile one
    program per bucket, so warming a single prompt leaves the others' compilation in the timing)."""
    firsts = {}
    for prompt in prompts:
        firsts.setdefault(bucket_length(len(prompt), min_bucket), prompt)
    return list(firsts.values())


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


def _pad_array(prompts, lengths, min_bucket: int):
    """An already right-padded [B, T] array with its lengths -> the bucketed array and lengths."""
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
    return tokens_bt, lengths_b


class DecodeRequest(NamedTuple):
    """A validated request, ready for a compiled loop."""

    tokens_bt: np.ndarray  # [B, bucket] int32, right-padded with PAD_IN
    lengths_b: np.ndarray  # [B] int32 true prompt lengths
    max_new_tokens: int
    max_len: int  # KV-cache slots
    temperature: float
    top_p: float
    eos_e: np.ndarray  # [E] int32 EOS ids; [-1] (matches nothing) turns EOS stopping off
    seed: int

    def device_args(self) -> tuple:
        """(tokens, lengths, temperature, top_p, eos ids, key): the traced arguments of a loop."""
        return (jnp.asarray(self.tokens_bt), jnp.asarray(self.lengths_b), jnp.float32(self.temperature),
                jnp.float32(self.top_p), jnp.asarray(self.eos_e), jax.random.PRNGKey(self.seed))


def check_settings(cfg: LlamaConfig, *, max_new_tokens: int, temperature: float, top_p: float,
                   eos_ids: Optional[Sequence[int]], max_len: int) -> np.ndarray:
    """The per-request settings every decoding program shares -> EOS ids ``eos_e`` [E] int32
    (``cfg.eos_token_ids`` when ``eos_ids`` is None; [-1], matching nothing, when empty)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (temperature >= 0.0 and 0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got temperature={temperature}, "
                         f"top_p={top_p}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} (KV-cache slots) exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}: lower the cache or the budgets that size it "
                         "(launch.generate: --config.decode.max_len, 0 = from the prompt and max_new_tokens; "
                         "launch.generate_data: --max_prompt_len + --max_new_tokens)")
    eos = [int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids)]
    if any(e < 0 for e in eos):
        raise ValueError(f"eos_ids must be token ids >= 0, got {eos}")
    return np.asarray(eos or [-1], np.int32)  # -1 matches no token: EOS stopping off


def validate_request(cfg: LlamaConfig, prompts, *, lengths=None, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                     eos_ids: Optional[Sequence[int]] = None, max_len: Optional[int] = None,
                     min_bucket: int = 16, reserve: int = 0, reserve_what: str = "") -> DecodeRequest:
    """Check and pad a request for target ``cfg``.

    ``prompts``: token-id lists (any lengths), or a [B, T] right-padded array with ``lengths``.
    ``eos_ids`` defaults to ``cfg.eos_token_ids`` (``()`` disables EOS stopping). ``max_len``
    defaults to bucket + max_new_tokens + ``reserve`` (the longest prompt instead of its bucket where
    the bucket would pass the model's context), where ``reserve`` is the number of cache
    slots a row needs beyond its prompt before it can emit (speculative decoding: one
    verification of depth D, D+1 slots; ``reserve_what`` names it in the error).
    """
    if lengths is None:
        tokens_bt, lengths_b = pad_prompts(prompts, min_bucket)
    else:
        tokens_bt, lengths_b = _pad_array(prompts, lengths, min_bucket)
    in_prompt = np.arange(tokens_bt.shape[1])[None, :] < lengths_b[:, None]
    bad = in_prompt & ((tokens_bt < 0) | (tokens_bt >= cfg.vocab_size))
    if bad.any():
        b = int(np.nonzero(bad.any(axis=1))[0][0])
        raise ValueError(f"prompt {b} has token ids outside [0, {cfg.vocab_size}): "
                         f"{tokens_bt[b][bad[b]][:5].tolist()}")
    longest = int(lengths_b.max())
    if not max_len:
        # bucket + new tokens: one cache size (one program) per bucket. Near the model's context that
        # rounding can refuse what fits (a 4.5k prompt in the 8k bucket of an 8k model): then the
        # longest row's own need (commits past the cache's end are dropped, so the padded prefill
        # may be wider than the cache).
        max_len = tokens_bt.shape[1] + int(max_new_tokens) + reserve
        if max_len > cfg.max_position_embeddings:
            max_len = longest + int(max_new_tokens) + reserve
            if max_len > cfg.max_position_embeddings:
                raise ValueError(
                    f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens}"
                    f"{f' plus {reserve_what}' if reserve_what else ''} needs {max_len} cache slots; the "
                    f"model's context is max_position_embeddings={cfg.max_position_embeddings}: lower "
                    "max_new_tokens (--config.decode.max_new_tokens) or shorten the prompt")
    max_len = int(max_len)
    eos_e = check_settings(cfg, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           eos_ids=eos_ids, max_len=max_len)
    if longest + reserve > max_len:
        extra = f" plus {reserve_what}" if reserve_what else ""
        raise ValueError(f"KV cache of max_len={max_len} slots cannot hold a prompt of {longest} tokens{extra}")
    return DecodeRequest(tokens_bt, lengths_b, int(max_new_tokens), max_len, float(temperature),
                         float(top_p), eos_e, int(seed))


def default_unroll_layers(unroll_layers: Optional[bool], mesh=None) -> bool:
    """Layer-unrolled target forward by default when compiling for a CPU only
    (``confu_jax.models.unrolled``): the platform of ``mesh``'s devices when there is one, else
    ``devices.compile_platform()`` — never the host's backend, which differs when compiling for a topology."""
    from confu_jax.devices import compile_platform, mesh_platform

    if unroll_layers is not None:
        return bool(unroll_layers)
    return (mesh_platform(mesh) if mesh is not None else compile_platform()) == "cpu"
