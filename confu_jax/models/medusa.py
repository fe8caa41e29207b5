"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"), as the reference FasterDecoding/Medusa defines them
(``medusa/model/medusa_model.py``: ``ResBlock``, ``MedusaModelABC.medusa_head``).

Why a separate family: a Medusa head reads nothing but the target's **last hidden state** h[t]
(after the final norm: what the target's LM head reads) and predicts several tokens ahead at once,
without seeing the tokens in between. Head k (0-based) at position t predicts x[t+k+2] (the target
itself predicts x[t+1]). So one round of drafting is K independent classifiers on one vector —
no draft KV cache, no recurrence — and a tree of top-k choices per head is Medusa's tree.

Head k = ``medusa_num_layers`` ResBlocks followed by an LM head::

    ResBlock(x) = x + SiLU(x W + b)          # nn.Linear(d, d) with bias, W initialised to zero
    logits_k    = ResBlock^L(h) W_lm,k       # nn.Linear(d, V, bias=False)

The reference zeroes W only (``torch.nn.init.zeros_(self.linear.weight)``); b keeps torch's default
``U(-1/sqrt(d), 1/sqrt(d))``, so an untrained block is x + SiLU(b), not exactly the identity — we do
the same. W_lm,k starts as the target's LM head (``init_medusa``). The reference builds the layers
as ``[ResBlock(d)] * medusa_num_layers``: the SAME module repeated, so with more than one layer its
layers share weights (one parameter set, saved under every layer index). We keep one parameter
set per layer (the evident intent; identical to the reference for the default and every published
head, ``medusa_num_layers = 1``); import reads each layer from its own keys, export writes each.

Parameters (one Flax module for all K heads, stacked, so a forward is L+1 batched matmuls)::

    {'resblocks': {'kernel': [K, L, d, d], 'bias': [K, L, d]},
     'lm_head':   {'kernel': [K, d, V]}}

Kernels are [in, out] (flax); the torch state dict's ``Linear.weight`` is [out, in]
(``weights`` conversion: ``to_reference_state_dict`` / ``from_reference_state_dict``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class MedusaConfig(NamedTuple):
    num_heads: int  # medusa_num_heads (K)
    num_layers: int  # medusa_num_layers (L: ResBlocks per head)
    d_model: int
    vocab_size: int


class MedusaHeads(nn.Module):
    """All K Medusa heads: ``__call__(h_xd) -> logits_kxv`` (float32), x = any leading axes."""

    num_heads: int
    num_layers: int
    d_model: int
    vocab_size: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        k, l, d = self.num_heads, self.num_layers, self.d_model
        bound = 1.0 / math.sqrt(d)
        self.resblocks_kernel = self.param("resblocks_kernel", nn.initializers.zeros, (k, l, d, d), self.param_dtype)
        self.resblocks_bias = self.param(
            "resblocks_bias", lambda key, s, dt: jax.random.uniform(key, s, dt, -bound, bound), (k, l, d),
            self.param_dtype)
        self.lm_head_kernel = self.param("lm_head_kernel", nn.initializers.normal(0.02),
                                         (k, d, self.vocab_size), self.param_dtype)

    def resblocks(self, h_xd: jax.Array) -> jax.Array:
        """[..., d] -> [K, ..., d]: each head's ResBlock stack on the same hidden state."""
        k, d = self.num_heads, self.d_model
        x_kxd = jnp.broadcast_to(h_xd.astype(jnp.float32), (k,) + h_xd.shape)
        lead = (1,) * (h_xd.ndim - 1)
        for i in range(self.num_layers):
            z = jnp.einsum("k...d,kde->k...e", x_kxd, self.resblocks_kernel[:, i].astype(jnp.float32))
            z = z + self.resblocks_bias[:, i].astype(jnp.float32).reshape((k,) + lead + (d,))
            x_kxd = x_kxd + jax.nn.silu(z)
        return x_kxd

    def __call__(self, h_xd: jax.Array) -> jax.Array:
        x_kxd = self.resblocks(h_xd)
        return jnp.einsum("k...d,kdv->k...v", x_kxd, self.lm_head_kernel.astype(jnp.float32))


def _tree(p: dict) -> dict:
    """Flat module params -> the documented nested layout (and back, ``_flat``)."""
    return {"resblocks": {"kernel": p["resblocks_kernel"], "bias": p["resblocks_bias"]},
            "lm_head": {"kernel": p["lm_head_kernel"]}}


def _flat(t: dict) -> dict:
    return {"resblocks_kernel": t["resblocks"]["kernel"], "resblocks_bias": t["resblocks"]["bias"],
            "lm_head_kernel": t["lm_head"]["kernel"]}


def config_of(params: dict) -> MedusaConfig:
    """The heads' shape from their parameters (nothing else is stored: K, L, d, V)."""
    try:
        k, l, d, _ = params["resblocks"]["kernel"].shape
        v = params["lm_head"]["kernel"].shape[-1]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError("Medusa params must be {'resblocks': {'kernel': [K,L,d,d], 'bias': [K,L,d]}, "
                         f"'lm_head': {{'kernel': [K,d,V]}}}}; got {jax.tree_util.tree_map(np.shape, params)}") from e
    return MedusaConfig(int(k), int(l), int(d), int(v))


def module_of(params: dict) -> MedusaHeads:
    c = config_of(params)
    return MedusaHeads(c.num_heads, c.num_layers, c.d_model, c.vocab_size)


def medusa_logits(params: dict, h_xd: jax.Array) -> jax.Array:
    """[K, ..., V] float32 logits of every head at final-normed target hidden states ``h_xd``."""
    return module_of(params).apply({"params": _flat(params)}, h_xd)


def init_medusa(rng: jax.Array, num_heads: int, num_layers: int, lm_head_vd_or_dv: jax.Array,
                vocab_axis: int, param_dtype=jnp.float32) -> dict:
    """Reference initialisation: ResBlock W = 0, b ~ U(±1/sqrt(d)); every head's LM head = the
    target's (``lm_head_vd_or_dv``: [V, d] tied embedding with ``vocab_axis=0``, or [d, V])."""
    if num_heads < 1 or num_layers < 0:
        raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0; got {num_heads}, {num_layers}")
    w_dv = lm_head_vd_or_dv.T if vocab_axis == 0 else lm_head_vd_or_dv
    d, v = w_dv.shape
    mod = MedusaHeads(num_heads, num_layers, d, v, param_dtype)
    p = mod.init(rng, jnp.zeros((1, d), jnp.float32))["params"]
    p = dict(p)
    p["lm_head_kernel"] = jnp.broadcast_to(jnp.asarray(w_dv, param_dtype)[None], (num_heads, d, v))
    return _tree(p)


# ----------------------------------------------------------------------------- reference format


def to_reference_state_dict(params: dict) -> dict:
    """numpy state dict of the reference ``medusa_head`` ModuleList: ``{k}.{i}.linear.weight``
    [d, d] (out, in), ``{k}.{i}.linear.bias`` [d], ``{k}.{L}.weight`` [V, d]."""
    c = config_of(params)
    kern = np.asarray(params["resblocks"]["kernel"])
    bias = np.asarray(params["resblocks"]["bias"])
    lm = np.asarray(params["lm_head"]["kernel"])
    out = {}
    for k in range(c.num_heads):
        for i in range(c.num_layers):
            out[f"{k}.{i}.linear.weight"] = np.ascontiguousarray(kern[k, i].T)
            out[f"{k}.{i}.linear.bias"] = np.ascontiguousarray(bias[k, i])
        out[f"{k}.{c.num_layers}.weight"] = np.ascontiguousarray(lm[k].T)
    return out


def from_reference_state_dict(sd: dict, num_heads: int, num_layers: int, dtype=np.float32) -> dict:
    """The inverse of ``to_reference_state_dict`` (arrays as numpy, converted to ``dtype``). Keys
    may carry the ``medusa_head.`` prefix of a full model's state dict. Missing or extra head keys
    are errors (the reference loads with ``strict=False``; a silently missing head drafts noise)."""
    sd = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in sd.items()}
    want = set()
    for k in range(num_heads):
        for i in range(num_layers):
            want |= {f"{k}.{i}.linear.weight", f"{k}.{i}.linear.bias"}
        want.add(f"{k}.{num_layers}.weight")
    missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or extra:
        raise ValueError(f"Medusa state dict for {num_heads} heads x {num_layers} layers: missing keys "
                         f"{missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected keys "
                         f"{extra[:6]}{'...' if len(extra) > 6 else ''}")
    a = lambda key: np.asarray(sd[key], dtype)  # noqa: E731
    lm = np.stack([a(f"{k}.{num_layers}.weight").T for k in range(num_heads)])
    d = lm.shape[1]
    kern = np.zeros((num_heads, num_layers, d, d), dtype)
    bias = np.zeros((num_heads, num_layers, d), dtype)
    for k in range(num_heads):
        for i in range(num_layers):
            kern[k, i] = a(f"{k}.{i}.linear.weight").T
            bias[k, i] = a(f"{k}.{i}.linear.bias")
    return {"resblocks": {"kernel": kern, "bias": bias}, "lm_head": {"kernel": lm}}
