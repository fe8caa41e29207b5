"""A user's mistake as one line, not a traceback: the boundary every command-line entry point draws.

What a user gets wrong — a flag's value, a plan a drafter cannot run, a path that is not a run, a
head of the wrong family, a release whose hash does not match — is raised in this package as
``ValueError`` / ``FileNotFoundError`` (``CheckpointError`` and ``AssetNotFoundError`` are subclasses)
with a message that says what was expected and what came (``storage.StorageError``: an object
store that cannot be reached; ``cluster.ClusterError``: a detected cluster whose coordinator cannot be
found or joined). :func:`one_line_errors` turns those into
``<prog>: <message>`` on stderr and exit status 2. Everything else (a crash in XLA, a bug that
raises ``TypeError``, ...) keeps its traceback, and ``CONFU_JAX_TRACEBACK=1`` keeps it for these too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

from confu_jax import storage
from confu_jax.cluster import ClusterError
from confu_jax.storage import StorageError

USER_ERRORS = (ValueError, FileNotFoundError, StorageError, ClusterError)


@contextlib.contextmanager
def one_line_errors(prog: str):
    try:
        yield
    except USER_ERRORS as e:
        if os.environ.get("CONFU_JAX_TRACEBACK", "") not in ("", "0"):
            raise
        message = str(e).strip().splitlines()
        sys.stderr.write(f"{prog}: {' '.join(m.strip() for m in message) or type(e).__name__}\n")
        sys.exit(2)


def cli_main(prog: str, main):
    """``main`` (an absl ``main(argv)``) with the user's mistakes reported as one line: what every
    ``launch`` module hands to ``app.run``. Before ``main`` starts, every ``gs://`` value on the
    command line is checked against the installed backend (``storage.require_backend``): without
    the cloud extra the command stops in one line before it has written anything."""

    @functools.wraps(main)
    def wrapped(argv):
        with one_line_errors(prog):
            for path in storage.remote_paths_in(sys.argv[1:]):
                storage.require_backend(path)
            return main(argv)

    return wrapped
