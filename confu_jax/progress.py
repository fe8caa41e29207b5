"""Progress display for long phases: counted work gets a tqdm bar, uncounted work (compilation) a
ticking elapsed-time line. Both write to stderr only when it is a terminal (tqdm's ``disable=None``),
so logs and CI output get no carriage-return redraws (a long phase prints a plain line there every 30 s
instead); pass ``enabled=False`` to turn them off
(``train.progress_bar``, other processes than 0 of a multi-process run)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from tqdm import tqdm


def bar(total=None, *, desc: str, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr, on a terminal only (and never when ``enabled`` is False)."""
    return tqdm(total=total, desc=desc, disable=None if enabled else True, dynamic_ncols=True, **kwargs)


@contextlib.contextmanager
def phase(desc: str, enabled: bool = True, tick_s: float = 0.5, log_every_s: float = 30.0):
    """``with phase("compiling the train step"):`` shows ``desc: 12s`` ticking while the block runs.
    Where stderr is not a terminal (a log, CI) a block that lasts prints ``desc: still running (30 s)``
    every ``log_every_s`` seconds instead, so a long compile is never a silent log."""
    b = tqdm(total=None, desc=desc, disable=None if enabled else True, bar_format="{desc}: {elapsed}",
             dynamic_ncols=True)
    stop = threading.Event()
    started = time.monotonic()

    def tick():
        while not stop.wait(tick_s):
            b.refresh()

    def log_line():
        while not stop.wait(log_every_s):
            print(f"{desc}: still running ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    t = None
    if not b.disable:
        t = threading.Thread(target=tick, daemon=True)
    elif enabled:
        t = threading.Thread(target=log_line, daemon=True)
    if t is not None:
        t.start()
    try:
        yield
    finally:
        stop.set()
        if t is not None:
            t.join()
        b.close()
