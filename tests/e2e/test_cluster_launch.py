"""How a process learns that it is part of a cluster, and which part: JAX's own cluster classes
(``jax._src.clusters``) run for real in faked environments — a Cloud TPU VM pod's metadata server
(a local HTTP server standing in for it), a GKE TPU pod's variables, a 2-node SLURM job step — and
training (``train.distributed.resolve``: what it hands ``jax.distributed.initialize``) and
self-distillation (``data.distill_shards.process_slot``: which prompts a worker answers) must both
read this process's index and count, the coordinator and the devices it drives from them. Nothing
joins a coordinator here except two subprocesses: one whose coordinator is unreachable (the launch
stops in one line naming it) and a 2-process run whose second host gets a preemption signal (both
hosts save at the same step).
"""

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster
from jax._src.clusters import cluster as jax_cluster

from confu_jax import cluster
from confu_jax.data import distill_shards as ds
from confu_jax.train import distributed
from confu_jax.train.metric_writers import read_csv
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_IDS = [f"conv-{i}" for i in range(40)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def environ(monkeypatch):
    """``environ(**vars)``: the process environment is exactly ``vars`` (JAX's cluster classes read
    ``os.environ``; nothing of the machine running the tests may leak in). Restored afterwards."""

    def set_exactly(**values):
        for key in list(os.environ):
            monkeypatch.delenv(key)
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))

    set_exactly()
    return set_exactly


class _Metadata(http.server.BaseHTTPRequestHandler):
    """GCE's metadata server as JAX's GceTpuCluster asks it: GET
    /computeMetadata/v1/instance/attributes/<key> with ``Metadata-Flavor: Google`` (refused without)."""

    PREFIX = "/computeMetadata/v1/instance/attributes/"

    def do_GET(self):  # noqa: N802 -- http.server's name
        server = self.server
        key = self.path[len(self.PREFIX):] if self.path.startswith(self.PREFIX) else None
        if self.headers.get("Metadata-Flavor") != "Google":
            server.refused += 1
            code, body = 403, "missing Metadata-Flavor: Google"
        elif key in server.attributes:
            server.asked.append(key)
            code, body = 200, server.attributes[key]
        else:
            server.asked.append(key)
            code, body = 404, "not found"
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata():
    """A metadata server on 127.0.0.1 (``GCE_METADATA_IP`` = ``metadata.address``); ``attributes``
    is what it answers, ``asked`` the keys it was asked for, ``refused`` requests without the header."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    server.attributes, server.asked, server.refused = {}, [], 0
    server.address = f"127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def on_tpu_vm(monkeypatch):
    """JAX's hardware probe (``cloud_tpu_init``: libtpu and TPU chips found) says this is a Cloud TPU VM."""
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(jax_cluster, "running_in_cloud_tpu_vm", True)


def _assert_split(slots):
    """The workers' slots answer every prompt exactly once between them, each worker some."""
    (n,) = {count for _, count in slots}
    assert sorted(i for i, _ in slots) == list(range(n))
    shares = [{c for c in PROMPT_IDS if ds.shard_of(c, n) == i} for i, _ in slots]
    assert all(shares)
    assert sum(len(s) for s in shares) == len(PROMPT_IDS) and set().union(*shares) == set(PROMPT_IDS)


def _kwargs(coordinator, num_processes, process_id, local_device_ids=None):
    return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id,
            "local_device_ids": local_device_ids, "cluster_detection_method": "deactivate"}


# ------------------------------------------------------------------- no cluster, explicit settings


def _as_each_worker(become) -> tuple[list, list]:
    """What ``resolve`` and ``process_slot`` decide as each of two workers: ``become(i)`` makes this
    process look like worker i to JAX's cluster classes."""
    specs, slots = [], []
    for worker in (0, 1):
        become(worker)
        specs.append(distributed.resolve(initialization_timeout=5))
        slots.append(ds.process_slot())
    return specs, slots


def test_a_plain_machine_is_one_process(environ):
    spec = distributed.resolve()
    assert (spec.mode, spec.cluster, spec.local_device_ids) == ("single", None, None)
    assert ds.process_slot() == (0, 1)


def test_explicit_flags_and_variables_are_passed_as_given(environ, monkeypatch):
    s = distributed.resolve("10.0.0.1:1234", 4, 3, [0, 1])
    assert (s.mode, s.cluster) == ("explicit", None)
    assert s.initialize_kwargs == _kwargs("10.0.0.1:1234", 4, 3, [0, 1])
    environ(JAX_COORDINATOR_ADDRESS="h:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1",
            JAX_LOCAL_DEVICE_IDS="2,3")
    s = distributed.resolve()
    assert s.initialize_kwargs == _kwargs("h:1", 2, 1, [2, 3])
    assert distributed.resolve(process_id=0).process_id == 0  # a flag wins over the variable
    assert ds.process_slot() == (1, 2)
    one = distributed.resolve("h:1", 1, 0, ["5"])
    assert (one.mode, one.local_device_ids) == ("single", (5,))
    calls = []  # one process joins nothing, but still drives only the devices it was given
    monkeypatch.setattr(distributed.jax.config, "update", lambda name, value: calls.append((name, value)))
    distributed.initialize(one)
    assert ("jax_cuda_visible_devices", "5") in calls


@pytest.mark.parametrize("kw,msg", [
    ({"coordinator_address": "h:1"}, r"missing \['num_processes', 'process_id'\].*detects no cluster"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     r"process_id=2 outside \[0, num_processes=2\)"),
    ({"local_device_ids": ["0", "x"]}, r"--local_device_ids=\['0', 'x'\]: expected comma-separated device ids"),
])
def test_bad_explicit_settings_are_one_line_naming_the_value(environ, kw, msg):
    with pytest.raises(ValueError, match=msg):
        distributed.resolve(**kw)


# ------------------------------------------------------------------- Cloud TPU VM pod (GCE metadata)


def test_a_tpu_vm_pod_is_found_through_its_metadata_server(environ, metadata, on_tpu_vm):
    # No variable names the pod: the metadata server is the only record of the workers.
    environ(GCE_METADATA_IP=metadata.address)
    metadata.attributes.update({
        "worker-network-endpoints": "t1v-n-0-w-0:8470:10.130.0.2,t1v-n-0-w-1:8470:10.130.0.3",
        "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\nZONE: 'us-central2-b'\n"})
    specs, slots = _as_each_worker(lambda w: metadata.attributes.__setitem__("agent-worker-number", str(w)))
    assert [(s.mode, s.cluster) for s in specs] == [("cluster", "GceTpuCluster")] * 2
    # worker 0 is the coordinator on JAX's TPU port; every process drives all of its host's chips
    assert [s.initialize_kwargs for s in specs] == [_kwargs("10.130.0.2:8482", 2, i) for i in (0, 1)]
    assert slots == [(0, 2), (1, 2)]
    _assert_split(slots)
    assert {"agent-worker-number", "worker-network-endpoints", "tpu-env"} <= set(metadata.asked)
    assert metadata.refused == 0  # JAX sent Metadata-Flavor: Google every time

    # two slices of 2 workers (multislice: tpu-env names the slice and its coordinator)
    metadata.attributes["tpu-env"] += ("MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\n"
                                       "MEGASCALE_COORDINATOR_ADDRESS: '10.130.0.9:8080'\n")
    s = distributed.resolve(initialization_timeout=5)
    assert s.initialize_kwargs == _kwargs("10.130.0.9:8482", 4, 3)  # worker 1 of slice 1
    assert ds.process_slot() == (3, 4)

    # a single-host TPU VM: one process, no coordinator
    metadata.attributes.update({"worker-network-endpoints": "10.130.0.2", "agent-worker-number": "0",
                                "tpu-env": ""})
    s = distributed.resolve(initialization_timeout=5)
    assert (s.mode, s.cluster, s.num_processes) == ("single", "GceTpuCluster", None)
    assert ds.process_slot() == (0, 1)


def test_the_metadata_server_is_not_asked_off_a_tpu_vm(environ, metadata):
    environ(GCE_METADATA_IP=metadata.address)
    metadata.attributes.update({"agent-worker-number": "1", "worker-network-endpoints": "a,b"})
    assert distributed.resolve().mode == "single" and ds.process_slot() == (0, 1)
    assert metadata.asked == []


# ------------------------------------------------------------------- GKE TPU pod (variables)


def test_a_gke_tpu_pod_is_found_through_its_variables(environ, metadata, on_tpu_vm):
    pod = {"TPU_WORKER_HOSTNAMES": "10.8.0.4,10.8.0.5",
           # no GCE metadata on GKE for JAX's GCE class (asked first) to read; tpu-env holds nothing
           "TPU_SKIP_MDS_QUERY": "true", "GCE_METADATA_IP": metadata.address}
    metadata.attributes["tpu-env"] = ""
    specs, slots = _as_each_worker(lambda w: environ(TPU_WORKER_ID=w, **pod))
    assert [(s.mode, s.cluster) for s in specs] == [("cluster", "GkeTpuCluster")] * 2
    assert [s.initialize_kwargs for s in specs] == [_kwargs("10.8.0.4:8482", 2, i) for i in (0, 1)]
    assert slots == [(0, 2), (1, 2)]
    _assert_split(slots)
    environ(TPU_WORKER_ID=1, JAX_COORDINATOR_PORT=9999, **pod)  # JAX's port override, honoured
    assert distributed.resolve(initialization_timeout=5).coordinator_address == "10.8.0.4:9999"


# ------------------------------------------------------------------- SLURM


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
              "SLURM_STEP_NUM_NODES": "2", "SLURM_LOCALID": "0"}


def test_a_two_node_slurm_step_runs_one_process_per_node_on_all_its_gpus(environ):
    specs, slots = [], []
    for task in (0, 1):
        environ(SLURM_PROCID=task, **SLURM_STEP)
        specs.append(distributed.resolve())
        slots.append(ds.process_slot())
    assert [(s.mode, s.cluster) for s in specs] == [("cluster", "SlurmCluster")] * 2
    # the step's first node, on the port JAX derives from the job id (4242 % 4096 + 61440)
    assert [s.initialize_kwargs for s in specs] == [_kwargs("gpu07:61586", 2, i) for i in (0, 1)]
    assert slots == [(0, 2), (1, 2)]
    _assert_split(slots)
    # JAX left to itself would pin each process to GPU SLURM_LOCALID = 0, one of the node's GPUs;
    # local_device_ids=None with detection off keeps all of them
    assert clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 5) == \
        ("gpu07:61586", 2, 1, [0])

    # a second task on a node: refused, unless its devices are named (then passed as given)
    environ(**dict(SLURM_STEP, SLURM_NTASKS="4", SLURM_PROCID="1", SLURM_LOCALID="1"))
    with pytest.raises(ValueError, match=r"SlurmCluster started process 1 as local process 1 of its "
                                         r"host; expected one process per host.*--ntasks-per-node=1"):
        distributed.resolve()
    assert distributed.resolve(local_device_ids=["1"]).initialize_kwargs == _kwargs("gpu07:61586", 4, 1, [1])

    # flags: all three replace the cluster; some fill in around it
    environ(SLURM_PROCID=1, **SLURM_STEP)
    assert distributed.resolve("10.0.0.1:1234", 2, 0).initialize_kwargs == _kwargs("10.0.0.1:1234", 2, 0)
    s = distributed.resolve("10.0.0.1:1234")
    assert (s.cluster, s.initialize_kwargs) == ("SlurmCluster", _kwargs("10.0.0.1:1234", 2, 1))


def test_the_slurm_script_asks_for_the_convention_resolve_accepts():
    """launch/slurm_train.sbatch: one task per node (a second task on a node would be refused)."""
    with open(os.path.join(REPO, "launch", "slurm_train.sbatch")) as f:
        directives = [ln.split()[1] for ln in f if ln.startswith("#SBATCH ")]
    assert "--ntasks-per-node=1" in directives and any(d.startswith("--gpus-per-node=") for d in directives)


def test_slurm_outside_a_multi_task_step_is_one_process(environ):
    environ(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_PROCID="0")  # salloc's shell: no srun step
    assert distributed.resolve().mode == "single" and ds.process_slot() == (0, 1)
    environ(**dict(SLURM_STEP, SLURM_NTASKS="1", SLURM_PROCID="0"))  # a one-task step
    s = distributed.resolve()
    assert (s.mode, s.cluster) == ("single", "SlurmCluster") and ds.process_slot() == (0, 1)


# ------------------------------------------------------------------- processes that really start


def _child_env(**extra):
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_", "JAX_COORD"))}
    return dict(keep, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **extra)


@pytest.mark.slow
@pytest.mark.parametrize("process,why", [
    (1, "Connection refused; expected process 0 to serve it"),  # nobody serves the port
    (0, "expected all 2 processes to reach it"),  # it serves; process 1 never comes
])
def test_an_unreachable_coordinator_stops_the_launch_in_one_line_naming_it(tmp_path, process, why):
    port = _free_port()
    env = _child_env(JAX_COORDINATOR_PORT=str(port), **dict(SLURM_STEP, SLURM_STEP_NODELIST="127.0.0.1",
                                                            SLURM_PROCID=str(process)))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "launch.train", "--config",
                        os.path.join(REPO, "tests", "configs", "toy_train.py"), "--workdir",
                        str(tmp_path / "run"), "--distributed_timeout=3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("launch.train:")]
    assert len(ours) == 1 and ours == p.stderr.strip().splitlines()[-1:], p.stderr[-3000:]
    assert f"process {process} of 2 (detected by JAX's SlurmCluster) could not join the coordinator " \
           f"127.0.0.1:{port} within 3 s: " in ours[0] and why in ours[0], ours[0]
    assert time.time() - t0 < 60
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def _steps_logged(workdir) -> int:
    try:
        return len(read_csv(os.path.join(workdir, "metrics.csv")))
    except (OSError, ValueError, KeyError):  # not written yet, or a line being written
        return 0


@pytest.mark.slow
def test_a_preemption_signal_to_one_host_saves_every_host_at_the_same_step(tmp_path):
    """SIGTERM reaches process 1 only (a maintenance event on one host): JAX's preemption sync
    service makes both processes stop at one agreed step and save it — the one checkpoint, with
    both processes' data positions — and exit cleanly."""
    workdir, port = str(tmp_path / "run"), _free_port()
    flags = ["--config", os.path.join(REPO, "tests", "configs", "toy_train.py"), "--workdir", workdir,
             "--config.train.steps=100000", "--config.train.checkpoint.every=100000",
             "--config.train.eval_every=0", "--config.train.progress_bar=False",
             "--config.train.tensorboard=off", "--cpu_devices=1", f"--coordinator_address=127.0.0.1:{port}",
             "--num_processes=2"]
    procs = [subprocess.Popen([sys.executable, "-m", "launch.train", *flags, f"--process_id={i}"], cwd=REPO,
                              env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        deadline = time.time() + 90
        while _steps_logged(workdir) < 2:
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    summary = json.loads(outs[0][0][outs[0][0].index("{"):])
    step = summary["step"]
    assert summary["preempted"] is True and 2 <= step < 100000
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(step)]  # one save, one step
    positions = sorted(f for f in os.listdir(os.path.join(workdir, "checkpoints", str(step), "data"))
                       if f.endswith(".json"))
    assert positions == ["process_0-of-2.json", "process_1-of-2.json"]
    assert read_csv(os.path.join(workdir, "metrics.csv"))[-1]["step"] == step


@pytest.mark.slow
def test_a_process_killed_without_a_signal_resumes_from_a_time_based_save(tmp_path):
    """No notice (a TPU without Autocheckpoint, a SIGKILL): ``checkpoint.every_seconds`` saved by process
    0's clock, agreed by both processes, bounds the loss — steps are never due by count here. One
    process is killed (SIGKILL), the other blocks and is killed too; the relaunch resumes from the
    newest save, which was at most ``every_seconds`` (plus a step and the save) old at the kill."""
    workdir, every_s = str(tmp_path / "run"), 2.0

    def launch(steps):
        port = _free_port()
        flags = ["--config", os.path.join(REPO, "tests", "configs", "toy_train.py"), "--workdir", workdir,
                 f"--config.train.steps={steps}", "--config.train.checkpoint.every=100000",
                 f"--config.train.checkpoint.every_seconds={every_s}", "--config.train.checkpoint.async_save=False",
                 "--config.train.eval_every=0", "--config.train.progress_bar=False",
                 "--config.train.tensorboard=off", "--cpu_devices=1", f"--coordinator_address=127.0.0.1:{port}",
                 "--num_processes=2"]
        return [subprocess.Popen([sys.executable, "-m", "launch.train", *flags, f"--process_id={i}"], cwd=REPO,
                                 env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    def saved():
        d = os.path.join(workdir, "checkpoints")
        return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []

    procs = launch(100000)
    try:
        deadline = time.time() + 120
        while len(saved()) < 2:  # two time-based saves: the bound is being kept, not just met once
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.1)
        time.sleep(every_s / 2)
        procs[1].kill()  # no signal: SIGKILL
        killed_at = time.time()
        time.sleep(1.0)
        procs[0].kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    last = saved()[-1]
    age = killed_at - os.path.getmtime(os.path.join(workdir, "checkpoints", str(last)))
    assert age < every_s + 5, age
    assert all(s % 100000 for s in saved())  # by time, not by count
    positions = sorted(f for f in os.listdir(os.path.join(workdir, "checkpoints", str(last), "data"))
                       if f.endswith(".json"))
    assert positions == ["process_0-of-2.json", "process_1-of-2.json"]
    procs = launch(last + 2)
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    summary = json.loads(outs[0][0][outs[0][0].index("{"):])
    assert (summary["start_step"], summary["step"]) == (last, last + 2)


@pytest.mark.parametrize("launcher,rank", [
    (dict(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="1"), "OMPI_COMM_WORLD_RANK"),
    (dict(PMI_SIZE="2", PMI_RANK="0"), "PMI_RANK"),
    (dict(SLURM_JOB_ID="7", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1"), "SLURM_PROCID"),  # a step JAX misses
], ids=["open_mpi_5", "pmi", "slurm_step"])
def test_a_launch_jax_does_not_recognise_is_refused_naming_the_fix(environ, launcher, rank):
    """``mpirun -n 4`` under Open MPI 5 (no OMPI_MCA_orte_hnp_uri, which JAX's detection reads): every rank
    resolved to one process and trained or generated alone. Now training and self-distillation refuse in
    one line naming the flags; explicit settings are taken as given."""
    environ(**launcher)
    for call in (distributed.resolve, ds.process_slot):
        with pytest.raises(cluster.ClusterError, match=rf"started \d processes.*--num_processes \d --process_id "
                                                       rf"\${rank}"):
            call()
    assert ds.process_slot(1, 2) == (1, 2)
    spec = distributed.resolve("127.0.0.1:1234", 2, 1)
    assert (spec.mode, spec.num_processes, spec.process_id) == ("explicit", 2, 1)
