"""Throughput in the training log (``train.throughput``): the FLOP count behind MFU, the peak table,
tokens/s and real tokens/s in metrics.csv, and a profiler trace of chosen steps."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from confu_jax.train.throughput import device_peak_flops, matmul_flops, parse_profile_steps
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flops_equal_xla_on_a_loop_free_program():
    """Matrix products only, no loop: the jaxpr count equals XLA's cost analysis exactly."""
    def f(x, w1, w2):
        return jnp.einsum("bsd,df->bsf", x, w1) @ w2

    args = (jnp.ones((2, 64, 96)), jnp.ones((96, 128)), jnp.ones((128, 48)))
    xla = jax.jit(f).lower(*args).compile().cost_analysis()["flops"]
    assert matmul_flops(f, *args) == xla == 2 * 2 * 64 * 96 * 128 + 2 * 2 * 64 * 128 * 48


def test_a_scan_counts_its_body_once_per_iteration_where_xla_counts_it_once():
    """Why the count is not XLA's: a scan of 10 matmuls is 10 of them here, 1 in XLA's cost analysis
    (a scanned target's layers would otherwise look L times cheaper)."""
    def f(w, x):
        return jax.lax.scan(lambda x, w1: (x @ w1, None), x, w)[0]

    w, x = jnp.ones((10, 32, 32)), jnp.ones((8, 32))
    one = 2 * 8 * 32 * 32
    assert matmul_flops(f, w, x) == 10 * one
    assert jax.jit(f).lower(w, x).compile().cost_analysis()["flops"] < 2 * one
    # gradients: the backward pass's two products per forward product are counted too
    g = jax.grad(lambda w, x: jnp.sum(f(w, x)))
    assert matmul_flops(g, w, x) == 3 * 10 * one


def test_peak_table_and_unknown_devices():
    kind = lambda k: types.SimpleNamespace(device_kind=k)
    assert device_peak_flops(kind("NVIDIA H100 80GB HBM3")) == 989e12
    assert device_peak_flops(kind("NVIDIA H100 PCIe")) == 756e12
    assert device_peak_flops(kind("NVIDIA H200")) == 989e12
    assert device_peak_flops(kind("TPU v5 lite")) == 197e12
    assert device_peak_flops(kind("cpu")) is None


def test_profile_steps_parsing():
    assert parse_profile_steps("") is None and parse_profile_steps("3:5") == (3, 5)
    for bad in ("5", "5:3", "0:2", "a:b"):
        with pytest.raises(ValueError, match="train.profile_steps"):
            parse_profile_steps(bad)


@pytest.mark.slow
def test_training_log_has_throughput_and_a_profiler_trace(tmp_path):
    """A tiny run: throughput.csv carries tokens/s and real tokens/s at every log step (real <= all: the
    rows are padded; the first interval starts after the compiling step), metrics.csv the real tokens
    of the logged step and nothing wall-clock (it stays exactly reproducible), the log line says MFU
    n/a on a CPU, and steps 3-4 leave a trace under <workdir>/profile."""
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "launch.train", "--config", os.path.join(REPO, "configs", "tiny.py"),
                        "--workdir", str(tmp_path), "--config.train.steps=8", "--config.train.log_every=4",
                        "--config.train.eval_every=0", "--config.train.profile_steps=3:4",
                        "--config.train.progress_bar=False"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [4, 8]
    for r in rows:
        tps, real = float(r["throughput/tokens_per_s"]), float(r["throughput/real_tokens_per_s"])
        assert tps > 0 and 0 < real <= tps
        assert "throughput/mfu" not in r
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(0 < float(r["tokens/real"]) <= 8 * 32 for r in rows)
    assert not any(k.startswith("throughput/") for k in rows[0])
    assert "tokens/s" in p.stderr and "MFU n/a" in p.stderr and "matmul FLOPs" in p.stderr
    assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
