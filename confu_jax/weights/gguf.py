"""GGUF (llama.cpp) checkpoints -> ``(LlamaConfig, params)``.

Tensors are dequantised to float32 with ``gguf.quants.dequantize`` (Q4_1/Q8_0 for the embedded
SmolLM2), then cast to the requested dtype. llama.cpp's converter permutes the rows of Q and K so
its interleaved RoPE kernel can read them; our RoPE is HF's half-split, so those rows are
permuted back (docs/DESIGN.md §1). Llama-3 frequency scaling is stored as a ``rope_freqs.weight``
tensor of per-frequency divisors rather than as metadata; we recover the (factor, low, high,
original context) tuple from it and check that it reproduces the tensor exactly.

Qwen2 and Qwen3 GGUFs (``general.architecture`` 'qwen2' / 'qwen3') run NEOX-style RoPE in llama.cpp,
which is HF's half-split: their converter leaves Q and K unpermuted, so nothing is undone there.
Qwen2 adds ``attn_{q,k,v}.bias``; Qwen3 adds ``attn_{q,k}_norm.weight``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from confu_jax.models.llama import LlamaConfig, rope_inv_freq
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.gguf_file import GGUFContainer
from confu_jax.weights.tree import assemble

_LAYER_NAMES = {
    "attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "mlp_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
}
_BIASES = {"q_bias": "attn_q", "k_bias": "attn_k", "v_bias": "attn_v"}
_GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def gguf_name(kind: str, layer: Optional[int]) -> str:
    if layer is None:
        return _GLOBAL_NAMES[kind]
    if kind in _BIASES:
        return f"blk.{layer}.{_BIASES[kind]}.bias"
    return f"blk.{layer}.{_LAYER_NAMES[kind]}.weight"


def unpermute_qk(w_oi: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, rows (pair, half) -> (half, pair)."""
    out, inp = w_oi.shape
    return w_oi.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


class GGUFFile:
    """Typed metadata access and float32 tensors of one GGUF file."""

    def __init__(self, path: str):
        self.path = path
        self.container = GGUFContainer(path)
        self.tensors = self.container.tensors

    def get(self, key: str, default=None):
        v = self.container.fields.get(key)
        if v is None:
            return default
        if isinstance(v, float):  # stored as float32: 1e-5 reads back as 9.99999974e-06
            v = float(str(np.float32(v)))
        return v

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise CheckpointError(f"{self.path}: missing GGUF metadata key {key!r}")
        return v

    def tensor(self, name: str) -> np.ndarray:
        """Float32 array in PyTorch orientation (numpy shape = GGUF dims reversed)."""
        from gguf import GGMLQuantizationType as Q
        from gguf import quants

        t = self.tensors[name]
        try:
            qtype = Q(t.ggml_type)
        except ValueError:
            qtype = None
        if qtype is None or (qtype not in (Q.F32, Q.F16) and qtype not in quants._type_traits):
            found = qtype.name if qtype is not None else f"unknown id {t.ggml_type}"
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has GGML type {found}, which gguf cannot dequantise; "
                "expected F32, F16, BF16 or a supported quant type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...)"
            )
        w = quants.dequantize(self.container.raw(t), qtype)
        return np.asarray(w, np.float32).reshape(tuple(reversed(t.dims)))


def llama3_scaling_from_freqs(divisors: np.ndarray, cfg: LlamaConfig, source: str) -> tuple:
    """Recover ``rope_scaling`` from llama.cpp's per-frequency divisors (``rope_freqs.weight``).

    factor is the largest divisor; low/high frequency factors and the original context are the
    Llama-3.x values (1, 4, 8192) -- accepted only if they reproduce every divisor.
    """
    factor = float(np.max(divisors))
    for low, high, ctx in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 2048)):
        cand = (factor, low, high, ctx)
        plain = rope_inv_freq(cfg.replace(rope_scaling=None))
        scaled = rope_inv_freq(cfg.replace(rope_scaling=cand))
        if np.allclose(plain / scaled, divisors, rtol=1e-4, atol=1e-5):
            return cand
    raise CheckpointError(
        f"{source}: tensor 'rope_freqs.weight' does not match Llama-3 RoPE scaling with "
        f"factor {factor} and (low, high, original context) in {{(1, 4, 8192/4096/2048)}}; "
        "other RoPE scalings are not supported"
    )


def read_config(g: GGUFFile, dtype: Optional[str] = None) -> LlamaConfig:
    arch = g.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{g.path}: general.architecture is {arch!r}; expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    dtype = dtype or "float32"
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} not supported; expected one of {list(FLOAT_DTYPES)}")
    n_experts = g.get(f"{arch}.expert_count", 0) or 0
    if n_experts:
        raise CheckpointError(f"{g.path}: {arch}.expert_count is {n_experts}; mixture-of-experts models are not supported")
    d = int(g.require(f"{arch}.embedding_length"))
    n_heads = int(g.require(f"{arch}.attention.head_count"))
    n_kv = int(g.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(g.get(f"{arch}.attention.key_length", d // n_heads))
    rot = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(
            f"{g.path}: {arch}.rope.dimension_count is {rot}; expected head_dim {head_dim} (partial RoPE unsupported)"
        )
    scaling_type = g.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise CheckpointError(f"{g.path}: {arch}.rope.scaling.type is {scaling_type!r}; only Llama-3 rope_freqs is supported")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = g.get(f"{arch}.vocab_size")
    if vocab is None and tokens is not None:
        vocab = len(tokens)
    if vocab is None:
        embd = g.tensors.get("token_embd.weight")
        if embd is None or len(embd.dims) != 2:
            found = "is missing" if embd is None else f"has dims {embd.dims}, expected 2"
            raise CheckpointError(
                f"{g.path}: cannot tell the vocabulary size: no {arch}.vocab_size or tokenizer.ggml.tokens, "
                f"and tensor 'token_embd.weight' {found}"
            )
        vocab = int(embd.dims[1])
    eos = [g.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = g.get("tokenizer.ggml.bos_token_id")
    cfg = LlamaConfig(
        vocab_size=int(vocab),
        d_model=d,
        n_layers=int(g.require(f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=int(g.require(f"{arch}.feed_forward_length")),
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in g.tensors,
        max_position_embeddings=int(g.get(f"{arch}.context_length", 8192)),
        dtype=dtype,
        param_dtype=dtype,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    if "rope_freqs.weight" in g.tensors:
        divisors = g.tensor("rope_freqs.weight").reshape(-1)
        if divisors.shape != (head_dim // 2,):
            raise CheckpointError(
                f"{g.path}: tensor 'rope_freqs.weight' has shape {divisors.shape}; expected ({head_dim // 2},)"
            )
        if not np.allclose(divisors, 1.0):
            cfg = cfg.replace(rope_scaling=llama3_scaling_from_freqs(divisors, cfg, g.path))
    return cfg


def load_gguf(path: str, dtype: Optional[str] = None):
    """``(LlamaConfig, params)`` from a GGUF file; params in ``dtype`` (default float32)."""
    g = GGUFFile(path)
    cfg = read_config(g, dtype)
    # llama.cpp permutes Q/K rows for its interleaved RoPE only under the 'llama' architecture
    permuted = g.require("general.architecture") == "llama"
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads} if permuted else {}

    def fetch(name: str) -> np.ndarray:
        w = g.tensor(name)
        kind = name.split(".")[2] if name.startswith("blk.") and name.endswith(".weight") else None
        if kind in heads:
            if w.ndim != 2 or w.shape[0] % (2 * heads[kind]):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {w.shape}; expected rows divisible by 2*{heads[kind]} heads"
                )
            w = unpermute_qk(w, heads[kind])
        return w

    params = assemble(
        cfg,
        source=path,
        name_of=gguf_name,
        fetch=fetch,
        available=g.tensors,
        ignorable=lambda n: n == "rope_freqs.weight",
    )
    return cfg, params
