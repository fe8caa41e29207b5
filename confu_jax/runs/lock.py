"""One training process per workdir: an advisory lock held for the whole run.

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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise WorkdirLocked(
                f"{workdir} is in use: another training process (pid {holder}) holds {path}. "
                f"Wait for it to finish or stop it (it checkpoints on SIGTERM), or use another "
                f"--workdir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
