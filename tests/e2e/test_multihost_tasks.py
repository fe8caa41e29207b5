"""The real training tasks over two processes (``jax.distributed`` on 127.0.0.1, 2 CPU devices each), on a
tiny Llama checkpoint no preset describes: hosts sit on the outer (data) axis of the mesh, every
training record is read exactly once per epoch across the processes (``train.log_records``), and a
``kill -9`` of one process mid-run followed by a restart of the whole job gives the uninterrupted run's
losses step for step (ConFu, online target features). EAGLE-3 on offline target features
(``launch.target_features``) reads its store rows once per epoch the same way.

tests/e2e/test_multiprocess.py checks the same trajectory property on a toy task with a clean stop.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from confu_jax.train.metric_writers import read_csv, read_record_logs
from tests.helpers.tiny_checkpoints import hf_llama, write_hf_tokenizer
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_RECORDS, BATCH, STEPS = 12, 4, 9  # 3 steps an epoch, 3 epochs
TOPICS = ["cats", "rain", "tea", "maps", "jazz", "snow", "bees", "salt", "wind", "moss", "kites", "owls"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    model = tmp / "model"
    hf_llama(model, seed=5, vocab=300, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, ffn=96, max_pos=512)
    write_hf_tokenizer(model)
    data = tmp / "train.jsonl"
    with open(data, "w") as f:
        for i, t in enumerate(TOPICS[:N_RECORDS]):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."},
                                             {"role": "assistant", "content": f"{t} number {i} is fine."}]}) + "\n")
    cache = tmp / "jax_cache"
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return {"tmp": tmp, "model": str(model), "data": str(data), "env": env}


def _flags(s, variant, workdir, extra=()):
    return ["--config", os.path.join(REPO, "configs", f"{variant}.py"), "--workdir", workdir,
            f"--config.model.source={s['model']}", f"--config.data.train_files={s['data']}",
            "--config.data.max_length=64", f"--config.data.global_batch_size={BATCH}", "--config.data.num_workers=0",
            "--config.objective.eval_records=0", "--config.train.eval_every=0", "--config.draft.ttt_steps=2",
            f"--config.train.steps={STEPS}", "--config.train.checkpoint.every=2", "--config.train.log_every=1",
            "--config.train.log_records=True", "--config.train.progress_bar=False", "--config.train.tensorboard=off",
            "--config.train.optim.end_lr_ratio=1.0", "--config.train.mesh.data=2", "--config.train.mesh.fsdp=2",
            *extra]


def _start(s, args, n_procs=2):
    """Two processes of ``launch.train``, 2 CPU devices each, joined on 127.0.0.1."""
    assert n_procs == 2
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-m", "launch.train", "--cpu_devices=2", "--num_processes=2",
                              f"--coordinator_address=127.0.0.1:{port}", f"--process_id={i}", *args], cwd=REPO,
                             env=s["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]


def _finish(procs, timeout=600):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append(err)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _steps_logged(workdir) -> int:
    path = os.path.join(workdir, "metrics.csv")
    try:
        return max((r["step"] for r in read_csv(path)), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def _check_epochs(workdir, n_records):
    """Every epoch (n_records / BATCH steps) read every record exactly once, over both processes."""
    per_step = read_record_logs(os.path.join(workdir, "records"))
    assert sorted(per_step) == list(range(1, STEPS + 1))
    assert all(len(ids) == BATCH for ids in per_step.values())
    per_epoch = n_records // BATCH
    for e in range(STEPS // per_epoch):
        ids = sorted(i for s in range(e * per_epoch + 1, (e + 1) * per_epoch + 1) for i in per_step[s])
        assert ids == list(range(n_records)), (e, ids)
    return per_step


@pytest.mark.slow
def test_confu_survives_a_kill_of_one_process_with_the_same_losses_and_epochs(setup):
    s = setup
    ref, job = str(s["tmp"] / "confu_ref"), str(s["tmp"] / "confu_job")
    _finish(_start(s, _flags(s, "confu", ref), 2))  # the uninterrupted job

    procs = _start(s, _flags(s, "confu", job), 2)
    deadline = time.time() + 600
    while _steps_logged(job) < 3:  # past the step-2 checkpoint, well before the end
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the job ended before the kill"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGSTOP)  # freeze process 1 first: the run cannot reach its end meanwhile
    at_kill = _steps_logged(job)
    procs[1].send_signal(signal.SIGKILL)  # kill -9
    procs[1].wait()
    time.sleep(1.0)
    procs[0].kill()  # its partner is gone: the job is restarted as a whole, as a scheduler would
    procs[0].wait()
    assert 3 <= at_kill < STEPS, at_kill

    errs = _finish(_start(s, _flags(s, "confu", job), 2))  # the restart resumes from the last checkpoint
    assert "restored" in errs[0].lower() or "resum" in errs[0].lower(), errs[0][-2000:]

    want, got = read_csv(os.path.join(ref, "metrics.csv")), read_csv(os.path.join(job, "metrics.csv"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r, q in zip(got, want):
        for k in ("loss", "loss/step0", "loss/step1", "grad_norm"):
            assert r[k] == pytest.approx(q[k], rel=1e-6, abs=1e-8), (q["step"], k)
    ids = _check_epochs(job, N_RECORDS)
    assert ids == read_record_logs(os.path.join(ref, "records"))  # the same rows, in the same order
    with open(os.path.join(job, "mesh.json")) as f:
        layout = json.load(f)
    assert layout["axes"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert layout["process_index"] == [[[0], [0]], [[1], [1]]]  # hosts on the outer (data) axis


@pytest.mark.slow
def test_eagle3_offline_features_read_each_row_once_per_epoch(setup):
    s = setup
    store = str(s["tmp"] / "features")
    p = subprocess.run([sys.executable, "-m", "launch.target_features", "--config",
                        os.path.join(REPO, "configs", "eagle3.py"), "--out", store, "--top_k", "8",
                        "--dtype", "float32", f"--config.model.source={s['model']}",
                        f"--config.data.train_files={s['data']}", "--config.data.max_length=64",
                        "--config.data.num_workers=0", "--config.objective.eval_records=0"],
                       cwd=REPO, env=dict(s["env"], XLA_FLAGS=SINGLE_DEVICE), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(store, "index.json")) as f:
        rows = sum(sh["rows"] for sh in json.load(f)["shards"])
    assert rows == N_RECORDS
    job = str(s["tmp"] / "eagle3_offline")
    _finish(_start(s, _flags(s, "eagle3", job, [f"--config.data.target_features={store}"]), 2))
    _check_epochs(job, rows)
    losses = [r["loss"] for r in read_csv(os.path.join(job, "metrics.csv"))]
    assert len(losses) == STEPS and losses[-1] < losses[0]
