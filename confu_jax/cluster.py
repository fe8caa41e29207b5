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
