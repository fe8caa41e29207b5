"""IBM's MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators", arXiv:2404.19124), as the reference defines it: IBM fms-extras
``fms_extras/models/speculator.py`` class ``MLPSpeculator`` (``forward``, ``generate_suffixes``,
``reset_parameters``), its Hugging Face wrapper ``fms_extras/models/hf/modeling_mlp_speculator.py``,
and vLLM's port ``vllm/model_executor/models/mlp_speculator.py`` (config:
``vllm/transformers_utils/configs/mlp_speculator.py``).

Why a separate family: like Medusa it reads only the target's **final-normed last hidden state**
h[p] (what the target's LM head reads), but its stages form a small RNN over the drafted tokens:
stage i reads the previous stage's state and the token the previous stage chose (stage 0: h[p]
and the bonus x[p+1]), so a node's distribution depends on its path — Medusa's heads never see the
tokens they stack on. Stage i (0-based) at position t predicts x[t+i+2] from h[t] and x[t+1..t+i+1].

Stage i (K = ``n_predict`` stages, d = ``emb_dim`` = the target's width, D = ``inner_dim``)::

    s_{-1}  = h                          (scale_input: ln0(h) / sqrt(2), ln0 without scale / shift)
    s_i     = GELU( LN_i( s_{i-1} P_i  +  (emb_weight / state_weight) · E_i[x_i] ) )
    logits_i = s_i W_i

    state_weight = 0.5 ** (0.5 / K)                      # the reference's "state_0 accounts for 50%"
    emb_weight   = sqrt((1 - state_weight**2) * (D / 2))
    LN(x)        = x · rsqrt(mean(x²) + 1e-6) · scale + bias   # fms LayerNormParameterized: NO mean
                                                               # subtraction (use_mean=False), eps 1e-6
    GELU         = the exact (erf) form, torch nn.GELU()'s default

P_0 is [d, D] (base width to inner width), P_1.. are [D, D]; E_i [V, D] embeddings, W_i [D, V] LM
heads without bias. ``tie_weights`` (the reference's option; fms-fsdp's training default) shares
E, LN and W across all stages and P across stages 1.. (P_0 has another shape and stays its own).

**Two parameter layouts.** The *stage* layout — what decoding reads, the published format maps to,
and ``config_of`` infers the shape from — stacks every stage (a tied model's shared weights
repeated K times, which is exactly the tied model's math)::

    {'proj_in': {'kernel': [d, D]},            # proj.0
     'proj':    {'kernel': [K-1, D, D]},       # proj.1 .. proj.{K-1}
     'emb':     {'embedding': [K, V, D]},      # emb.{i}
     'ln':      {'scale': [K, D], 'bias': [K, D]},   # ln.{i}.weight / ln.{i}.bias
     'lm_head': {'kernel': [K, D, V]},         # head.{i}
     'ln0':     {'scale': [d]}}                # only with scale_input: the constant 1/sqrt(2)

``ln0`` holds no reference parameter: the reference's ln0 has no elementwise scale and the forward
divides its output by sqrt(2), which is an RMS norm with a constant scale 1/sqrt(2); storing that
constant makes scale_input visible in the tree (``config_of``), so a decode-side tree alone says how
to run it. The *trainable* layout (``to_trainable``; what ``launch.train`` optimises and
checkpoints) is the stage layout without ``ln0``, and with ``tie_weights`` the shared weights once
(K → 1 for emb / ln / lm_head, proj [1, D, D]) so that a tied stage's gradient is the sum over the
stages, as in the reference; ``from_trainable`` broadcasts back.

Kernels are [in, out] (flax); the torch state dict's ``Linear.weight`` is [out, in]
(``to_reference_state_dict`` / ``from_reference_state_dict``; format I/O in
``weights.mlp_speculator_format``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

LN_EPS = 1e-6  # fms LayerNormParameterized / vLLM MLPSpeculatorLayerNorm default
INV_SQRT2 = 1.0 / math.sqrt(2.0)


class MLPSpeculatorConfig(NamedTuple):
    n_predict: int  # K: stages (tokens guessed ahead of the target's own next token)
    inner_dim: int  # D (the reference's 0 = emb_dim is resolved by ``make_config``)
    emb_dim: int  # d: the target's width
    vocab_size: int  # V: the target's vocabulary
    tie_weights: bool = False
    scale_input: bool = False

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight ** 2) * (self.inner_dim / 2))

    @property
    def emb_scale(self) -> float:
        """emb_weight / state_weight: the factor on E_i[x] in ``torch.add(state, z, alpha=...)``."""
        return self.emb_weight / self.state_weight


def make_config(n_predict: int, emb_dim: int, vocab_size: int, inner_dim: int = 0, tie_weights: bool = False,
                scale_input: bool = False) -> MLPSpeculatorConfig:
    """A checked config; ``inner_dim`` 0 means ``emb_dim`` (the reference's convention)."""
    if n_predict < 1 or emb_dim < 1 or vocab_size < 1 or inner_dim < 0:
        raise ValueError(f"MLP speculator needs n_predict, emb_dim, vocab_size >= 1 and inner_dim >= 0; got "
                         f"{n_predict}, {emb_dim}, {vocab_size}, {inner_dim}")
    if tie_weights and n_predict < 2:
        raise ValueError("MLP speculator tie_weights needs n_predict >= 2 (the reference asserts it: "
                         "'You cannot tie weights between stages when only 1 exists')")
    return MLPSpeculatorConfig(int(n_predict), int(inner_dim or emb_dim), int(emb_dim), int(vocab_size),
                               bool(tie_weights), bool(scale_input))


def rms_norm(x: jax.Array, eps: float = LN_EPS) -> jax.Array:
    """fms ``LayerNormParameterized`` without scale / shift (use_mean=False): x / sqrt(mean(x²) + eps)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class MLPSpeculator(nn.Module):
    """All K stages (stage layout). ``__call__(h_bnd, inds_bm)`` is the reference's training
    ``forward``: ``inds`` has N+K tokens, stage i reads ``inds[:, i:i+N]`` → [K, B, N, V] float32."""

    n_predict: int
    inner_dim: int
    emb_dim: int
    vocab_size: int
    scale_input: bool = False
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        k, dd, d, v = self.n_predict, self.inner_dim, self.emb_dim, self.vocab_size
        normal = nn.initializers.normal(1.0 / math.sqrt(dd))  # reset_parameters: N(0, 1/sqrt(inner_dim))
        self.proj_in_kernel = self.param("proj_in_kernel", normal, (d, dd), self.param_dtype)
        self.proj_kernel = self.param("proj_kernel", normal, (k - 1, dd, dd), self.param_dtype)
        self.emb_embedding = self.param("emb_embedding", normal, (k, v, dd), self.param_dtype)
        self.ln_scale = self.param("ln_scale", nn.initializers.ones, (k, dd), self.param_dtype)
        self.ln_bias = self.param("ln_bias", nn.initializers.zeros, (k, dd), self.param_dtype)
        self.lm_head_kernel = self.param("lm_head_kernel", normal, (k, dd, v), self.param_dtype)
        if self.scale_input:
            self.ln0_scale = self.param("ln0_scale", nn.initializers.constant(INV_SQRT2), (d,), self.param_dtype)

    @property
    def emb_scale(self) -> float:
        return MLPSpeculatorConfig(self.n_predict, self.inner_dim, self.emb_dim, self.vocab_size).emb_scale

    def input_state(self, h_xd: jax.Array) -> jax.Array:
        """s_{-1}: h, or with scale_input ln0(h) / sqrt(2) (float32)."""
        h = h_xd.astype(jnp.float32)
        if self.scale_input:
            h = rms_norm(h) * self.ln0_scale.astype(jnp.float32)
        return h

    def stage(self, i: int, state_xe: jax.Array, tokens_x: jax.Array) -> jax.Array:
        """s_i from s_{i-1} [..., d or D] and the tokens x_i [...] (``i`` static) -> [..., D]."""
        w = self.proj_in_kernel if i == 0 else self.proj_kernel[i - 1]
        z = jnp.take(self.emb_embedding[i], tokens_x, axis=0).astype(jnp.float32)
        s = state_xe.astype(jnp.float32) @ w.astype(jnp.float32) + self.emb_scale * z
        s = rms_norm(s) * self.ln_scale[i].astype(jnp.float32) + self.ln_bias[i].astype(jnp.float32)
        return jax.nn.gelu(s, approximate=False)

    def logits(self, i: int, state_xe: jax.Array) -> jax.Array:
        return state_xe @ self.lm_head_kernel[i].astype(jnp.float32)

    def __call__(self, h_bnd: jax.Array, inds_bm: jax.Array) -> jax.Array:
        n = h_bnd.shape[-2]
        if inds_bm.shape[-1] < n + self.n_predict:
            raise ValueError(f"MLP speculator forward: inds must hold N + n_predict = {n + self.n_predict} tokens "
                             f"per row (the reference's contract); got {inds_bm.shape[-1]}")
        s = self.input_state(h_bnd)
        out = []
        for i in range(self.n_predict):
            s = self.stage(i, s, inds_bm[..., i:i + n])
            out.append(self.logits(i, s))
        return jnp.stack(out)


_NAMES = (("proj_in", "kernel"), ("proj", "kernel"), ("emb", "embedding"), ("ln", "scale"), ("ln", "bias"),
          ("lm_head", "kernel"), ("ln0", "scale"))


def _tree(p: dict) -> dict:
    """Flat module params -> the documented nested layout (and back, ``_flat``)."""
    out: dict = {}
    for a, b in _NAMES:
        if f"{a}_{b}" in p:
            out.setdefault(a, {})[b] = p[f"{a}_{b}"]
    return out


def _flat(t: dict) -> dict:
    return {f"{a}_{b}": t[a][b] for a, b in _NAMES if a in t}


def config_of(params: dict) -> MLPSpeculatorConfig:
    """The stages' shape from stage-layout parameters (K, D, d, V; scale_input = an ``ln0`` entry).
    ``tie_weights`` is reported False: in this layout a tied model is its stages repeated."""
    try:
        k, v, dd = params["emb"]["embedding"].shape
        d = params["proj_in"]["kernel"].shape[0]
        shapes = {"proj_in": params["proj_in"]["kernel"].shape, "proj": params["proj"]["kernel"].shape,
                  "ln": params["ln"]["scale"].shape, "ln_bias": params["ln"]["bias"].shape,
                  "lm_head": params["lm_head"]["kernel"].shape}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError("MLP speculator params must be {'proj_in': {'kernel': [d,D]}, 'proj': {'kernel': [K-1,D,D]}, "
                         "'emb': {'embedding': [K,V,D]}, 'ln': {'scale','bias': [K,D]}, 'lm_head': {'kernel': [K,D,V]}"
                         f"}} (+ 'ln0': {{'scale': [d]}}); got {jax.tree_util.tree_map(np.shape, params)}") from e
    want = {"proj_in": (d, dd), "proj": (k - 1, dd, dd), "ln": (k, dd), "ln_bias": (k, dd), "lm_head": (k, dd, v)}
    bad = {n: (tuple(shapes[n]), w) for n, w in want.items() if tuple(shapes[n]) != w}
    if "ln0" in params and tuple(np.shape(params["ln0"]["scale"])) != (d,):
        bad["ln0"] = (tuple(np.shape(params["ln0"]["scale"])), (d,))
    if bad:
        raise ValueError(f"MLP speculator params with emb [K={k}, V={v}, D={dd}] and proj_in [d={d}, D]: "
                         f"inconsistent shapes (got, expected): {bad}")
    return MLPSpeculatorConfig(int(k), int(dd), int(d), int(v), False, "ln0" in params)


def module_of(params: dict) -> MLPSpeculator:
    c = config_of(params)
    return MLPSpeculator(c.n_predict, c.inner_dim, c.emb_dim, c.vocab_size, c.scale_input)


def _apply(params: dict, method, *args):
    return module_of(params).apply({"params": _flat(params)}, *args, method=method)


def mlp_speculator_logits(params: dict, h_bnd: jax.Array, inds_bm: jax.Array) -> jax.Array:
    """The reference's training ``forward``: [K, B, N, V] float32 logits of every stage, stage i
    reading ``inds[:, i:i+N]`` (N+K tokens per row; in training inds = x[1:], so stage i at t reads
    x[t+i+1] and predicts x[t+i+2])."""
    return _apply(params, MLPSpeculator.__call__, h_bnd, inds_bm)


def input_state(params: dict, h_xd: jax.Array) -> jax.Array:
    """s_{-1} of final-normed target hidden states ``h_xd`` (float32)."""
    return _apply(params, MLPSpeculator.input_state, h_xd)


def stage_state(params: dict, i: int, state_xe: jax.Array, tokens_x: jax.Array) -> jax.Array:
    """s_i = stage ``i`` (static) on the previous state and the previous stage's tokens."""
    return _apply(params, lambda m, s, t: m.stage(i, s, t), state_xe, tokens_x)


def stage_logits(params: dict, i: int, state_xe: jax.Array) -> jax.Array:
    """logits_i = s_i W_i (float32, the speculator's vocabulary)."""
    return _apply(params, lambda m, s: m.logits(i, s), state_xe)


def init_mlp_speculator(rng: jax.Array, config: MLPSpeculatorConfig, param_dtype=jnp.float32) -> dict:
    """Reference initialisation (``reset_parameters``): every embedding and linear weight
    ~ N(0, 1/sqrt(inner_dim)), LN scale 1 and shift 0 — in the stage layout; with ``tie_weights``
    stage 0's emb / ln / lm_head and stage 1's proj repeated over the stages (the tied module
    draws them once)."""
    c = config
    mod = MLPSpeculator(c.n_predict, c.inner_dim, c.emb_dim, c.vocab_size, c.scale_input, param_dtype)
    p = mod.init(rng, jnp.zeros((1, 1, c.emb_dim), jnp.float32), jnp.zeros((1, 1 + c.n_predict), jnp.int32))
    p = _tree(dict(p["params"]))
    if c.tie_weights:
        p = from_trainable(to_trainable(p, c), c)
    return p


def to_trainable(params: dict, config: MLPSpeculatorConfig) -> dict:
    """Stage layout -> what training optimises: no ``ln0`` (a constant); with ``tie_weights`` the shared
    weights once (stage 0's emb / ln / lm_head, stage 1's proj — the reference ties every stage to those)."""
    p = {k: dict(v) for k, v in params.items() if k != "ln0"}
    if config.tie_weights:
        for a, b in (("emb", "embedding"), ("ln", "scale"), ("ln", "bias"), ("lm_head", "kernel"),
                     ("proj", "kernel")):
            p[a][b] = p[a][b][:1]
    return p


def from_trainable(trainable: dict, config: MLPSpeculatorConfig) -> dict:
    """Trainable layout -> stage layout (tied weights broadcast to every stage; ``ln0`` added with
    ``scale_input``). Jittable: the broadcast is part of the forward, so a tied weight's gradient
    is the sum of its stages' gradients."""
    c = config
    p = {k: dict(v) for k, v in trainable.items()}
    if c.tie_weights:
        for a, b, n in (("emb", "embedding", c.n_predict), ("ln", "scale", c.n_predict), ("ln", "bias", c.n_predict),
                        ("lm_head", "kernel", c.n_predict), ("proj", "kernel", c.n_predict - 1)):
            x = p[a][b]
            if x.shape[0] != 1:
                raise ValueError(f"tied MLP speculator: {a}/{b} must hold one shared stage [1, ...]; got {x.shape}")
            p[a][b] = jnp.broadcast_to(x, (n,) + x.shape[1:])
    if c.scale_input:
        dt = p["proj_in"]["kernel"].dtype
        p["ln0"] = {"scale": jnp.full((c.emb_dim,), INV_SQRT2, dt)}
    return p


def trainable_shapes(config: MLPSpeculatorConfig, dtype=np.float32) -> dict:
    """ShapeDtypeStructs of the trainable layout (what a run's checkpoint holds)."""
    c = config
    k = 1 if c.tie_weights else c.n_predict
    kp = 1 if c.tie_weights else c.n_predict - 1
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return {"proj_in": {"kernel": s(c.emb_dim, c.inner_dim)}, "proj": {"kernel": s(kp, c.inner_dim, c.inner_dim)},
            "emb": {"embedding": s(k, c.vocab_size, c.inner_dim)},
            "ln": {"scale": s(k, c.inner_dim), "bias": s(k, c.inner_dim)},
            "lm_head": {"kernel": s(k, c.inner_dim, c.vocab_size)}}


# ----------------------------------------------------------------------------- reference format


def to_reference_state_dict(params: dict) -> dict:
    """numpy state dict of the reference ``MLPSpeculator`` (no ``speculator.`` prefix), every stage's
    keys (a tied module's ``state_dict()`` lists them all too)::

        emb.{i}.weight [V, D]   proj.{i}.weight [D, d or D] (out, in)   head.{i}.weight [V, D]
        ln.{i}.weight [D]       ln.{i}.bias [D]

    ``ln0`` has no parameters in the reference; a stage-layout ``ln0`` must be the constant 1/sqrt(2)."""
    c = config_of(params)
    if "ln0" in params:
        ln0 = np.asarray(params["ln0"]["scale"], np.float64)
        if not np.allclose(ln0, INV_SQRT2, rtol=1e-3, atol=0):
            raise ValueError("MLP speculator ln0/scale must be the constant 1/sqrt(2) (the reference's ln0 has no "
                             f"elementwise scale; its output is divided by sqrt(2)); got values in "
                             f"[{ln0.min():.6g}, {ln0.max():.6g}]")
    a = lambda x: np.ascontiguousarray(np.asarray(x))  # noqa: E731
    out = {}
    for i in range(c.n_predict):
        out[f"emb.{i}.weight"] = a(params["emb"]["embedding"][i])
        w = params["proj_in"]["kernel"] if i == 0 else params["proj"]["kernel"][i - 1]
        out[f"proj.{i}.weight"] = a(np.asarray(w).T)
        out[f"head.{i}.weight"] = a(np.asarray(params["lm_head"]["kernel"][i]).T)
        out[f"ln.{i}.weight"] = a(params["ln"]["scale"][i])
        out[f"ln.{i}.bias"] = a(params["ln"]["bias"][i])
    return out


def is_tied(params: dict) -> bool:
    """Whether stage-layout params are a tied model's (every stage's emb / ln / lm_head equal to
    stage 0's, every proj.i, i >= 1, equal to proj.1; K >= 2)."""
    k = params["emb"]["embedding"].shape[0]
    if k < 2:
        return False
    for a, b in (("emb", "embedding"), ("ln", "scale"), ("ln", "bias"), ("lm_head", "kernel"), ("proj", "kernel")):
        x = np.asarray(params[a][b])  # proj holds proj.1 .. proj.{K-1}
        if not all(np.array_equal(x[0], x[j]) for j in range(1, x.shape[0])):
            return False
    return True


def from_reference_state_dict(sd: dict, config: MLPSpeculatorConfig, dtype=np.float32) -> dict:
    """The stage layout of a reference state dict (keys may carry the Hugging Face wrapper's
    ``speculator.`` prefix). Untied: every stage's keys, no others. Tied: stage 0's emb / ln / head
    and proj.0, proj.1 are required (Hugging Face's safetensors save keeps one name per shared
    tensor); any other stage's key that is present must equal the shared one. Shapes are checked
    against ``config``; missing or unexpected keys are errors (a missing stage would draft noise)."""
    c = config
    sd = {k[len("speculator."):] if k.startswith("speculator.") else k: v for k, v in sd.items()}
    every = set()
    for i in range(c.n_predict):
        every |= {f"emb.{i}.weight", f"proj.{i}.weight", f"head.{i}.weight", f"ln.{i}.weight", f"ln.{i}.bias"}
    if c.tie_weights:
        need = {"emb.0.weight", "head.0.weight", "ln.0.weight", "ln.0.bias", "proj.0.weight", "proj.1.weight"}
    else:
        need = every
    missing, extra = sorted(need - set(sd)), sorted(set(sd) - every)
    if missing or extra:
        raise ValueError(f"MLP speculator state dict for n_predict={c.n_predict} (tie_weights={c.tie_weights}): "
                         f"missing keys {missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected keys "
                         f"{extra[:6]}{'...' if len(extra) > 6 else ''}")
    d, dd, v = c.emb_dim, c.inner_dim, c.vocab_size

    def get(name, shape):
        x = np.asarray(sd[name], dtype)
        if x.shape != shape:
            raise ValueError(f"MLP speculator tensor {name!r}: expected shape {shape} (emb_dim={d}, inner_dim={dd}, "
                             f"vocab_size={v}), got {x.shape}")
        return x

    def stage_key(kind: str, i: int) -> str:
        """The key stage i reads: its own, or with tie_weights the shared one (proj.1 for proj.i, i >= 1)."""
        if not c.tie_weights:
            return f"{kind}.{i}"
        return f"{kind}.{min(i, 1)}" if kind == "proj" else f"{kind}.0"

    def read(kind, suffix, i, shape):
        key = stage_key(kind, i) + suffix
        x = get(key, shape)
        own = f"{kind}.{i}{suffix}"
        if c.tie_weights and own != key and own in sd and not np.array_equal(get(own, shape), x):
            raise ValueError(f"MLP speculator with tie_weights: {own!r} differs from the shared {key!r}")
        return x

    k = c.n_predict
    p = {"proj_in": {"kernel": read("proj", ".weight", 0, (dd, d)).T.copy()},
         "proj": {"kernel": np.stack([read("proj", ".weight", i, (dd, dd)).T for i in range(1, k)])
                  if k > 1 else np.zeros((0, dd, dd), dtype)},
         "emb": {"embedding": np.stack([read("emb", ".weight", i, (v, dd)) for i in range(k)])},
         "ln": {"scale": np.stack([read("ln", ".weight", i, (dd,)) for i in range(k)]),
                "bias": np.stack([read("ln", ".bias", i, (dd,)) for i in range(k)])},
         "lm_head": {"kernel": np.stack([read("head", ".weight", i, (v, dd)).T for i in range(k)])}}
    if c.scale_input:
        p["ln0"] = {"scale": np.full((d,), INV_SQRT2, dtype)}
    return p


def reference_config_dict(params: dict, *, tie_weights: Optional[bool] = None, top_k_tokens_per_head=None,
                          n_candidates: int = 5) -> dict:
    """``config.json`` fields of the published format (fms-extras ``MLPSpeculatorConfig``, which vLLM's
    config class mirrors) for stage-layout ``params``. ``tie_weights`` None: detected (``is_tied``).
    ``top_k_tokens_per_head`` (one per stage; the reference asserts the length): default 5, 4, 3, ...
    (the reference's [5, 4, 3] for 3 stages), at least 1."""
    c = config_of(params)
    tied = is_tied(params) if tie_weights is None else bool(tie_weights)
    if tied and not is_tied(params):
        raise ValueError("tie_weights=True but the stages' weights differ: this is not a tied MLP speculator")
    topk = [max(1, 5 - i) for i in range(c.n_predict)] if top_k_tokens_per_head is None else list(top_k_tokens_per_head)
    if len(topk) != c.n_predict or min(topk) < 1:
        raise ValueError(f"top_k_tokens_per_head needs n_predict={c.n_predict} entries >= 1; got {topk}")
    return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
            "vocab_size": c.vocab_size, "emb_dim": c.emb_dim, "inner_dim": c.inner_dim, "n_predict": c.n_predict,
            "top_k_tokens_per_head": topk, "n_candidates": int(n_candidates), "tie_weights": tied,
            "scale_input": c.scale_input}
