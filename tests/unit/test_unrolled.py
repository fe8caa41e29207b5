"""The layer-unrolled forward equals ``Llama.__call__`` on every input form it supports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.llama import Llama, init_params
from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.presets import get_preset
from confu_jax.models.unrolled import apply_unrolled, split_layers

CFG = get_preset("tiny")


@pytest.mark.slow
def test_unrolled_equals_scanned_forward():
    params = init_params(CFG, jax.random.PRNGKey(0))
    ks = jax.random.split(jax.random.PRNGKey(1), 8)
    b, t, s, p = 2, 5, 7, 3
    L, h, d = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim
    kw = dict(
        embeds_btd=jax.random.normal(ks[0], (b, t, CFG.d_model)),
        attend=AttendTo(mask=jax.random.bernoulli(ks[1], 0.6, (b, t, t)) | jnp.eye(t, dtype=bool),
                        k_cache=jax.random.normal(ks[2], (L, b, h, s, d)), v_cache=jax.random.normal(ks[3], (L, b, h, s, d)),
                        cache_len=jnp.asarray([4, 7]), k_prefix=jax.random.normal(ks[4], (L, p, h, d)),
                        v_prefix=jax.random.normal(ks[5], (L, p, h, d)),
                        prefix_visible=jax.random.bernoulli(ks[6], 0.5, (b, t))),
        tap_layers=CFG.default_taps,
    )
    cache_only = AttendTo(k_cache=kw["attend"].k_cache, v_cache=kw["attend"].v_cache, cache_len=kw["attend"].cache_len)
    tokens = jax.random.randint(ks[7], (b, t), 0, CFG.vocab_size)
    pos = jnp.asarray([[4, 5, 6, 7, 8], [7, 8, 9, 10, 11]])
    for extra in ({}, kw, {"attend": cache_only}):
        ref = Llama(CFG).apply({"params": params}, tokens, pos, **extra)
        got = jax.jit(lambda p: apply_unrolled(split_layers(p, CFG), CFG, tokens, pos, **extra))(params)
        for name in ref._fields:
            r, g = getattr(ref, name), getattr(got, name)
            if r is None:
                assert g is None, name
            else:
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-5, err_msg=name)


def test_split_layers_checks_depth():
    params = init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="stacks 8 layers; cfg.n_layers is 4"):
        split_layers(params, CFG.replace(n_layers=4))


def test_tap_rows_keeps_the_first_rows_taps_on_both_layouts():
    """``tap_rows=k``: the taps of the first k rows, equal to the full taps' first k rows (ConFu's
    verification keeps no contemplate taps); everything else unchanged."""
    params = init_params(CFG, jax.random.PRNGKey(0))
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.PRNGKey(3), (b, t), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    full = Llama(CFG).apply({"params": params}, tokens, pos, tap_layers=CFG.default_taps)
    for fwd in (lambda **kw: Llama(CFG).apply({"params": params}, tokens, pos, **kw),
                lambda **kw: apply_unrolled(split_layers(params, CFG), CFG, tokens, pos, **kw)):
        got = fwd(tap_layers=CFG.default_taps, tap_rows=4)
        assert got.taps_btc.shape == (b, 4, 3 * CFG.d_model)
        np.testing.assert_allclose(np.asarray(got.taps_btc), np.asarray(full.taps_btc[:, :4]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.hidden_btd), np.asarray(full.hidden_btd), atol=1e-5, rtol=1e-5)
