"""Multi-process training on one CPU machine (how processes decide to join a run: tests/e2e/test_cluster_launch.py).

Two processes × 2 CPU devices (``jax.distributed`` on 127.0.0.1, gloo collectives) must follow the
same loss trajectory as one process × 4 devices, including across a resume that restores each
process's own data position.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from confu_jax.train.metric_writers import read_csv
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy_train.py")
# fsdp=2 spans both processes (params all-gathered, gradients reduced across them), tensor=2
# stays inside each. end_lr_ratio=1 makes the lr independent of train.steps, so a run extended
# from 6 to 8 steps follows the same trajectory as a run of 8.
COMMON = ["--config", TOY_CONFIG, "--config.train.mesh.fsdp=2", "--config.train.mesh.tensor=2",
          "--config.train.checkpoint.every=3", "--config.train.eval_every=3",
          "--config.train.optim.end_lr_ratio=1.0", "--config.train.progress_bar=False"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir):
    # conftest's 8 forced host devices must not leak into the children: they pick their own. The
    # persistent compilation cache lets the resumed run reuse the first run's executables.
    return dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
                JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _launch(workdir, steps, extra):
    cache = os.path.join(os.path.dirname(workdir), "jax_cache")
    return subprocess.Popen(
        [sys.executable, "-m", "launch.train", *COMMON, f"--config.train.steps={steps}",
         "--workdir", workdir, *extra], cwd=REPO, env=_env(cache), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _wait(procs, timeout=240):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outs:
        assert rc == 0, err[-4000:]
    return outs


def _two_processes(workdir, steps):
    port = _free_port()
    return [_launch(workdir, steps, ["--cpu_devices=2", f"--coordinator_address=127.0.0.1:{port}",
                                     "--num_processes=2", f"--process_id={i}"]) for i in range(2)]


@pytest.mark.slow
def test_two_processes_match_one_process_loss_trajectory(tmp_path):
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    # 1 × 4 for 8 steps, concurrently with 2 × 2 for 6 steps ...
    outs = _wait([_launch(single, 8, ["--cpu_devices=4"]), *_two_processes(multi, 6)])
    s0 = json.loads(outs[1][1][outs[1][1].index("{"):])
    assert s0["step"] == 6 and s0["start_step"] == 0
    assert "{" not in outs[2][1]  # only process 0 reports
    for step in (3, 6):  # each process saved its own data position
        files = sorted(os.listdir(os.path.join(multi, "checkpoints", str(step), "data")))
        assert [f for f in files if f.endswith(".json")] == ["process_0-of-2.json",
                                                             "process_1-of-2.json"]
    # ... then the 2 × 2 run resumes from its step-6 checkpoint and continues to 8
    outs = _wait(_two_processes(multi, 8))
    assert json.loads(outs[0][1][outs[0][1].index("{"):])["start_step"] == 6

    for name in ("metrics.csv", "eval.csv"):
        ref, got = read_csv(os.path.join(single, name)), read_csv(os.path.join(multi, name))
        assert [r["step"] for r in got] == [r["step"] for r in ref]
        assert len(ref) == (8 if name == "metrics.csv" else 3)
        for r, q in zip(got, ref):
            for k in q:
                assert r[k] == pytest.approx(q[k], rel=1e-5, abs=1e-7), (name, q["step"], k)
