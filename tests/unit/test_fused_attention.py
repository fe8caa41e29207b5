"""The fused training-attention kernels (``kernels.fused_attention``: JAX's Pallas flash attention for
GPU, splash attention for TPU), run under Pallas' interpreter on CPU, against the XLA flash form
(``kernels.flash_attention``, itself checked against the dense definition in test_flash_attention.py):
values and the gradients of queries, keys and values, with GQA, packed rows whose segment 0 is padding,
and a row length that is not a multiple of the kernels' block; the target's training forward with
``model.flash_impl`` set equals the XLA one; the setting is checked against the backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.kernels.flash_attention import flash_attention
from confu_jax.kernels.fused_attention import fused_causal_attention, resolve_flash_impl

IMPLS = ["pallas_interpret", "splash_interpret"]


def _inputs(b=2, t=150, hq=4, hkv=2, d=16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k, v = (jax.random.normal(key, (b, t, hkv, d)) for key in ks[1:])
    # row 0: two conversations then padding (segment 0); row 1: one conversation filling the row
    seg = np.zeros((b, t), np.int32)
    seg[0, :60], seg[0, 60:131], seg[1] = 1, 2, 5
    return q, k, v, jnp.asarray(seg)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one_segment"])
def test_fused_equals_the_xla_form_in_value_and_gradient(impl, packed):
    q, k, v, seg = _inputs()
    seg = seg if packed else None
    w = jax.random.normal(jax.random.PRNGKey(7), q.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    def xla(q, k, v):
        return flash_attention(q, k, v, segment_ids_bt=seg)

    def fused(q, k, v):
        return fused_causal_attention(q, k, v, segment_ids_bt=seg, impl=impl)

    np.testing.assert_allclose(fused(q, k, v), xla(q, k, v), atol=2e-5, rtol=2e-5)
    g_xla = jax.grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2))(q, k, v)
    g_fused = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_fused, g_xla):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_target_training_forward_with_the_kernel_equals_the_xla_one(impl):
    from confu_jax.models.presets import get_preset
    from confu_jax.models.spec import ModelSpec
    from confu_jax.models.target import real_forward
    from tests.helpers.model_fakes import random_target

    cfg, tp = random_target(64, seed=2)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 40), 0, 64)
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 2, axis=0), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(25), np.arange(15)])[None].repeat(2, 0), jnp.int32)
    outs = []
    for flash in ("xla", impl):
        spec = ModelSpec(cfg.replace(flash_impl=flash), tap_layers=(0,))
        out = real_forward(spec, tp, tokens, pos, segment_ids_bt=seg)
        outs.append(out)
    np.testing.assert_allclose(outs[1].logits_btv, outs[0].logits_btv, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(outs[1].taps_btc, outs[0].taps_btc, atol=1e-4, rtol=1e-4)
    assert get_preset("tiny").flash_impl == "xla"


def test_the_setting_is_checked_against_the_backend():
    assert resolve_flash_impl("xla", "cpu") == "xla"
    assert resolve_flash_impl("splash_interpret", "cpu") == "splash_interpret"
    assert resolve_flash_impl("pallas", "gpu") == "pallas" and resolve_flash_impl("splash", "tpu") == "splash"
    with pytest.raises(ValueError, match="needs a GPU backend"):
        resolve_flash_impl("pallas", "cpu")
    with pytest.raises(ValueError, match="needs a TPU backend"):
        resolve_flash_impl("splash", "gpu")
    with pytest.raises(ValueError, match="flash_impl must be one of"):
        resolve_flash_impl("cudnn", "gpu")
    from configs.tiny import get_config
    from confu_jax.models.spec import model_spec_from_config

    c = get_config("eagle3")
    c.model.flash_impl = "splash_interpret"
    assert model_spec_from_config(c).target.flash_impl == "splash_interpret"
