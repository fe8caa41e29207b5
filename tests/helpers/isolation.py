"""Run a test body in a fresh interpreter (``multiprocessing`` spawn) and re-raise its failure here.

Why: jaxlib 0.10.2's XLA:CPU aborted (SIGABRT / SIGSEGV inside ``backend_compile_and_load``) while
compiling the layer-unrolled AR loop with the interpreted Pallas kernel, but only after ~400 other
tests had compiled their programs in the same process; the same test passes alone, with its own
file, and with every decode test file before it. A crash of the compiler takes the whole pytest
process (and CI) down with it, so the few end-to-end interpret-mode programs compile in a child
process. The assertions are unchanged: the child runs the same function and an AssertionError (or
any exception) comes back pickled and is raised in the test.
"""

from __future__ import annotations

import multiprocessing


def run_isolated(fn, *args):
    """``fn(*args)`` in a spawned child (module-level ``fn``, picklable args) -> its return value."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)
