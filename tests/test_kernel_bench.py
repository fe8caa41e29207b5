"""launch.kernel_bench: the harness runs on CPU (interpret mode) and its figures are consistent."""

from __future__ import annotations

import pytest

from launch import kernel_bench as kb


def test_device_peaks_from_device_kind():
    assert kb.device_peaks("NVIDIA H100 80GB HBM3") == (3350.0, 989.0)  # SXM5
    assert kb.device_peaks("NVIDIA H100 PCIe") == (2000.0, 756.0)
    assert kb.device_peaks("NVIDIA H200") == (4800.0, 989.0)
    assert kb.device_peaks("cpu") == (None, None)


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
    """At 8B heads (G = 4, d = 128): 240 rows per KV head are one row group (cache read once, no
    reloads); 480 rows are two (one L2 reload of the same slots). Everything else the kernel moves
    is on top of the minimum, never below it."""
    from confu_jax.models.presets import get_preset

    cfg = get_preset("llama-3.1-8b")
    s, p = 4096, 16
    for t2, groups in ((60, 1), (120, 2)):
        need = kb.bytes_moved(1, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s, p, 2)
        got = kb.kernel_bytes(1, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s, p, 2)
        assert got["plan"].n_groups == groups
        assert got["cache_hbm"] == 2 * s * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, once
        assert got["cache_l2"] == (groups - 1) * got["cache_hbm"]
        n_j = got["plan"].k_splits + 1
        assert got["partials"] == cfg.n_kv_heads * n_j * got["plan"].m_pad * (cfg.head_dim * 2 + 4)
        assert need < got["total_hbm"] == sum(v for k, v in got.items() if k not in ("cache_l2", "total_hbm", "plan"))
    rows = kb.bytes_table("llama-3.1-8b", [1024], [30], 1, p, "", {})
    assert [(r["queries"], r["row_groups"]) for r in rows] == [(30, 1), (60, 1)]
