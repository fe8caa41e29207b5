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
import re
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


def config_override_error(prog: str, e: Exception, argv=None) -> None:
    """Report ml_collections' AttributeError / KeyError for a key a locked config lacks as one line
    naming the override (``--config.decode.max_new_token=4``: "did you mean max_new_tokens") and exit 2.
    Also for a config flag with a default file, whose overrides ml_collections parses when the flag is
    defined (``launch.generate``): wrap that definition."""
    if os.environ.get("CONFU_JAX_TRACEBACK", "") not in ("", "0"):
        raise e
    argv = sys.argv if argv is None else argv
    msg = str(e.args[0] if e.args else e).replace("\\'", "'").replace("\\n", " ")
    msg = msg.replace("\n", " ").strip("'\" ")
    msg = re.sub(r"^'?([A-Za-z0-9_]+)'?\s*", r"'\1': ", msg, count=1)
    words = re.findall(r"[A-Za-z0-9_]+", msg)
    culprits = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.") and words
                and re.search(rf"\.{re.escape(words[0])}(\.|$)", a.split("=", 1)[0])]
    where = f" in {', '.join(culprits)}" if culprits else ""
    sys.stderr.write(f"{prog}: invalid config override{where}: {msg} (the config is locked: only "
                     f"existing keys can be set; see the config file given to --config)\n")
    sys.exit(2)


def flags_parser(prog: str):
    """absl's flag parsing for ``prog``, with config-override mistakes reported as one line naming the key
    (``app.run(..., flags_parser=flags_parser(prog))``; :func:`run` does it).

    ml_collections raises plain AttributeError/KeyError for a key a locked config lacks
    (``--config.decode.max_new_token=4``); left alone that is a traceback from deep inside the flag
    parser. Exit status 2, as for every other mistake (absl's own flag errors keep its 1)."""

    def parse(argv):
        from absl import flags

        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            sys.stderr.write(f"FATAL Flags parsing error: {e}\nPass --helpfull to see help on flags.\n")
            sys.exit(1)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            config_override_error(prog, e, argv)

    return parse


def run(prog: str, main) -> None:
    """``app.run`` for a ``launch`` module: :func:`cli_main` around ``main`` and :func:`flags_parser`."""
    from absl import app

    app.run(cli_main(prog, main), flags_parser=flags_parser(prog))
