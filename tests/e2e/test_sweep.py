"""``python -m launch.sweep``: a 2x2 sweep of the toy task that survives a kill, its table and plot,
the slurm / per-host scripts, and spec errors."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from confu_jax.runs import sweep as sw
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(REPO, "tests", "configs", "toy_sweep.py")


def _env():
    return dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def _sweep(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "launch.sweep", "--spec", SPEC, *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _saved_steps(point_dir):
    d = os.path.join(point_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def test_points_are_the_product_in_a_fixed_order():
    s = sw.load_sweep(SPEC)
    assert s.varied_keys == ("train.optim.lr", "toy.head_dim")
    assert [p.varied for p in s.points] == [{"train.optim.lr": lr, "toy.head_dim": h}
                                            for lr in (1e-3, 3e-3) for h in (32, 64)]
    assert all(p.overrides["train.steps"] == 30 for p in s.points)
    assert len({p.name for p in s.points}) == 4 and s.points[3].name == "003-lr=0.003,head_dim=64"
    assert s.config_path == os.path.join(REPO, "tests", "configs", "toy_train.py")


def test_zip_and_product_together(tmp_path):
    spec = tmp_path / "s.py"
    spec.write_text(f"def get_sweep():\n    return dict(config={os.path.join(REPO, 'tests/configs/toy_train.py')!r},"
                    "\n        zip={'train.optim.lr': [1e-3, 2e-3, 3e-3], 'train.steps': [1, 2, 3]},"
                    "\n        product={'toy.head_dim': [8, 16]})\n")
    s = sw.load_sweep(str(spec))
    assert len(s.points) == 6
    # zip rows vary slowest; inside a row, lr and steps stay paired
    assert [(p.overrides["train.optim.lr"], p.overrides["train.steps"], p.overrides["toy.head_dim"])
            for p in s.points] == [(1e-3, 1, 8), (1e-3, 1, 16), (2e-3, 2, 8), (2e-3, 2, 16), (3e-3, 3, 8), (3e-3, 3, 16)]


@pytest.mark.parametrize("body, message", [
    ("dict(config='toy_train.py', product={'train.optim.lrr': [1]})", "has no field 'lrr' (did you mean lr"),
    ("dict(config='toy_train.py', zip={'train.steps': [1, 2], 'toy.head_dim': [3]})", "equal lengths"),
    ("dict(config='toy_train.py', overrides={'train.steps': 1}, product={'train.steps': [1]})", "more than once"),
    ("dict(config='nope.py')", "does not exist"),
    ("dict(config='toy_train.py', prodcut={})", "unknown keys ['prodcut']"),
    ("dict(config='toy_train.py', product={'train.steps': []})", "non-empty list"),
])
def test_spec_errors_name_the_key(tmp_path, body, message):
    spec = tmp_path / "bad.py"
    spec.write_text(f"def get_sweep():\n    return {body}\n")
    (tmp_path / "toy_train.py").write_text(open(os.path.join(REPO, "tests/configs/toy_train.py")).read())
    with pytest.raises(sw.SweepError, match=None) as e:
        sw.load_sweep(str(spec))
    assert message in str(e.value)


def test_a_point_dir_of_another_spec_is_refused(tmp_path):
    s = sw.load_sweep(SPEC)
    d = sw.claim_point_dir(str(tmp_path), s.points[0])
    other = sw.Point(0, {**s.points[0].overrides, "train.steps": 99}, s.points[0].varied)
    with pytest.raises(sw.SweepError, match="point.json was written for overrides"):
        sw.claim_point_dir(str(tmp_path), other)
    assert os.path.isdir(d)


def test_slurm_and_host_scripts_cover_the_unfinished_points(tmp_path):
    s = sw.load_sweep(SPEC)
    done = sw.claim_point_dir(str(tmp_path), s.points[2])
    open(os.path.join(done, sw.DONE_FILE), "w").write("{}")
    p = _sweep("--sweep_dir", str(tmp_path), "--mode", "slurm", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    script = open(tmp_path / "sweep.sbatch").read()
    assert "#SBATCH --array=0,1,3" in script and '--points "$SLURM_ARRAY_TASK_ID"' in script
    p = _sweep("--sweep_dir", str(tmp_path), "--mode", "hosts", "--num_hosts", "2", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    hosts = [open(tmp_path / "hosts" / f"host_{h}.sh").read() for h in range(2)]
    assert "--points 0,3" in hosts[0] and "--points 1\n" in hosts[1]


@pytest.mark.slow
def test_sweep_resumes_after_a_kill_and_collects_the_table(tmp_path):
    sweep_dir = tmp_path / "sweep"
    s = sw.load_sweep(SPEC)
    dirs = [sw.point_dir(str(sweep_dir), p) for p in s.points]
    proc = subprocess.Popen([sys.executable, "-m", "launch.sweep", "--spec", SPEC, "--sweep_dir", str(sweep_dir)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 400
    while not _saved_steps(dirs[1]) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its training process, mid point 1
    proc.wait()
    saved = _saved_steps(dirs[1])
    assert saved and saved[-1] < 30, f"the kill did not land inside point 1 (saved steps {saved})"
    assert os.path.isfile(os.path.join(dirs[0], sw.DONE_FILE))
    assert not os.path.isfile(os.path.join(dirs[1], sw.DONE_FILE))

    p = _sweep("--sweep_dir", str(sweep_dir))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 done, 1 to resume, 2 new" in p.stdout
    # point 0 was not run again; point 1 resumed from its last checkpoint, not from scratch
    assert open(os.path.join(dirs[0], sw.LOG_FILE)).read().count("\n=== ") == 1
    log1 = open(os.path.join(dirs[1], sw.LOG_FILE)).read()
    assert log1.count("\n=== ") == 2 and "resumed from" in log1.split("\n=== ")[-1]
    for d in dirs:
        done = json.load(open(os.path.join(d, sw.DONE_FILE)))
        assert done["step"] == 30
        steps = [int(r["step"]) for r in csv.DictReader(open(os.path.join(d, "metrics.csv")))]
        assert steps == list(range(1, 31))  # the resumed run logged every step exactly once

    rows = list(csv.DictReader(open(sweep_dir / "results.csv")))
    assert len(rows) == 4
    for row, point, d in zip(rows, s.points, dirs):
        assert float(row["train.optim.lr"]) == point.varied["train.optim.lr"]
        assert int(row["toy.head_dim"]) == point.varied["toy.head_dim"] and row["status"] == "done"
        last_eval = list(csv.DictReader(open(os.path.join(d, "eval.csv"))))[-1]
        assert int(row["step"]) == int(last_eval["step"]) == 30
        assert float(row["eval/acceptance_length"]) == float(last_eval["acceptance_length"])
    md = open(sweep_dir / "results.md").read()
    assert md.count("| done | 30 |") == 4
    assert os.path.getsize(sweep_dir / "results.png") > 1000

    again = _sweep("--sweep_dir", str(sweep_dir), timeout=120)  # everything done: nothing runs
    assert again.returncode == 0 and "4 done, 0 to resume, 0 new" in again.stdout and "[1/" not in again.stdout
