"""Embedding MoE (ConFu §3.2): top-k routing, renormalisation, gradients; the static ablation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.moe import EmbeddingMoE, StaticEmbedding

N_EXPERT, D_IN, D_OUT = 8, 24, 16


def _moe(top_k):
    m = EmbeddingMoE(N_EXPERT, top_k, D_OUT, init_std=0.5)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 7, D_IN))
    return m, m.init(jax.random.PRNGKey(0), x)["params"], x


def _numpy_reference(params, x, top_k):
    logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64)
    logits += np.asarray(params["router"]["bias"], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1)[..., :top_k]
    w = np.take_along_axis(p, idx, -1)
    w /= w.sum(-1, keepdims=True)
    experts = np.asarray(params["experts_ed"], np.float64)
    return np.einsum("...k,...kd->...d", w, experts[idx]), idx


@pytest.mark.parametrize("top_k", [1, 2, 3, N_EXPERT])
def test_weights_sum_to_one_over_exactly_k_experts(top_k):
    m, params, x = _moe(top_k)
    w = np.asarray(m.apply({"params": params}, x, method=EmbeddingMoE.dense_weights))
    assert w.shape == (5, 7, N_EXPERT)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert ((w > 0).sum(-1) == top_k).all()
    out = m.apply({"params": params}, x)
    ref, idx = _numpy_reference(params, x, top_k)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    # the non-zero weights sit exactly on the k most probable experts
    chosen = np.zeros_like(w, bool)
    np.put_along_axis(chosen, idx, True, -1)
    assert ((w > 0) == chosen).all()


def test_full_top_k_is_the_softmax_mixture():
    m, params, x = _moe(N_EXPERT)
    logits = x @ params["router"]["kernel"] + params["router"]["bias"]
    mix = jax.nn.softmax(logits, -1) @ params["experts_ed"]
    np.testing.assert_allclose(np.asarray(m.apply({"params": params}, x)), np.asarray(mix), atol=1e-6)


def test_router_and_selected_experts_get_gradient():
    m, params, x = _moe(2)
    target = jax.random.normal(jax.random.PRNGKey(3), (5, 7, D_OUT))

    def loss(p):
        return jnp.sum((m.apply({"params": p}, x) - target) ** 2)

    g = jax.grad(loss)(params)
    assert float(jnp.abs(g["router"]["kernel"]).max()) > 1e-4
    assert float(jnp.abs(g["router"]["bias"]).max()) > 1e-4
    # experts never selected for any input receive exactly zero gradient
    w = np.asarray(m.apply({"params": params}, x, method=EmbeddingMoE.dense_weights))
    used = (w > 0).reshape(-1, N_EXPERT).any(0)
    gnorm = np.abs(np.asarray(g["experts_ed"])).sum(-1)
    assert (gnorm[used] > 0).all() and (gnorm[~used] == 0).all()


def test_top1_router_gets_no_gradient():
    """Documented limitation: with k=1 the renormalised weight is identically 1."""
    m, params, x = _moe(1)
    g = jax.grad(lambda p: jnp.sum(m.apply({"params": p}, x) ** 2))(params)
    assert float(jnp.abs(g["router"]["kernel"]).max()) == 0.0


def test_bad_top_k_raises():
    with pytest.raises(ValueError, match="top_k"):
        EmbeddingMoE(4, 5, D_OUT).init(jax.random.PRNGKey(0), jnp.zeros((1, D_IN)))


def test_static_embedding_ignores_input_and_trains():
    m = StaticEmbedding(D_OUT, init_std=1.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 4, D_IN))
    params = m.init(jax.random.PRNGKey(0), x)["params"]
    out = m.apply({"params": params}, x)
    assert out.shape == (3, 4, D_OUT)
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.asarray(params["embedding_d"]), out.shape))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(m.apply({"params": params}, 2 * x)))
    g = jax.grad(lambda p: jnp.sum(m.apply({"params": p}, x)))(params)
    np.testing.assert_allclose(np.asarray(g["embedding_d"]), 12.0)
