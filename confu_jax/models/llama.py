"""Llama-family decoder (Llama-2/3.x, SmolLM2; Qwen2/2.5 and Qwen3 dense) in Flax Linen.

Qwen2 is Llama with biases on the q/k/v projections (``attention_bias``); Qwen3 dense is Llama with
an RMSNorm over each head's query and key before RoPE (``qk_norm``). Both are flags of one block,
so every forward, cache and drafter below serves them unchanged.

One forward serves every use: full sequence, prefill against a fixed-size cache, decode of several
tokens at explicit positions under an explicit block mask (tree verification), and ConFu's
contemplate queries (input embeddings overridden, soft-prompt prefix visible to some queries).

The forward never writes the cache: it returns the new tokens' post-RoPE K/V for every layer
(``k_new_lbthd``) and the caller commits what it accepts (``confu_jax.models.kv_cache``). That keeps
verification of rejected tree nodes free of cache clean-up and keeps the forward pure.

Layers are stacked with ``nn.scan`` so a 30-layer model compiles as one layer; every parameter in
``params['layers']`` carries a leading layer axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from confu_jax import sharding as shd
from confu_jax.kernels import cpu_matmul
from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.attention import masked_attention
from confu_jax.models.kv_cache import stacked


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    # Llama-3 frequency scaling: None or a tuple
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_scaling: Optional[tuple] = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # 'xla' | 'pallas' | 'pallas_interpret'
    # a training row attending to itself: 'xla' | 'pallas' (GPU) | 'splash' (TPU) | '*_interpret' (kernels.fused_attention)
    flash_impl: str = "xla"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    # Qwen2 / Qwen2.5: q, k and v projections carry biases ('q_proj': {'kernel', 'bias'}, ...).
    attention_bias: bool = False
    # Qwen3: per-head RMSNorm of queries and keys (over head_dim) before RoPE ('q_norm', 'k_norm').
    qk_norm: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def default_taps(self) -> tuple:
        """EAGLE-3 feature taps: hidden states entering layers 2, L//2 and L-3."""
        return (2, self.n_layers // 2, self.n_layers - 3)

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)


class LlamaOutput(NamedTuple):
    logits_btv: Optional[jax.Array]  # [B,T,V] float32, None when return_logits=False
    hidden_btd: jax.Array  # last layer after the final norm (what the LM head reads)
    taps_btc: Optional[jax.Array]  # [B,T,len(taps)*D]: hidden states entering the tapped layers
    k_new_lbthd: jax.Array  # [L,B,T,Hkv,hd] post-RoPE keys of this call's tokens
    v_new_lbthd: jax.Array


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [hd/2], with Llama-3 scaling as in Hugging Face `_compute_llama3_parameters`."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if cfg.rope_scaling is None:
        return inv.astype(np.float32)
    factor, low, high, old_ctx = cfg.rope_scaling
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_l).astype(np.float32)


def rope_cos_sin(positions_bt: jax.Array, cfg: LlamaConfig):
    inv = jnp.asarray(rope_inv_freq(cfg))
    ang = positions_bt.astype(jnp.float32)[..., None] * inv  # [B,T,hd/2]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_bthd: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Half-split rotation (HF `rotate_half` layout; GGUF weights are un-permuted to match)."""
    half = x_bthd.shape[-1] // 2
    x1, x2 = x_bthd[..., :half].astype(jnp.float32), x_bthd[..., half:].astype(jnp.float32)
    c, s = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_bthd.dtype)


def layer_context(cfg: LlamaConfig, bt: tuple, positions_bt, attend: Optional[AttendTo], tap_layers: Sequence[int]):
    """What every layer of one forward shares (RoPE, the mask and visible lengths of ``attend`` —
    a model-level ``AttendTo`` whose cache and prefix each layer slices — and tap indices), with the
    argument checks; used by the scanned (``Llama``) and unrolled (``models.unrolled``) forwards.
    Returns (ctx dict, validated tap layer tuple); ``ctx["attend"]`` has the mask filled in (causal
    when None) and no cache or prefix arrays (the layers get theirs)."""
    b, t = bt
    attend = attend if attend is not None else AttendTo()
    mask = attend.mask
    if mask is None:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    cos, sin = rope_cos_sin(positions_bt, cfg)
    shared = AttendTo(mask=mask)
    if attend.k_cache is not None:
        if attend.cache_len is None:
            raise ValueError("AttendTo.cache_len is required when a cache is given")
        shared = dataclasses.replace(shared, cache_len=jnp.asarray(attend.cache_len, jnp.int32))
        if attend.cache_start is not None:  # packed rows: first visible slot (the query's segment start)
            shared = dataclasses.replace(shared, cache_start=jnp.asarray(attend.cache_start, jnp.int32))
    if attend.k_prefix is not None:
        if attend.prefix_visible is None:
            raise ValueError("AttendTo.prefix_visible is required when prefix K/V are given")
        shared = dataclasses.replace(shared, prefix_visible=attend.prefix_visible)
    ctx = {"cos": cos, "sin": sin, "attend": shared}
    tap_layers = tuple(int(i) for i in tap_layers)
    for li in tap_layers:
        if not 0 <= li < cfg.n_layers:
            raise ValueError(f"tap layer {li} outside [0, {cfg.n_layers})")
    ctx["tap_layers"] = jnp.asarray(tap_layers, jnp.int32)
    return ctx, tap_layers


def check_mlp_bias(cfg: LlamaConfig, bias_lbtf: jax.Array, bt: tuple) -> jax.Array:
    """``mlp_bias_lbtf`` must be [L, B, T or 1, F] for this config and block; returned as is."""
    want = (cfg.n_layers, bt[0], cfg.ffn_dim)
    if bias_lbtf.ndim != 4 or (bias_lbtf.shape[0], bias_lbtf.shape[1], bias_lbtf.shape[3]) != want \
            or bias_lbtf.shape[2] not in (1, bt[1]):
        raise ValueError(f"mlp_bias_lbtf must be [L={cfg.n_layers}, B={bt[0]}, T={bt[1]} or 1, F={cfg.ffn_dim}]; "
                         f"got {tuple(bias_lbtf.shape)}")
    return bias_lbtf


# ----------------------------------------------------------------------------- modules


def rms_norm(x, scale, eps):
    """RMSNorm of ``x`` with its ``scale``: float32 statistics, the result in x's dtype. ``RMSNorm``'s
    math, for code that holds raw parameter trees (the MTP module, DFlash)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * xf).astype(x.dtype)


def linear(x, kernel, compute_dtype):
    """``x @ kernel`` ([..., in] x [in, out]) with both operands in ``compute_dtype``: a bias-free
    ``nn.Dense(dtype=compute_dtype)`` on a raw kernel."""
    return jnp.einsum("...i,io->...o", x.astype(compute_dtype), kernel.astype(compute_dtype))


class RMSNorm(nn.Module):
    eps: float = 1e-5
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps)


class PackableDense(nn.Dense):
    """``nn.Dense``, whose kernel may instead arrive packed for the CPU few-row matmul
    (``kernels.cpu_matmul.pack``: the decode loop's unrolled CPU path re-lays float32 weights once
    per target); then the product runs through that kernel. Same parameters, names and init."""

    @nn.compact
    def __call__(self, inputs):
        if not self.is_initializing() and self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")
            if cpu_matmul.is_packed(kernel):
                y = cpu_matmul.packed_matmul(inputs, kernel, self.features)
                if self.use_bias:
                    y = y + self.get_variable("params", "bias").astype(y.dtype)
                return y
        return super().__call__(inputs)


def _dense(features, cfg, name, use_bias=False, **kw):
    return PackableDense(
        features,
        use_bias=use_bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=nn.initializers.normal(0.02),
        name=name,
        **kw,
    )


def _rows(x):
    """Pin the batch dim of a [B, ...] activation of the target to batch-sharded rows, the other dims left
    to XLA, in the train step (``sharding.constrain_train_rows``; a no-op elsewhere). Without it XLA's
    propagation may gather the whole global batch onto every device where an FSDP-sharded table meets it
    (the embedding gather, the LM head): measured on 8×H100 at Llama-3.1-8B, MTP's step held
    f32[32768, 128256] logits of all 8 rows on every chip."""
    return shd.constrain_train_rows(x)


# Shared-parameter key of the LM head packed for the CPU decode path (models.unrolled.split_layers).
PACKED_LM_HEAD = "packed_lm_head"

# Products in the operands' own dtype, sums in float32: a bf16 LM head is read as bf16 (no
# resident f32 copy of a [V, d] matrix, no 2x traffic) and still yields float32 logits.
F32_ACCUMULATE = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)


class DecoderLayer(nn.Module):
    """One pre-norm Llama block. Scanned: carry = (x, taps), xs = this layer's index, cache, prefix."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, carry, xs, ctx):
        cfg = self.cfg
        x_btd, taps = carry
        layer_idx = xs["layer"]
        taps = tuple(
            jnp.where(layer_idx == ctx["tap_layers"][i], x_btd[:, : tp.shape[1]], tp) for i, tp in enumerate(taps)
        )
        b, t, _ = x_btd.shape
        h = RMSNorm(cfg.rms_eps, jnp.dtype(cfg.param_dtype), name="attn_norm")(x_btd)
        bias = cfg.attention_bias
        q = _dense(cfg.n_heads * cfg.head_dim, cfg, "q_proj", bias)(h).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = _dense(cfg.n_kv_heads * cfg.head_dim, cfg, "k_proj", bias)(h).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = _dense(cfg.n_kv_heads * cfg.head_dim, cfg, "v_proj", bias)(h).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim, one scale shared by all heads, before RoPE
            q = RMSNorm(cfg.rms_eps, jnp.dtype(cfg.param_dtype), name="q_norm")(q)
            k = RMSNorm(cfg.rms_eps, jnp.dtype(cfg.param_dtype), name="k_norm")(k)
        q = apply_rope(q, ctx["cos"], ctx["sin"])
        k = apply_rope(k, ctx["cos"], ctx["sin"])
        to = dataclasses.replace(ctx["attend"], k_cache=xs.get("k_cache"), v_cache=xs.get("v_cache"),
                                 k_prefix=xs.get("k_prefix"), v_prefix=xs.get("v_prefix"))
        attn = masked_attention(q, k, v, to, impl=cfg.attention_impl, flash_impl=cfg.flash_impl)
        x_btd = x_btd + _dense(cfg.d_model, cfg, "o_proj")(attn.reshape(b, t, -1))
        h = RMSNorm(cfg.rms_eps, jnp.dtype(cfg.param_dtype), name="mlp_norm")(x_btd)
        gate = _dense(cfg.ffn_dim, cfg, "gate_proj")(h)
        up = _dense(cfg.ffn_dim, cfg, "up_proj")(h)
        if "mlp_bias" in xs:  # SD² steering: W_s^l g added to the up projection (models.steering)
            up = up + xs["mlp_bias"].astype(up.dtype)
        x_btd = x_btd + _dense(cfg.d_model, cfg, "down_proj")(nn.silu(gate) * up)
        return (x_btd, taps), (k, v)


class Llama(nn.Module):
    cfg: LlamaConfig
    # Recompute each layer in the backward pass (``nn.remat`` inside the layer scan), keeping only
    # the layer inputs. For passes differentiated through the frozen layers: ConFu's contemplate
    # pass, whose K queries x S keys scores at every one of the L layers were otherwise kept for
    # the backward pass (~50 GiB at 32 rows x 2048 tokens, K = 256, SmolLM2). No effect on a
    # forward that nothing differentiates, and none on the parameter tree.
    remat_layers: bool = False

    def setup(self):
        cfg = self.cfg
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=nn.initializers.normal(0.02),
        )
        self.final_norm = RMSNorm(cfg.rms_eps, jnp.dtype(cfg.param_dtype))
        if not cfg.tie_embeddings:
            self.lm_head = _dense(cfg.vocab_size, cfg, "lm_head", dot_general=F32_ACCUMULATE)
        self.layers = nn.scan(
            nn.remat(DecoderLayer, prevent_cse=False) if self.remat_layers else DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=cfg.n_layers,
        )(cfg)

    def embed_tokens(self, tokens_bt):
        return _rows(self.embed(tokens_bt))

    def logits(self, hidden_btd):
        """Float32 logits from the LM head read in its own dtype (tied: the embedding matrix
        transposed). Tied and untied heads give the same precision: operands in the compute dtype,
        float32 accumulation (``preferred_element_type``), never an upcast copy of the weights."""
        hidden_btd = _rows(hidden_btd)
        packed = None if self.is_initializing() else self.variables.get("params", {}).get(PACKED_LM_HEAD)
        if packed is not None:  # the CPU decode path's packed copy (models.unrolled.split_layers)
            return cpu_matmul.packed_matmul(hidden_btd, packed, self.cfg.vocab_size)
        if self.cfg.tie_embeddings:
            w = self.embed.embedding
            return _rows(jnp.einsum("btd,vd->btv", hidden_btd.astype(jnp.dtype(self.cfg.dtype)),
                                    w.astype(jnp.dtype(self.cfg.dtype)), preferred_element_type=jnp.float32))
        return _rows(self.lm_head(hidden_btd).astype(jnp.float32))

    def __call__(
        self,
        tokens_bt: Optional[jax.Array],
        positions_bt: jax.Array,
        *,
        embeds_btd: Optional[jax.Array] = None,
        attend: Optional[AttendTo] = None,
        tap_layers: Sequence[int] = (),
        return_logits: bool = True,
        tap_rows: Optional[int] = None,
        mlp_bias_lbtf: Optional[jax.Array] = None,
    ) -> LlamaOutput:
        """Forward over a block of T tokens.

        ``embeds_btd`` (if given) replaces the token embeddings (ConFu contemplate tokens);
        ``attend`` (``kernels.attention_reference.AttendTo``, model level): the block mask (None: causal),
        the cache [L,B,Hkv,S,D] (or per-layer buffers) with its visible lengths [B] or [B,T] and optional
        first visible slot (packed training rows: the segment start), the prefix [L,P,Hkv,D] and which
        queries see it; None: a causal block alone.
        ``tap_rows`` (static): keep taps for the first rows only (ConFu verification: the nodes, not
        their contemplates, whose taps nothing reads); ``taps_btc`` is then [B, tap_rows, C].
        ``mlp_bias_lbtf`` [L,B,T or 1,F] (optional): added to every layer's up projection before the
        gate product, down(silu(gate x) * (up x + bias)) — SD²'s steering (``models.steering``);
        absent, the forward is unchanged.
        """
        cfg = self.cfg
        x = self.embed_tokens(tokens_bt) if embeds_btd is None else embeds_btd.astype(jnp.dtype(cfg.dtype))
        ctx, tap_layers = layer_context(cfg, x.shape[:2], positions_bt, attend, tap_layers)
        xs = {"layer": jnp.arange(cfg.n_layers)}
        if mlp_bias_lbtf is not None:
            xs["mlp_bias"] = check_mlp_bias(cfg, mlp_bias_lbtf, x.shape[:2])
        if attend is not None and attend.k_cache is not None:
            # the scan slices a stacked cache; per-layer buffers (kv_cache.init_cache) are stacked here
            xs["k_cache"], xs["v_cache"] = stacked(attend.k_cache), stacked(attend.v_cache)
        if attend is not None and attend.k_prefix is not None:
            xs["k_prefix"], xs["v_prefix"] = attend.k_prefix, attend.v_prefix
        tap_shape = x.shape if tap_rows is None else (x.shape[0], int(tap_rows)) + x.shape[2:]
        taps0 = tuple(jnp.zeros(tap_shape, x.dtype) for _ in tap_layers)
        (x, taps), (k_new, v_new) = self.layers((x, taps0), xs, ctx)
        hidden = self.final_norm(x)
        logits = self.logits(hidden) if return_logits else None
        taps_btc = jnp.concatenate(taps, axis=-1) if taps else None
        return LlamaOutput(logits, hidden, taps_btc, k_new, v_new)


def init_params(cfg: LlamaConfig, rng: jax.Array) -> dict:
    """Random parameters (tests, shape tracing); real ones come from ``confu_jax.weights``."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    return Llama(cfg).init(rng, tokens, jnp.arange(2)[None])["params"]


def param_shapes(cfg: LlamaConfig) -> dict:
    """Shape/dtype tree of the parameters, without allocating (``jax.eval_shape``)."""
    return jax.eval_shape(lambda r: init_params(cfg, r), jax.random.PRNGKey(0))
