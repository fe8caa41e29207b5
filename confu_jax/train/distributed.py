"""Multi-process start-up: decide how to call ``jax.distributed.initialize``, then call it.

Precedence: explicit flags > ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
(``JAX_LOCAL_DEVICE_IDS``) > the cluster JAX's own detection finds (``confu_jax/cluster.py``: SLURM,
a Cloud TPU VM pod through the GCE metadata server, GKE TPU pods, Open MPI, Kubernetes) > a single
process (no initialisation). Settings left unset by the flags are filled from the detected cluster,
as ``jax.distributed.initialize`` fills them.

The decision (:func:`resolve`) is made here once and handed to JAX in full, with JAX's detection
switched off (``cluster_detection_method='deactivate'``): what is logged and tested is what JAX gets.
The convention is **one process per host driving all of that host's devices** — on a TPU pod, a
SLURM node (``srun --ntasks-per-node=1``) or an MPI host alike. JAX's own SLURM / Open MPI default
is one process per GPU (``local_device_ids=[local rank]``); a second process on the same host is
refused unless ``--local_device_ids`` names its devices, which is then passed through as given.

``cpu_devices`` (``jax_num_cpu_devices``) and gloo collectives make a multi-process run possible
on one CPU machine — how the tests run 2 processes × 2 devices against 1 × 4.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Optional, Sequence

import jax

from confu_jax import cluster
from confu_jax.cluster import ClusterError


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    mode: str  # 'single' | 'explicit' (flags / JAX_* variables) | 'cluster' (JAX's detection)
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[tuple] = None  # None: every device of the host
    cluster: Optional[str] = None  # the JAX class that detected the run ('SlurmCluster', 'GceTpuCluster', ...)

    @property
    def initialize_kwargs(self) -> dict:
        """Everything ``jax.distributed.initialize`` needs, so that it detects nothing itself."""
        return {"coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
                "process_id": self.process_id,
                "local_device_ids": None if self.local_device_ids is None else list(self.local_device_ids),
                "cluster_detection_method": "deactivate"}

    def describe(self) -> str:
        how = {"single": "single process", "explicit": "explicit flags / JAX_* variables"}.get(
            self.mode, f"detected by JAX's {self.cluster}")
        if self.cluster and self.mode == "single":
            how += f" ({self.cluster}: one process)"
        return how


def _int(value, name: str) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _device_ids(ids, name: str) -> Optional[tuple]:
    if ids is None or ids == "" or ids == []:
        return None
    items = ids.split(",") if isinstance(ids, str) else ids
    try:
        return tuple(int(i) for i in items)
    except ValueError:
        raise ValueError(f"{name}={ids!r}: expected comma-separated device ids, e.g. 0,1") from None


def resolve(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
            process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None,
            initialization_timeout: int = 300) -> DistributedSpec:
    """How this process should join (or not) a multi-process run: flags, then the JAX_* variables
    a user sets by hand, then the cluster JAX detects (each value the flags leave unset comes from
    it). A TPU worker may wait up to ``initialization_timeout`` s for its coordinator's host name."""
    env = os.environ
    coord = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    nproc = num_processes if num_processes is not None else _int(env.get("JAX_NUM_PROCESSES"),
                                                                 "JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _int(env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID")
    ids = (_device_ids(list(local_device_ids), "--local_device_ids") if local_device_ids
           else _device_ids(env.get("JAX_LOCAL_DEVICE_IDS"), "JAX_LOCAL_DEVICE_IDS"))
    found = None if (coord and nproc is not None and pid is not None) else cluster.detect()
    if found is None:
        if coord or nproc is not None or pid is not None:
            missing = [n for n, v in (("coordinator_address", coord), ("num_processes", nproc),
                                      ("process_id", pid)) if v is None]
            if missing:
                raise ValueError(
                    f"explicit multi-process start needs coordinator_address, num_processes and "
                    f"process_id; missing {missing} (flags --{' --'.join(missing)} or env JAX_*), "
                    f"and JAX detects no cluster (SLURM, TPU pod, MPI) to fill them in")
        else:
            cluster.check_not_missed(1, "train the whole run")
            return DistributedSpec("single", local_device_ids=ids)
    else:
        nproc = found.num_processes if nproc is None else nproc
        pid = found.process_id if pid is None else pid
    if not 0 <= pid < nproc:
        raise ValueError(f"process_id={pid} outside [0, num_processes={nproc})")
    name = found.name if found else None
    if nproc == 1:
        return DistributedSpec("single", local_device_ids=ids, cluster=name)
    if found is not None and ids is None and found.local_process_id:
        raise ValueError(
            f"{name} started process {pid} as local process {found.local_process_id} of its host; "
            "expected one process per host driving all of its devices: launch one task per node "
            "(srun --ntasks-per-node=1), or name each process's devices with --local_device_ids "
            "(one task per GPU: --local_device_ids=$SLURM_LOCALID)")
    if coord is None:
        coord = found.coordinator_address(initialization_timeout)
    return DistributedSpec("explicit" if found is None else "cluster", coord, nproc, pid, ids, name)


def configure_cpu(cpu_devices: int = 0, collectives: str = "gloo"):
    """Before any JAX computation: N CPU devices per process, cross-process CPU collectives."""
    if cpu_devices and cpu_devices > 0:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if collectives:
        jax.config.update("jax_cpu_collectives_implementation", collectives)


def _wait_for_coordinator(spec: DistributedSpec, timeout_s: float) -> None:
    """A process other than 0 first opens a plain TCP connection to the coordinator, retrying until
    ``timeout_s``: JAX's client, when its registration times out, aborts the whole process from C++
    (a CHECK failure and a stack trace, no exception), so an address nobody serves — a wrong host or
    port, a firewall, process 0 not started — is caught here, as a :class:`ClusterError`."""
    host, _, port = spec.coordinator_address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            wait = max(0.1, min(2.0, deadline - time.monotonic()))
            socket.create_connection((host, int(port)), timeout=wait).close()
            return
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline:
                raise ClusterError(_join_failure(spec, timeout_s, f"{cluster.one_line(e)}; expected process "
                                                                  f"0 to serve it")) from None
        time.sleep(0.25)


def _join_failure(spec: DistributedSpec, timeout_s: float, why: str) -> str:
    return (f"process {spec.process_id} of {spec.num_processes} ({spec.describe()}) could not join the "
            f"coordinator {spec.coordinator_address} within {timeout_s:g} s: {why} "
            f"(--distributed_timeout, --coordinator_address)")


def initialize(spec: DistributedSpec, initialization_timeout: int = 300,
               prog: str = "confu_jax") -> DistributedSpec:
    """Join the run described by ``spec`` (a single process: only its ``local_device_ids``).

    A coordinator that cannot be reached within ``initialization_timeout`` s is one line naming it
    (:class:`~confu_jax.cluster.ClusterError`), not JAX's abort: processes other than 0 check the
    address first (:func:`_wait_for_coordinator`); for what is left (process 0 waiting for processes
    that never come) a watchdog writes ``<prog>: <the same line>`` and exits with status 2 when the
    time is up, before JAX's client would abort the process with a C++ stack trace."""
    if spec.mode == "single":
        if spec.local_device_ids is not None:  # JAX's one place for it, honoured without a coordinator too
            ids = ",".join(str(i) for i in spec.local_device_ids)
            jax.config.update("jax_cuda_visible_devices", ids)
            jax.config.update("jax_rocm_visible_devices", ids)
        return spec
    t0 = time.monotonic()
    if spec.process_id != 0:
        _wait_for_coordinator(spec, initialization_timeout)
    left = max(1, int(round(initialization_timeout - (time.monotonic() - t0))))

    def give_up():
        sys.stderr.write(f"{prog}: " + _join_failure(
            spec, initialization_timeout, f"expected all {spec.num_processes} processes to reach it") + "\n")
        sys.stderr.flush()
        os._exit(2)

    watchdog = threading.Timer(left, give_up)  # JAX's connect releases the GIL: the timer runs
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(initialization_timeout=left, **spec.initialize_kwargs)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError included
        raise ClusterError(_join_failure(spec, initialization_timeout, cluster.one_line(e))) from e
    finally:
        watchdog.cancel()
    return spec


def is_initialized() -> bool:
    return jax.distributed.is_initialized()
