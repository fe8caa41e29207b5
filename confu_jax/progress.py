"""Progress display for long phases: counted work gets a tqdm bar, uncounted work (compilation) a
ticking elapsed-time line. Both write to stderr only when it is a terminal (tqdm's ``disable=None``),
so logs and CI output get no carriage-return redraws; pass ``enabled=False`` to turn them off
(``train.progress_bar``, other processes than 0 of a multi-process run)."""

from __future__ import annotations

import contextlib
import threading

from tqdm import tqdm


def bar(total=None, *, desc: str, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr, on a terminal only (and never when ``enabled`` is False)."""
    return tqdm(total=total, desc=desc, disable=None if enabled else True, dynamic_ncols=True, **kwargs)


@contextlib.contextmanager
def phase(desc: str, enabled: bool = True, tick_s: float = 0.5):
    """``with phase("compiling the train step"):`` shows ``desc: 12s`` ticking while the block runs."""
    b = tqdm(total=None, desc=desc, disable=None if enabled else True, bar_format="{desc}: {elapsed}",
             dynamic_ncols=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(tick_s):
            b.refresh()

    t = threading.Thread(target=tick, daemon=True)
    if not b.disable:
        t.start()
    try:
        yield
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        b.close()
