"""Multi-process start-up: decide how to call ``jax.distributed.initialize``, then call it.

Precedence: explicit flags > ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``
> a SLURM job step with several tasks > a Cloud TPU VM pod > single process (no initialisation).
SLURM and TPU pods are handed to JAX's own cluster detection (``initialize()`` with no
arguments), which reads the node list / TPU metadata; the decision itself (:func:`resolve`) is a
pure function of flags and environment so it can be tested without a cluster.

``cpu_devices`` (``jax_num_cpu_devices``) and gloo collectives make a multi-process run possible
on one CPU machine — how the tests run 2 processes × 2 devices against 1 × 4.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    mode: str  # 'single' | 'explicit' | 'slurm' | 'tpu'
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[tuple] = None

    @property
    def initialize_kwargs(self) -> dict:
        if self.mode in ("slurm", "tpu"):
            return {}  # JAX's cluster auto-detection fills everything in
        kw = {"coordinator_address": self.coordinator_address,
              "num_processes": self.num_processes, "process_id": self.process_id}
        if self.local_device_ids is not None:
            kw["local_device_ids"] = list(self.local_device_ids)
        return kw


_TPU_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID")


def _int(value, name: str) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def resolve(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
            process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None,
            env: Optional[Mapping[str, str]] = None) -> DistributedSpec:
    """How this process should join (or not) a multi-process run."""
    env = os.environ if env is None else env
    coord = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    nproc = num_processes if num_processes is not None else _int(env.get("JAX_NUM_PROCESSES"),
                                                                 "JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _int(env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID")
    ids = tuple(int(i) for i in local_device_ids) if local_device_ids else None
    if coord or nproc is not None or pid is not None:
        missing = [n for n, v in (("coordinator_address", coord), ("num_processes", nproc),
                                  ("process_id", pid)) if v is None]
        if missing:
            raise ValueError(
                f"explicit multi-process start needs coordinator_address, num_processes and "
                f"process_id; missing {missing} (flags --{' --'.join(missing)} or env JAX_*)")
        if not 0 <= pid < nproc:
            raise ValueError(f"process_id={pid} outside [0, num_processes={nproc})")
        if nproc == 1:
            return DistributedSpec("single")
        return DistributedSpec("explicit", coord, nproc, pid, ids)
    slurm_keys = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                  "SLURM_LOCALID")
    if all(k in env for k in slurm_keys) and _int(env["SLURM_NTASKS"], "SLURM_NTASKS") > 1:
        return DistributedSpec("slurm")
    if any(k in env for k in _TPU_ENV) and env.get("TPU_SKIP_MDS_QUERY") is None:
        hosts = env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or ""
        if len([h for h in hosts.split(",") if h]) != 1:  # a single-host TPU VM needs no coordinator
            return DistributedSpec("tpu")
    return DistributedSpec("single")


def configure_cpu(cpu_devices: int = 0, collectives: str = "gloo"):
    """Before any JAX computation: N CPU devices per process, cross-process CPU collectives."""
    if cpu_devices and cpu_devices > 0:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if collectives:
        jax.config.update("jax_cpu_collectives_implementation", collectives)


def initialize(spec: DistributedSpec, initialization_timeout: int = 300) -> DistributedSpec:
    """Join the run described by ``spec`` (no-op for a single process)."""
    if spec.mode == "single":
        return spec
    jax.distributed.initialize(initialization_timeout=initialization_timeout,
                               **spec.initialize_kwargs)
    return spec


def is_initialized() -> bool:
    from jax._src import distributed as _dist  # no public query exists in jax 0.10

    return _dist.global_state.client is not None
