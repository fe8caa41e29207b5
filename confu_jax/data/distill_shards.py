"""Self-distillation over many processes: which process answers which conversation, and the merge.

A node or a pod runs ``launch.generate_data`` once per process (host). The conversations are split by
a stable hash of their id (:func:`shard_of`), so the split depends on neither the input order nor
the history of process counts; each process appends its answers to its own shard file
(:func:`shard_output`) and resumes it after a kill (the CLI skips ids already written). No process
talks to another while generating — a slow host never times out a collective — and when a shard is
complete its process leaves a ``.done`` marker naming the ids it was given (:func:`mark_done`).
Process 0, after its own shard, waits for every marker that matches the current split and merges the
shards into the one output, in input order (:func:`merge_shards`); ``launch.release_data`` turns that
output into a release with its manifest.

Which process am I? :func:`process_slot`: explicit flags, else ``JAX_PROCESS_ID`` /
``JAX_NUM_PROCESSES``, else the process index and count of the cluster JAX's own detection finds
(``confu_jax/cluster.py``: a SLURM job step — inside ``srun``; an allocation's shell alone is one
process —, a Cloud TPU VM pod through the GCE metadata server, a GKE TPU pod, Open MPI), else one
process. The same detection decides how training joins (``train/distributed.py``), so a pod's
workers are the same slots for both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from typing import Callable, Optional, Sequence

from confu_jax import storage

log = logging.getLogger(__name__)

DONE_SUFFIX = ".done"


def shard_of(conv_id: str, num_shards: int) -> int:
    """Stable shard of a conversation (independent of input order and of the process count's history)."""
    return zlib.crc32(conv_id.encode()) % num_shards


def shard_output(output: str, shard_index: int, num_shards: int) -> str:
    """The file shard ``shard_index`` of ``num_shards`` appends to (``output`` itself for one shard)."""
    if num_shards == 1:
        return output
    root, ext = os.path.splitext(output)
    return f"{root}.shard-{shard_index:05d}-of-{num_shards:05d}{ext}"


def process_slot(shard_index: Optional[int] = None, num_shards: Optional[int] = None) -> tuple[int, int]:
    """(this process's shard, the number of shards): the flags when given, else ``JAX_PROCESS_ID`` /
    ``JAX_NUM_PROCESSES``, else the cluster JAX detects (no hand-kept list of launcher variables: a
    TPU VM pod's worker number lives in its metadata server, not in the environment), else (0, 1)."""
    env = os.environ
    if num_shards is not None or shard_index is not None:
        if num_shards is None or shard_index is None:
            raise ValueError("give both --shard_index and --num_shards, or neither (the launcher's "
                             "environment then decides)")
        pair = (int(shard_index), int(num_shards))
    elif env.get("JAX_NUM_PROCESSES") and env.get("JAX_PROCESS_ID"):
        pair = (int(env["JAX_PROCESS_ID"]), int(env["JAX_NUM_PROCESSES"]))
    else:
        from confu_jax import cluster

        found = cluster.detect()
        pair = (found.process_id, found.num_processes) if found is not None else (0, 1)
        if found is None:
            cluster.check_not_missed(1, "generate every conversation")
    if not (pair[1] >= 1 and 0 <= pair[0] < pair[1]):
        raise ValueError(f"shard {pair[0]} of {pair[1]}: expected 0 <= shard < shards")
    return pair


def ids_digest(ids: Sequence[str]) -> str:
    """A digest of a shard's assignment: a marker counts only for the split it was made for."""
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def mark_done(path: str, ids: Sequence[str], stats: dict) -> None:
    """``<path>.done``: shard ``path`` holds an answer for each of ``ids`` it could answer (written
    whole, ``storage.write_text``: a reader never sees half a marker, locally or on ``gs://``)."""
    storage.write_text(path + DONE_SUFFIX, json.dumps({"ids": ids_digest(ids), "n_ids": len(ids), "stats": stats}))


def is_done(path: str, ids: Sequence[str]) -> bool:
    try:  # a marker not there yet, or not readable now (a store's hiccup): poll again later
        return (storage.isfile(path + DONE_SUFFIX)
                and json.loads(storage.read_text(path + DONE_SUFFIX))["ids"] == ids_digest(ids))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def wait_for_shards(output: str, assignment: Sequence[Sequence[str]], poll_s: float = 5.0,
                    timeout_s: Optional[float] = None, sleep: Callable[[float], None] = time.sleep) -> None:
    """Block until every shard of ``assignment`` (ids per shard) has its matching marker."""
    n = len(assignment)
    t0 = time.time()
    while True:
        missing = [i for i, ids in enumerate(assignment) if not is_done(shard_output(output, i, n), ids)]
        if not missing:
            return
        if timeout_s is not None and time.time() - t0 > timeout_s:
            raise TimeoutError(f"shards {missing} of {n} did not finish within {timeout_s:.0f}s")
        log.info("waiting for shards %s of %d to finish", missing, n)
        sleep(poll_s)


def merge_shards(output: str, num_shards: int, order: Sequence[str], read_records) -> dict:
    """Every shard's records into ``output``, in ``order`` (the input's ids), written atomically;
    refuses a record id that appears twice. ``read_records(path)``: a shard file's complete records."""
    rank = {cid: i for i, cid in enumerate(order)}
    merged, seen = [], {}
    for i in range(num_shards):
        path = shard_output(output, i, num_shards)
        for rec in read_records(path):
            cid = str(rec["id"])
            if cid in seen:
                raise ValueError(f"record {cid!r} is in shard {seen[cid]} and shard {i}")
            if cid not in rank:
                raise ValueError(f"{path}: record {cid!r} is not in the input (a shard of another run?)")
            seen[cid] = i
            merged.append(rec)
    merged.sort(key=lambda r: rank[str(r["id"])])
    # whole: a tmp file renamed over (fsynced) locally, one upload on gs:// (storage.write_text)
    storage.write_text(output, "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in merged))
    return {"merged": len(merged), "shards": num_shards}
