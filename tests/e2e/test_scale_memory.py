"""``launch.train --compile_only --config.model.source=abstract``: "does it fit?" with nothing downloaded.

The abstract target has the checkpoint's (or preset's) shapes and dtypes but no weights, and the
batch has the configured shape but no data; the compiled train step must be *the* step a real run
compiles (same memory, to the byte), per-device memory must fall as the same rows spread over more
devices, and the 8B shapes of the scale table must compile under the goal in a reduced form here
(few layers, shorter rows) within the suite's time. The full table: experiments/scale_memory.py,
docs/RESULTS.md "Does an 8B target fit?".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from confu_jax.train.loop import compile_report
from confu_jax import sharding as shd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(variant: str, source: str, **over):
    from configs.common import base_config

    c = base_config("tiny", variant)
    with c.unlocked():
        c.model.source = source
        c.data.max_length = over.pop("rows", 64)
        c.data.global_batch_size = over.pop("batch", 8)
        c.objective.k_train = 8
        for k, v in over.items():
            node = c
            *path, last = k.split(".")
            for p in path:
                node = node[p]
            node[last] = v
    return c


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["confu"])  # the target and batch sides are every head's; ConFu's adds a head's
def test_the_abstract_step_is_the_real_step(variant):
    """Same shapes, same program: an abstract target (no weights, a shape-only batch) compiles to a
    step whose buffer assignment equals, byte for byte, the step compiled with real random weights
    and self-distilled data — so its figure is the figure a real run would get."""
    mesh = shd.make_mesh(1, 4, 2)
    real = compile_report(_config(variant, "random"), mesh=mesh)
    abstract = compile_report(_config(variant, "abstract"), mesh=mesh)
    assert abstract["memory_per_device"] == real["memory_per_device"]
    assert abstract["batch"] == real["batch"] == {k: [8, 64] for k in ("tokens", "loss_mask", "attention_mask")}
    assert abstract["trainable_params"] == real["trainable_params"]


@pytest.mark.slow
def test_per_device_memory_falls_as_devices_grow():
    """The same 8 rows over 2, 4 and 8 FSDP devices: every device holds less (parameters, optimizer
    state and activations all split over the data-parallel axis)."""
    peaks = []
    for n in (2, 4, 8):
        mesh = shd.make_mesh(1, n, 1, devices=jax.devices()[:n])
        rep = compile_report(_config("eagle3", "abstract", rows=128), mesh=mesh)
        peaks.append(rep["memory_per_device"]["peak_estimate"])
    assert peaks[0] > peaks[1] > peaks[2], peaks


def _cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.train", *args, "--config.train.progress_bar=False"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3"])  # the CLI path is every head's; ConFu's step: tests/compile
def test_an_8b_shape_compiles_from_its_config_json_alone(tmp_path, variant):
    """The reduced 8B check: Llama-3.1-8B's widths (d 4096, 32 heads / 8 KV, MLP 14336, vocabulary
    128256, draft vocabulary 32000) with 4 layers, rows of 1024, one row on each of 8 fake devices,
    sized from a config.json alone (no weights in the directory); the report names the mesh and the
    batch and stays far under 80 GiB per device."""
    from confu_jax.models.presets import get_preset
    from confu_jax.weights.export import hf_config_dict

    cfg = get_preset("llama-3.1-8b").replace(n_layers=4)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config_dict(cfg), f)
    work = tmp_path / "run"
    p = _cli("--config", os.path.join(REPO, "configs", f"{variant}.py"), "--workdir", str(work), "--compile_only",
             f"--config.model.source=abstract:{tmp_path / 'config.json'}", "--config.data.max_length=1024",
             "--config.data.global_batch_size=8", "--config.train.mesh.fsdp=8", "--config.train.mesh.data=1")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((work / "train_step_memory.json").read_text())
    assert rep["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and rep["devices"] == 8
    assert rep["batch"]["tokens"] == [8, 1024]
    peak = rep["memory_per_device"]["peak_estimate"] / 2**30
    assert 0.5 < peak < 80, peak


def test_an_abstract_target_compiles_but_never_trains(tmp_path):
    """Shapes without weights cannot train: without --compile_only the launch is one line and exit 2,
    nothing written; an abstract source without a preset or a config.json path says what it needs."""
    p = _cli("--config", os.path.join(REPO, "configs", "tiny.py"), "--workdir", str(tmp_path / "w"),
             "--config.model.source=abstract")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "has shapes but no weights" in p.stderr and "--compile_only" in p.stderr
    assert not (tmp_path / "w").exists()
    p = _cli("--config", os.path.join(REPO, "configs", "eagle3.py"), "--workdir", str(tmp_path / "w"),
             "--compile_only", "--config.model.source=abstract")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "abstract:/path/to/config.json" in p.stderr


def test_bad_scale_input_is_one_line(tmp_path):
    """A preset unknown to 'abstract' and a mesh larger than the job's devices: one line naming the
    value and what was expected, exit 2, no traceback, nothing written."""
    p = _cli("--config", os.path.join(REPO, "configs", "eagle3.py"), "--workdir", str(tmp_path / "a"), "--compile_only",
             "--config.model.source=abstract", "--config.model.preset=llama-9b")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "unknown model preset 'llama-9b'" in p.stderr and "qwen3-8b" in p.stderr
    p = _cli("--config", os.path.join(REPO, "configs", "tiny.py"), "--workdir", str(tmp_path / "b"), "--compile_only",
             "--cpu_devices", "2", "--config.model.source=abstract", "--config.train.mesh.fsdp=4",
             "--config.train.mesh.data=1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "fsdp=4" in p.stderr and "needs 4 devices; this job has 2" in p.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
