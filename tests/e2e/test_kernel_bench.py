"""launch.kernel_bench (``bench.kernel_cost``): the harness runs on CPU (interpret mode) and its figures are
consistent; the device peak table (``confu_jax.devices``) is the one the training MFU reads."""

from __future__ import annotations

import dataclasses

import pytest

from confu_jax.bench import kernel_cost as kb
from confu_jax.train.throughput import device_peak_flops


def test_device_peaks_from_device_kind():
    assert kb.device_peaks("NVIDIA H100 80GB HBM3") == (3350.0, 989.0)  # SXM5
    assert kb.device_peaks("NVIDIA H100 PCIe") == (2000.0, 756.0)
    assert kb.device_peaks("NVIDIA H200") == (4800.0, 989.0)
    assert kb.device_peaks("cpu") == (None, None)
    assert kb.device_peaks("NVIDIA GH200 480GB") == (4000.0, 989.0) and kb.device_peaks("TPU v5 lite")[1] == 197.0

    class Dev:
        device_kind = "NVIDIA H100 PCIe"

    assert device_peak_flops(Dev()) == 756e12


def test_bytes_and_flops_model():
    # Llama-3.1-8B heads, S=4096, T=30, s=16, bf16: the K/V cache read is 2*4096*8*128*2 bytes.
    b, t2, hq, hkv, d, s, p = 1, 60, 32, 8, 128, 4096, 16
    cache = 2 * s * hkv * d * 2
    n = kb.bytes_moved(b, t2, hq, hkv, d, s, p, 2)
    assert n == cache + 2 * t2 * hkv * d * 2 + 2 * t2 * hq * d * 2 + 2 * p * hkv * d * 2 + t2 * t2 + t2
    assert cache / n > 0.9  # the cache dominates, as the kernel design assumes
    assert kb.flops(b, t2, hq, d, s, p) == 4 * hq * t2 * (s + p + t2) * d


def test_harness_runs_on_cpu_with_interpreted_kernel(capsys):
    rows = kb.run("tiny", seq_lens=[40], tree_sizes=[3], batch=2, soft_prompts=2, dtype_name="",
                  impl_names=["pallas", "xla", "dense"], warmup=0, iters=1, repeats=1,
                  tiling=dict(block_k=16, k_splits=2), interpret=True)
    assert [r["impl"] for r in rows] == ["pallas", "xla", "dense"]
    for r in rows:
        assert r["max_abs_err"] < 1e-5  # every implementation agrees with the XLA path
        assert r["us"] > 0
        # Bandwidth is bytes / time with the documented bytes model.
        assert r["gbps"] * r["us"] * 1e3 == pytest.approx(kb.bytes_moved(2, 6, 4, 2, 16, 40, 2, 4))
    assert "max|err|" in capsys.readouterr().out


def test_bytes_model_counts_the_cache_once_and_the_reloads_apart():
    """At 8B heads (G = 4, d = 128): 120 rows per KV head are one row group (cache read once, no
    reloads); 240 rows are two (one L2 reload of the same slots), 480 four. Everything else the
    kernel moves is on top of the minimum, never below it."""
    from confu_jax.models.presets import get_preset

    cfg = get_preset("llama-3.1-8b")
    s, p = 4096, 16
    for t2, groups in ((30, 1), (60, 2), (120, 4)):
        need = kb.bytes_moved(1, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s, p, 2)
        got = kb.kernel_bytes(1, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s, p, 2)
        assert got["plan"].n_groups == groups
        assert got["cache_hbm"] == 2 * s * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, once
        assert got["cache_l2"] == (groups - 1) * got["cache_hbm"]
        n_j = got["plan"].k_splits + 1
        assert got["partials"] == cfg.n_kv_heads * n_j * got["plan"].m_pad * (cfg.head_dim * 2 + 4)
        assert need < got["total_hbm"] == sum(v for k, v in got.items() if k not in (
            "cache_l2", "total_hbm", "plan", "cache_tile_loads", "tree_tile_loads"))
    rows = kb.bytes_table("llama-3.1-8b", [1024], [30], 1, p, "", {})
    assert [(r["queries"], r["row_groups"]) for r in rows] == [(30, 1), (60, 2)]


@pytest.mark.parametrize("tiling", [dict(block_k=16, k_splits=2, block_m=16, block_kt=16),
                                    dict(block_k=16, k_splits=3, block_m=16, group_rows=32, block_kt=16)],
                         ids=["one_row_group", "two_row_groups"])
def test_bytes_model_counts_the_tiles_the_kernel_loads(tiling):
    """The interpreted kernel counts the K/V tiles each program loads; per (batch row, KV head)
    their sum is the model's count for that row's valid length (ragged rows, a length-0 row, splits
    past the length, one and two row groups)."""
    import jax.numpy as jnp
    import numpy as np

    from confu_jax.kernels import tree_attention as ta
    from tests.helpers.attention_cases import CASES, make_inputs

    c = CASES[5]  # 20 queries x G 3 = 60 rows per KV head, cache of 48 slots, 4 soft prompts
    for lens in ((48, 17), (0, 30)):
        q, kb_, vb, to = make_inputs(c)
        to = dataclasses.replace(to, cache_len=jnp.asarray(lens, jnp.int32))
        _, tiles = ta.masked_attention_pallas(q, kb_, vb, to, interpret=True, count_tiles=True, **tiling)
        tiles = np.asarray(tiles)  # [B, Hkv, J, 2]
        for b, n in enumerate(lens):
            model = kb.kernel_bytes(1, c.t, c.hq, c.hkv, c.d, n, c.p, 4, s_capacity=c.s, **tiling)
            assert tiles.shape[2] == model["plan"].k_splits + 1
            for h in range(c.hkv):
                assert tiles[b, h, :, 0].sum() == model["cache_tile_loads"], (lens, b, h)
                assert tiles[b, h, :, 1].sum() == model["tree_tile_loads"]
