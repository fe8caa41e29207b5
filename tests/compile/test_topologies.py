"""The compile lane, part 1: hardware that is not attached, compiled for by its own compiler from this CPU
host (``confu_jax.topology``: libtpu's XLA:TPU and the CUDA plugin's XLA:GPU for sm_90a, installed by
requirements-dev.txt). JAX names the devices (the reference for the peaks and memory tables); the decode
loops a user reaches — sharded and unsharded, float32 and bf16 weights — compile for a TPU topology and
an H100 with no CPU custom call in them, while the same program compiled for this host keeps it (the
check has teeth); the CLIs' "will it fit?" reports come from those compilers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from confu_jax.topology import use_compilers  # noqa: E402

use_compilers()  # .xla-compilers (README command 2) on the path
pytest.importorskip("libtpu", reason="the TPU compiler (requirements-compilers.txt in .xla-compilers)")
pytest.importorskip("jax_plugins.xla_cuda12", reason="the GPU compiler (requirements-compilers.txt in .xla-compilers)")

from confu_jax import topology as tp  # noqa: E402
from confu_jax.decode import tracing  # noqa: E402
from confu_jax.decode.drafting import HeadDrafter  # noqa: E402
from confu_jax.decode.plans import parse_plan  # noqa: E402
from confu_jax.devices import device_memory_bytes, device_peaks  # noqa: E402
from confu_jax.kernels import cpu_matmul  # noqa: E402
from confu_jax.models.presets import get_preset  # noqa: E402
from confu_jax.models.spec import HeadConfig, ModelSpec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30

# topology -> (devices, device_kind as JAX names it, peak HBM GB/s, memory per device)
NAMES = {
    "v5p:2x2x2": (8, "TPU v5", 2765.0, 95 * GIB),
    "v5e:2x4": (8, "TPU v5 lite", 819.0, 16 * GIB),
    "v6e:2x2": (4, "TPU v6 lite", 1640.0, 32 * GIB),
    "h100:8": (8, "NVIDIA H100 80GB HBM3", 3350.0, 84942979072),
    "h200:1": (1, "NVIDIA H200 141GB HBM3e", 4800.0, 151397597184),
}
TARGETS = ("v5e:2x2", "h100:1")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_device_kinds_as_jax_names_them_have_peaks_and_memory(name):
    n, kind, gbs, mem = NAMES[name]
    topo = tp.get_topology(name)
    assert (len(topo.devices), topo.device_kind) == (n, kind)
    assert device_peaks(topo.device_kind)[0] == gbs and device_peaks(topo.device_kind)[1] > 0
    assert device_memory_bytes(topo.device_kind) == mem == topo.device_memory_bytes
    assert topo.platform == ("gpu" if name.startswith("h") else "tpu")


def test_a_topology_the_compilers_do_not_know_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"v5p:2x2x2.*h100:N"):
        tp.get_topology("a100:8")
    with pytest.raises(RuntimeError, match="refused by its compiler"):
        tp.get_topology("v5x:2x2")
    with pytest.raises(ValueError, match="does not fit topology"):
        tp.get_topology("v6e:2x2").mesh(fsdp=8)


def _custom_calls(compiled) -> str:
    from launch.decode_cost import custom_calls

    return ",".join(custom_calls(compiled.as_text()))


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("dtype", ["float32"])
def test_decode_loops_compile_for_the_device_without_a_cpu_custom_call(name, dtype):
    """Sharded (a 4-way tensor / 1-device mesh) and unsharded, the AR and ConFu tree loops: the layers
    scanned and XLA's dots, as that hardware runs them, whatever this host would pick for itself.
    float32, the dtype the CPU packing takes (bf16 targets: test_family_decode_compile.py)."""
    topo = tp.get_topology(name)
    cfg = get_preset("tiny").replace(dtype=dtype, param_dtype=dtype)
    spec = ModelSpec(cfg, HeadConfig(variant="confu", draft_vocab_size=64))
    drafter = HeadDrafter(parse_plan("tree:2,2,1"))
    for mesh in (None, topo.mesh(tensor=len(topo.devices))):
        traced = tracing.trace_loops(spec, mesh, drafter, unroll_layers=None, device=topo.devices[0],
                                     max_new_tokens=8, max_len=64)
        for prog, compiled in tracing.compile_traced(traced, topo.platform).items():
            calls = _custom_calls(compiled)
            assert "confu" not in calls, (name, dtype, mesh, prog, calls)
            assert compiled.memory_analysis().argument_size_in_bytes > 0
            # ``donated`` and the layers' scan: the unrolled CPU form has one weight buffer per layer
            assert "while" in compiled.as_text()


@pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU few-row matmul is not built on this host")
def test_the_same_program_compiled_for_this_cpu_keeps_its_custom_call():
    """The control: without a topology the unsharded float32 AR loop is this host's, packed matmul and all."""
    import jax

    spec = ModelSpec(get_preset("tiny"), HeadConfig(variant="eagle3", draft_vocab_size=64))
    traced = tracing.trace_loops(spec, None, HeadDrafter(parse_plan("chain:3")), unroll_layers=None,
                                 device=jax.devices()[0], max_new_tokens=8, max_len=64)
    assert cpu_matmul.TARGET in _custom_calls(traced["ar"].lower().compile())


def _cli(*args, timeout=600, env_extra=None):
    env = dict(os.environ, PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name", TARGETS)
def test_top_k_is_the_compilers_own_top_k_not_a_sort(name):
    """``models.top_k`` of a rank-3 array compiles to the device's TopK custom call with no sort of the rows
    (docs/RESULTS.md, "top-k on the hardware's compilers"); ``lax.top_k`` at that rank is a full sort on XLA:TPU
    (the check has teeth there), the same custom call on XLA:GPU."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from confu_jax.models.top_k import top_k

    topo = tp.get_topology(name)
    x = jax.ShapeDtypeStruct((4, 16, 4096), jnp.float32, sharding=SingleDeviceSharding(topo.devices[0]))

    def compiled(f):
        text = jax.jit(f).lower(x).compile().as_text()
        sorts = re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? sort\(", text)  # each sort's (first) result
        return sorts, re.findall(r'custom_call_target="([^"]+)"', text)

    want = {"tpu": "TopK", "gpu": "__gpu$TopK"}[topo.platform]
    assert compiled(lambda a: top_k(a, 8)) == ([], [want])
    assert compiled(lambda a: jax.lax.top_k(a, 8)) == ((["f32[4,16,4096]"], []) if want == "TopK" else ([], [want]))


@pytest.mark.slow
def test_launch_train_answers_will_it_fit_for_a_tpu_pod_and_an_h100_node(tmp_path):
    """The issue's command at tiny shapes: no host-device count error, the JSON, one line on stdout;
    a batch too large for a v5e chip is reported as not fitting."""
    for name, platform, kind in (("v5p:2x2x2", "tpu", "TPU v5"), ("h100:8", "gpu", "NVIDIA H100 80GB HBM3")):
        out = tmp_path / f"{platform}.json"
        p = _cli("launch.train", "--config", "configs/eagle3.py", "--compile_only", f"--topology={name}",
                 "--config.model.source=abstract", "--config.model.preset=tiny", "--config.data.max_length=64",
                 "--config.data.global_batch_size=8", "--config.train.mesh.data=1", "--config.train.mesh.fsdp=8",
                 f"--out={out}")
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(out.read_text())
        assert (r["platform"], r["device_kind"], r["devices"], r["fits"]) == (platform, kind, 8, True)
        assert 0 < r["per_device_peak_bytes"] < r["device_memory_bytes"] == NAMES[name][3]
        assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and r["batch"]["tokens"] == [8, 64]
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("train_step: ") and lines[0].endswith(": fits"), p.stdout
    # the compiler's "no": 4096 rows of 4096 tokens on four 16 GiB chips (XLA:TPU refuses it at compile time)
    out = tmp_path / "big.json"
    p = _cli("launch.train", "--config", "configs/eagle3.py", "--compile_only", "--topology=v5e:2x2",
             "--config.model.source=abstract", "--config.model.preset=tiny", "--config.data.max_length=4096",
             "--config.data.global_batch_size=4096", "--config.train.mesh.data=1", "--config.train.mesh.fsdp=4",
             f"--out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fits"] is False and r["per_device_peak_bytes"] > 16 * GIB and "DOES NOT FIT" in p.stdout
    assert "RESOURCE_EXHAUSTED" in r["compile_error"]


@pytest.mark.slow
def test_an_untuned_gemm_tiling_is_one_line_that_says_how_to_compile_it(tmp_path):
    """XLA:GPU without a device (no autotuning) finds no valid default Triton tiling for a GEMM of
    P-EAGLE's 8B step at 16 rows of 4096 on 8 H100s: one line naming the GEMM and the XLA flag, and the
    same command with that flag compiles (its GEMMs through cuBLAS) and fits."""
    args = ("launch.train", "--config", "configs/smollm2_peagle.py", "--compile_only", "--topology=h100:8",
            "--config.model.source=abstract", "--config.model.preset=llama-3.1-8b", "--config.model.dtype=bfloat16",
            "--config.data.max_length=4096", "--config.data.global_batch_size=16", "--config.train.mesh.data=1",
            "--config.train.mesh.fsdp=8", f"--out={tmp_path / 'r.json'}")
    p = _cli(*args)
    if p.returncode == 0:
        pytest.skip("this XLA:GPU finds a default tiling for P-EAGLE's GEMMs: nothing to say")
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and err[-1].startswith("launch.train: XLA:GPU compiling without a device"), p.stderr[-2000:]
    assert f"XLA_FLAGS={tp.TRITON_GEMM_OFF}" in err[-1] and "f32[8192,1024]" in err[-1], err[-1]
    p = _cli(*args, env_extra={"XLA_FLAGS": tp.TRITON_GEMM_OFF})
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["fits"] is True and 16 * GIB < r["per_device_peak_bytes"] < r["device_memory_bytes"], r


@pytest.mark.slow
def test_decode_cost_compiles_smollm2_for_a_tpu_with_no_cpu_custom_call(tmp_path):
    out = tmp_path / "dc.json"
    p = _cli("launch.decode_cost", "--models", "smollm2-135m", "--topology", "v5e:2x2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["topology"]
    assert (r["platform"], r["device_kind"], r["plan"]) == ("tpu", "TPU v5 lite", "chain:3")
    progs = {row["program"]: row for row in r["programs"]}
    assert set(progs) == {"ar", "speculative"}
    for row in progs.values():
        assert row["dtype"] == "float32" and row["fits"] is True and row["per_device_peak_bytes"] > 135e6 * 4
        assert not any("confu" in c for c in row["custom_calls"]), row["custom_calls"]
    assert sum(ln.startswith("smollm2-135m ") for ln in p.stdout.splitlines()) == 2
