"""Kill-and-resume of a training run, for every drafter family that trains (``tests/contract/test_family_training_contract.py``,
with each record's ``tiny_config``), and the families' short-run configs.

A run is killed with SIGKILL right after step ``kill_at`` (a train-loop hook), started again with the
same command, and must log the losses of an uninterrupted run exactly: the killed run *is* the
uninterrupted run up to ``kill_at``, so the steps the restarted run computes again — from its last
checkpoint to ``kill_at``, those whose losses depend on the restored parameters, optimizer state, data
position, random stream and schedule — must equal what the killed run logged before it died (no third,
uninterrupted run: at these shapes a run is mostly process start and compiling). Each run is a fresh interpreter
(``python -c``): the config is a shipped config file (``path.py`` or ``path.py:parameter``) with
``SHORT_RUN`` applied, and tests never import a ``launch`` module in-process. The persistent compilation
cache lets the later runs reuse the first run's executables.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys

import numpy as np

from confu_jax.train.metric_writers import read_csv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the families' short training runs: 12 steps, a checkpoint every 3, held-out evaluation every 6
SHORT_RUN = {"train.steps": 12, "train.checkpoint.every": 3, "train.eval_every": 6, "train.progress_bar": False,
             "train.log_every": 1}


def short_run_config(get_config, **extra):
    """``get_config()`` with ``SHORT_RUN`` and ``extra`` applied (dotted keys, 'train.steps')."""
    c = get_config()
    for key, value in {**SHORT_RUN, **extra}.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def tiny_run_config(config_file: str, **extra):
    """The shipped config ``config_file`` (``path.py`` or ``path.py:parameter``, relative to the repository)
    with ``SHORT_RUN`` and ``extra`` applied."""
    path, _, arg = config_file.partition(":")
    get_config = runpy.run_path(os.path.join(REPO, path))["get_config"]
    return short_run_config(lambda: get_config(*([arg] if arg else [])), **extra)


_RUNNER = r"""
import os, signal, sys
sys.path.insert(0, {repo!r})
from tests.helpers.train_resume import tiny_run_config
from confu_jax.train.loop import train

kill_at = int(sys.argv[2])

def kill(step, state, metrics):
    print("trained step", step, flush=True)  # what this process computed (resumed_steps)
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

train(tiny_run_config({config_file!r}), sys.argv[1], hooks=[kill])
if kill_at:
    raise SystemExit("not killed")
"""


def resume_env(tmp_path) -> dict:
    """The subprocesses' environment: the repository on the path, one persistent compilation cache
    (the test run's own, set by conftest.py, so the family's other tests' programs are found too;
    else one under ``tmp_path``)."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "jax_cache")
    return dict(os.environ, PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=cache,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def run_training(config_file: str, workdir: str, kill_at: int, env: dict):
    """``train(tiny_run_config(config_file), workdir)`` in a fresh interpreter, killed after step ``kill_at``
    (0: not)."""
    code = _RUNNER.format(repo=REPO, config_file=config_file)
    return subprocess.run([sys.executable, "-c", code, workdir, str(kill_at)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def assert_killed_run_resumes(tmp_path, config_file: str, kill_at: int = 11) -> tuple:
    """A run killed after ``kill_at`` (``SHORT_RUN``: checkpoints every 3 steps, so the last one before
    step 11 is step 9's, or step 6's if 9's had not landed) and resumed by the same command: the steps it
    computes again equal, to rtol 1e-6, what the killed run logged for them, at least two of them; the
    resumed run ends at the last step with one row per step and its evaluations' rows in order ->
    (the resumed run's workdir, the environment)."""
    env = resume_env(tmp_path)
    workdir = str(tmp_path / "run")
    p = run_training(config_file, workdir, kill_at, env)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    killed = read_csv(os.path.join(workdir, "metrics.csv"))
    assert [r["step"] for r in killed] == list(range(1, kill_at + 1))
    killed_eval = read_csv(os.path.join(workdir, "eval.csv"))
    p = run_training(config_file, workdir, 0, env)  # the same command again: resumes from the last checkpoint
    assert p.returncode == 0, p.stderr[-3000:]
    steps = SHORT_RUN["train.steps"]
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    again = [s for s in resumed_steps(p.stdout) if s <= kill_at]
    assert len(again) >= 2, (again, p.stdout[-2000:])
    for step in again:
        r, q = rows[step - 1], killed[step - 1]
        for key in q:
            np.testing.assert_allclose(r[key], q[key], rtol=1e-6, atol=0, err_msg=f"metrics.csv step {step} {key}")
    evals = read_csv(os.path.join(workdir, "eval.csv"))
    assert evals[:len(killed_eval)] == killed_eval and [r["step"] for r in evals] == sorted({r["step"] for r in evals})
    assert evals[-1]["step"] == steps
    return workdir, env


def resumed_steps(stdout: str) -> list:
    """The steps a run computed, from the runner's "trained step N" lines."""
    return [int(line.split()[-1]) for line in stdout.splitlines() if line.startswith("trained step ")]
