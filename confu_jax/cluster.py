"""Which cluster this process runs in, and which process of it this is — as JAX's own detection sees it.

``jax.distributed.initialize()`` with no arguments asks its cluster classes (``jax._src.clusters``),
in the order JAX declares them, whether they are present: Open MPI, SLURM (a job step's ``SLURM_*``),
a Cloud TPU VM on GCE (the metadata server's ``agent-worker-number`` / ``worker-network-endpoints`` /
``tpu-env``; only when JAX's hardware probe found TPU chips), a GKE TPU pod (``TPU_WORKER_ID`` /
``TPU_WORKER_HOSTNAMES``), Kubernetes (mpi4py, which JAX uses only when named, is skipped). :func:`detect`
asks the same classes, once, and keeps their answer, for two reasons:

* training (``train/distributed.py``) passes JAX exactly what was decided here, with JAX's own
  detection switched off, so the launch can be logged, tested without a cluster, and not re-decided
  inside ``initialize`` (which under SLURM would pin every process to one GPU);
* self-distillation (``data/distill_shards.py``) never joins a coordinator, yet needs its process
  index and count — on a TPU VM pod the metadata server is the only place they are written.

A lookup that fails (a metadata server that does not answer, a coordinator host that never resolves)
is a :class:`ClusterError`: one line naming the cluster and what was being asked.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional


class ClusterError(RuntimeError):
    """A detected cluster that cannot be read or joined: one line naming the cluster, the coordinator
    and what was expected; reported by the CLIs as a user's error (``user_errors.USER_ERRORS``)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an error, cut to `limit`: JAX and gRPC errors span many lines, ours one."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@dataclasses.dataclass(frozen=True)
class Detected:
    """A cluster JAX recognises, and this process's place in it."""

    env: type  # the jax._src.clusters.ClusterEnv subclass that said it is present
    process_id: int
    num_processes: int
    local_process_id: Optional[int]  # index among this host's processes, where the cluster says

    @property
    def name(self) -> str:
        return self.env.__name__

    def coordinator_address(self, timeout_s: int) -> str:
        """host:port of process 0, as JAX derives it (the first node of a SLURM step, worker 0 of a
        TPU slice or MEGASCALE_COORDINATOR_ADDRESS, ...); ``JAX_COORDINATOR_PORT`` overrides the port
        exactly as in ``jax.distributed.initialize``. A TPU worker waits up to ``timeout_s`` for the
        coordinator's host name to resolve."""
        port = os.environ.get("JAX_COORDINATOR_PORT")
        try:
            return self.env.get_coordinator_address(timeout_secs=timeout_s, override_coordinator_port=port)
        except Exception as e:  # noqa: BLE001 -- JAX's probes raise RuntimeError, requests' errors, ValueError
            raise ClusterError(f"{self.name}: could not find the coordinator (process 0) within "
                               f"{timeout_s} s: {one_line(e)}") from e


def detect() -> Optional[Detected]:
    """The cluster ``jax.distributed.initialize()`` would detect here, or None (a plain machine).

    Walks JAX's registered classes in JAX's order and skips the opt-in ones (mpi4py), as
    ``ClusterEnv.auto_detect_unset_distributed_params`` does; only the coordinator is left for later
    (:meth:`Detected.coordinator_address`): finding it may wait for a host name to resolve, and a
    process that only needs its index (self-distillation) never asks."""
    from jax._src import clusters  # JAX has no public API for its cluster detection (jax 0.10)

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            present = env.is_env_present()
        except Exception as e:  # noqa: BLE001 -- e.g. a TPU VM whose metadata server does not answer
            raise ClusterError(f"{env.__name__}: could not tell whether this is its cluster: "
                               f"{one_line(e)}") from e
        if not present:
            continue
        try:
            return Detected(env, int(env.get_process_id()), int(env.get_process_count()),
                            env.get_local_process_id())
        except Exception as e:  # noqa: BLE001
            raise ClusterError(f"{env.__name__}: detected, but its process id / count could not be "
                               f"read: {one_line(e)}") from e
    return None


# What launchers say about the job in the environment, read only to catch a launch JAX's detection
# missed: (variable holding the process count, variable holding this process's rank, launcher).
LAUNCHER_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI"),
    ("PMI_SIZE", "PMI_RANK", "a PMI launcher (MPICH / Intel MPI hydra)"),
    ("PMIX_SIZE", "PMIX_RANK", "a PMIx launcher"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM (an srun step)"),  # a step only: salloc's shell
)                                                                    # (SLURM_NTASKS alone) is one process


def launcher_processes(environ=None) -> Optional[tuple]:
    """(process count, this rank's variable, launcher) from the first launcher variable saying more than
    one process, or None."""
    env = os.environ if environ is None else environ
    for size, rank, who in LAUNCHER_VARIABLES:
        try:
            n = int(env.get(size, "") or 0)
        except ValueError:
            continue
        if n > 1:
            return n, rank, who
    return None


def check_not_missed(num_processes: int, what: str, environ=None) -> None:
    """Refuse a launch whose launcher started several processes while this one resolved to a single
    process: each would work alone on the whole job (train the same steps; generate every conversation),
    silently. Open MPI 5 is the case in point: JAX's Open MPI detection reads ``OMPI_MCA_orte_hnp_uri``,
    which Open MPI 5 no longer sets, so under ``mpirun -n 4`` every rank resolves to one process."""
    found = launcher_processes(environ)
    if num_processes != 1 or found is None:
        return
    n, rank, who = found
    raise ClusterError(
        f"{who} started {n} processes, but this one resolved to a single process (JAX's cluster detection "
        f"did not recognise the launch{'; Open MPI 5 no longer sets OMPI_MCA_orte_hnp_uri, which it reads' if who == 'Open MPI' else ''}): "
        f"each would {what} alone. Name the launch: --coordinator_address <host of rank 0>:<port> "
        f"--num_processes {n} --process_id ${rank} (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
        "JAX_PROCESS_ID)")
