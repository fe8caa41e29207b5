"""Embedding mixture-of-experts: ConFu's dynamic [con] and [f] tokens (paper §3.2).

A fixed instruction embedding cannot suit every context ("my next equation is:" vs "this paragraph
is about:"), so ConFu keeps ``n_expert`` learnable embeddings and lets a linear router, reading the
hidden state of the last accepted token, mix the top-k of them. MoE_con reads the target's h_cat
(3d) and feeds the target; MoE_f reads the draft feature g (d) and feeds the draft. The "-MoE"
ablation replaces either with one static learned embedding (``StaticEmbedding``).

Routing is computed in float32 whatever the parameter dtype: the top-k choice must not flip with
bf16 rounding between training and inference.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class EmbeddingMoE(nn.Module):
    """``out = Σ_{e ∈ top-k} w_e · expert_e`` with ``w`` the router softmax renormalised over top-k.

    With ``top_k == 1`` the single weight is always exactly 1 and the router receives no gradient
    (the selection is piecewise constant); use ``top_k >= 2`` to train the router.
    """

    n_expert: int
    top_k: int
    d_out: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"EmbeddingMoE: top_k must be in [1, n_expert={self.n_expert}], got {self.top_k}")
        self.experts_ed = self.param(
            "experts_ed", nn.initializers.normal(self.init_std), (self.n_expert, self.d_out), self.param_dtype
        )
        self.router = nn.Dense(
            self.n_expert,
            use_bias=True,  # torch.nn.Linear's default, as the paper's "linear layer"
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(self.init_std),
            name="router",
        )

    def route(self, x_nc: jax.Array):
        """Top-k expert indices [..., k] and their renormalised weights [..., k] (float32).

        softmax-then-renormalise over the top k equals a softmax over the top-k logits; the latter
        is computed (no division by a small sum of probabilities).
        """
        logits = self.router(x_nc.astype(jnp.float32))
        top_l, top_i = jax.lax.top_k(logits, self.top_k)
        return top_i, jax.nn.softmax(top_l, axis=-1)

    def dense_weights(self, x_nc: jax.Array) -> jax.Array:
        """Routing weights scattered to all experts [..., n_expert]: exactly k non-zeros summing to 1."""
        top_i, w = self.route(x_nc)
        return jnp.sum(jax.nn.one_hot(top_i, self.n_expert, dtype=jnp.float32) * w[..., None], axis=-2)

    def __call__(self, x_nc: jax.Array) -> jax.Array:
        top_i, w = self.route(x_nc)
        chosen = jnp.take(self.experts_ed, top_i, axis=0).astype(jnp.float32)  # [..., k, D]
        return jnp.einsum("...k,...kd->...d", w, chosen).astype(self.dtype)


class StaticEmbedding(nn.Module):
    """The "-MoE" ablation: one learned embedding, whatever the input (kept only for its shape)."""

    d_out: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_nc: jax.Array) -> jax.Array:
        emb = self.param("embedding_d", nn.initializers.normal(self.init_std), (self.d_out,), self.param_dtype)
        return jnp.broadcast_to(emb.astype(self.dtype), x_nc.shape[:-1] + (self.d_out,))


def make_token_embedder(use_moe: bool, n_expert: int, top_k: int, d_out: int, init_std: float,
                        dtype: Any, param_dtype: Any, name: str | None = None) -> nn.Module:
    """MoE or static embedding by variant: the one switch both [con] and [f] go through."""
    if use_moe:
        return EmbeddingMoE(n_expert, top_k, d_out, init_std, dtype, param_dtype, name=name)
    return StaticEmbedding(d_out, init_std, dtype, param_dtype, name=name)
