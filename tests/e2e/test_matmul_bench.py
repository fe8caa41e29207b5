"""launch.matmul_bench: its three formulations compute the same chain, and its floors are consistent."""

import numpy as np

from confu_jax.models.presets import get_preset
from launch import matmul_bench as mb


def test_formulations_agree_and_floors_follow_the_shapes():
    cfg = get_preset("tiny")
    res = mb.measure(cfg, [1, 3], n_layers=2, repeats=1, rounds=1)  # asserts xla == numpy inside
    shapes = mb.layer_shapes(cfg)
    n_params = 2 * sum(i * o for i, o in shapes.values()) + cfg.vocab_size * cfg.d_model
    assert res["weights_mib"] * 2 ** 20 == 4 * n_params
    r1, r3 = res["rows"]
    assert abs(r3["compute_floor_ms"] - 3 * r1["compute_floor_ms"]) < 1e-9
    assert r1["memory_floor_ms"] == r3["memory_floor_ms"]
    for r in res["rows"]:
        for name in ("xla [in,out]", "xla [out,in]", "numpy"):
            floor = max(r["memory_floor_ms"], r["compute_floor_ms"])
            assert abs(r[f"{name} / floor"] - r[f"{name} ms"] / floor) < 1e-9


def test_chain_jax_matches_numpy_in_both_layouts():
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    cfg = get_preset("tiny")
    layers = [{k: rng.standard_normal(s, np.float32) / np.sqrt(s[0]) for k, s in mb.layer_shapes(cfg).items()}]
    lm = rng.standard_normal((cfg.vocab_size, cfg.d_model), np.float32)
    x = rng.standard_normal((2, cfg.d_model), np.float32)
    ref = mb.chain_numpy(x, layers, lm)
    io = mb.chain_jax(jnp.asarray(x), [{k: jnp.asarray(v) for k, v in w.items()} for w in layers], jnp.asarray(lm), False)
    oi = mb.chain_jax(jnp.asarray(x), [{k: jnp.asarray(v.T) for k, v in w.items()} for w in layers], jnp.asarray(lm),
                      True)
    np.testing.assert_allclose(np.asarray(io), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(oi), ref, rtol=1e-4, atol=1e-4)
