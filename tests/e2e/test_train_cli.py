"""``python -m launch.train``: config errors, and ``init_from`` end to end."""

import json
import pytest
import os
import subprocess
import sys

import numpy as np
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy_train.py")


def _train(*args, timeout=240):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.train", "--config", TOY_CONFIG,
                           "--config.train.progress_bar=False", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_unknown_config_key_is_a_one_line_error_naming_it(tmp_path):
    p = _train("--workdir", str(tmp_path), "--config.train.optim.lrr=1e-3")
    assert p.returncode != 0
    assert "--config.train.optim.lrr" in p.stderr and 'Did you mean "lr"' in p.stderr
    assert "Traceback" not in p.stderr
    assert not os.listdir(tmp_path)  # nothing started


def test_ill_typed_config_value_names_the_flag(tmp_path):
    p = _train("--workdir", str(tmp_path), "--config.train.steps=ten")
    assert p.returncode != 0
    assert "--config.train.steps=ten" in p.stderr and "Traceback" not in p.stderr


def test_missing_workdir_and_missing_config_file():
    p = _train()
    assert p.returncode != 0 and "--workdir is required" in p.stderr
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "launch.train", "--config", "configs/nope.py",
                        "--workdir", "x"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "configs/nope.py" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_init_from_another_run_copies_shared_params(tmp_path):
    """A 3-step-head run initialised from a finished 3-step-head run... with 4 heads: the shared
    fc / norm are copied, the per-step head stacks changed shape and keep their fresh init."""
    src, dst = str(tmp_path / "eagle3"), str(tmp_path / "confu")
    p = _train("--workdir", src, "--config.train.steps=2", "--config.train.eval_every=0")
    assert p.returncode == 0, p.stderr[-3000:]
    p = _train("--workdir", dst, "--config.train.steps=1", "--config.train.eval_every=0",
               "--config.toy.ttt_steps=4",
               f"--config.train.checkpoint.init_from={os.path.join(src, 'checkpoints')}")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(dst, "init_from.json")) as f:
        report = json.load(f)
    assert report["step"] == 2
    assert report["copied"] == ["fc/kernel", "norm/scale"]
    assert sorted(m[0] for m in report["shape_mismatch"]) == ["heads/down/kernel", "heads/up/kernel"]
    assert report["kept_init"] == [] and report["ignored"] == []
    # the source's lineage as it was when this run started (runs.lineage reads it, not the source now)
    from confu_jax.runs.lineage import lineage

    assert report["source_lineage"] == lineage(os.path.abspath(src), 2)
    assert report["source_lineage"][0]["workdir"] == os.path.abspath(src) and report["source_lineage"][0]["step"] == 2


def test_a_run_learns(tmp_path):
    """The machinery optimises something real: held-out loss falls, simulated τ rises."""
    from confu_jax.train.metric_writers import read_csv

    p = _train("--workdir", str(tmp_path), "--config.train.steps=60", "--config.train.optim.lr=1e-2",
               "--config.train.eval_every=20", "--config.train.checkpoint.every=0")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = read_csv(os.path.join(tmp_path, "eval.csv"))
    assert [r["step"] for r in ev] == [20, 40, 60]
    train_rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    assert np.mean([r["loss"] for r in train_rows[-10:]]) < train_rows[0]["loss"] - 0.3
    assert ev[-1]["loss"] < ev[0]["loss"] and ev[-1]["acceptance_length"] > 1.3
    assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["60"]  # every=0: only the end


def test_compile_only_reports_the_step_memory_and_trains_nothing(tmp_path):
    """``--compile_only``: the compiled step's per-device memory as JSON (how a batch size is
    planned for a GPU from any machine), and no run: no checkpoint, no metrics."""
    p = _train("--workdir", str(tmp_path), "--compile_only")
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.listdir(tmp_path) == ["train_step_memory.json"]
    with open(tmp_path / "train_step_memory.json") as f:
        rep = json.load(f)
    m = rep["memory_per_device"]
    assert m["temp"] > 0 and m["arguments"] > 0
    assert m["peak_estimate"] == m["arguments"] + m["outputs"] - m["aliased"] + m["temp"]
    assert rep["backend"] == "cpu" and "per device: ~" in p.stderr
