"""One training process per workdir, one writer per self-distillation output: advisory locks held for
the whole run.

Why: two ``launch.train`` runs on the same ``--workdir`` (a relaunch while the first is still
alive, a chained script started twice) both resume the latest checkpoint and then write the same
step directories, ``metrics.csv`` and ``config.json``; orbax renames each step atomically, but
which run's state ends up in ``checkpoints/<step>`` is a race, and the metrics files interleave.
Nothing fails — the run is silently corrupted. The lock makes the second launch stop at once with
the first one's pid.

``fcntl.flock`` on ``<workdir>/.lock.process_<i>``: the kernel drops the lock when the process
dies (a SIGKILL leaves no stale lock behind, so resuming a killed run needs no clean-up), and each
process of a multi-host run locks its own file, so the processes of one run never block each other
on a shared file system. (flock on NFS is advisory and may be local to the client; it guards the
common case, a second launch on the same host.) An object store has no lock at all: a ``gs://``
workdir runs unlocked and the run says so.

``output_lock``: the same for ``launch.generate_data``'s ``--output`` (``<output>.lock``): two resumes
of one output both skip the ids already written and then append the same conversations, interleaved
(ids c0..c3, c2, c3); the second now stops at once naming the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from typing import Iterator

from confu_jax import storage


class WorkdirLocked(RuntimeError):
    """Another live process is training in this workdir."""


class OutputLocked(ValueError):
    """Another live process is writing this output (a user's mistake: reported in one line)."""


def lock_path(workdir: str, process_index: int) -> str:
    return os.path.join(workdir, f".lock.process_{process_index}")


@contextlib.contextmanager
def workdir_lock(workdir: str, process_index: int = 0) -> Iterator[str]:
    """Hold ``workdir``'s lock for process ``process_index`` for the body; raise
    :class:`WorkdirLocked` (naming the holder's pid) if another process holds it.

    On an object store (``gs://``) there is no lock to take: the run says so in one line and goes on
    unlocked (starting a second run on the same workdir is then the user's to avoid)."""
    if storage.is_remote(workdir):
        logging.warning("%s is on an object store, which cannot be locked (no flock): this run holds no "
                        "workdir lock, so make sure no other run trains in it", workdir)
        yield ""
        return
    os.makedirs(workdir, exist_ok=True)
    path = lock_path(workdir, process_index)
    with _flock(path, lambda holder: WorkdirLocked(
            f"{workdir} is in use: another training process (pid {holder}) holds {path}. Wait for it to "
            f"finish or stop it (it checkpoints on SIGTERM), or use another --workdir.")):
        yield path


@contextlib.contextmanager
def output_lock(output: str) -> Iterator[str]:
    """Hold ``<output>.lock`` for the body (one writer per output file); raise :class:`OutputLocked`
    naming the holder's pid if another live process holds it. On an object store: unlocked, said once."""
    if storage.is_remote(output):
        logging.warning("%s is on an object store, which cannot be locked (no flock): make sure no other "
                        "process writes this output now", output)
        yield ""
        return
    path = f"{output}.lock"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _flock(path, lambda holder: OutputLocked(
            f"{output} is being written by another process (pid {holder}, holding {path}): wait for it to "
            "finish or stop it (a rerun resumes where it stopped), or write to another --output")):
        yield path


@contextlib.contextmanager
def _flock(path: str, busy) -> Iterator[None]:
    """flock ``path`` (created) with this process's pid in it; ``busy(holder_pid)`` is raised if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise busy(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
