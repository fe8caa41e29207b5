import os

from tests.helpers.xla_env import EIGHT_DEVICES

# 8 fake CPU devices for sharding tests, LLVM at -O1 capped at AVX2 (tests/helpers/xla_env.py says why); set
# before JAX initialises.
os.environ.setdefault("XLA_FLAGS", EIGHT_DEVICES)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread in every OpenMP pool of the run: torch in the pytest processes (the transformers and speculators
# references), vLLM's CPU build and every other subprocess a test starts inherit it. README command 2 runs two
# xdist workers on two cores, so a worker has one core: a two-thread pool beside the other worker spins
# waiting for its descheduled thread and slows both. Measured side by side (docs/install.md, "OpenMP"): the
# vLLM engine tests beside a compile-bound companion 510 -> 336 s, the companion 323 -> 260 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests run on the CPU: JAX starts no other backend even where an accelerator plugin is installed
# (compiling for a topology, tests/compile, works with it set).
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _share_one_compilation_cache():
    """One persistent XLA compilation cache for the whole test run: both xdist workers, and every
    subprocess or spawned child a test starts, inherit it through the environment. Many test files
    compile the same programs (the SmolLM2 target's prefill and decode steps, the jitted loop at the
    same shapes); on 2 cores XLA:CPU compilation is most of the suite's time, so a program compiled
    once is loaded from disk by every later process instead. Created by the process that starts the
    run (the xdist controller, or a plain pytest) and removed when it exits; an already-set
    ``JAX_COMPILATION_CACHE_DIR`` is respected."""
    import atexit
    import shutil
    import tempfile

    if "JAX_COMPILATION_CACHE_DIR" in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return
    directory = tempfile.mkdtemp(prefix="confu_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("CONFU_JAX_COMPILE_CACHE", directory)  # the CLIs' own switch (compile_cache.py)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


_share_one_compilation_cache()


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled executables after each test module. One pytest process compiles
    hundreds of XLA:CPU programs; with all of them alive, jaxlib 0.10.2 crashed (SIGSEGV/SIGABRT)
    in a later compile after ~400 tests, whichever test came next."""
    yield
    import jax

    jax.clear_caches()


def _untracked_files() -> set:
    """Files under the repository that git neither tracks nor ignores (None outside a git checkout)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(filter(None, out.stdout.split("\0"))) if out.returncode == 0 else None


def pytest_sessionstart(session):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        session.config._confu_untracked = _untracked_files()


def pytest_sessionfinish(session, exitstatus):
    """A test writes under tmp_path, never into the checkout: files the run left there that git neither
    tracks nor ignores fail the run (a stray ``gs:/`` directory, from a gs:// URL taken as a local path,
    was once committed that way)."""
    before = getattr(session.config, "_confu_untracked", None)
    if "PYTEST_XDIST_WORKER" in os.environ or before is None:
        return
    after = _untracked_files() or set()
    new = sorted(after - before)
    if new:
        import sys

        print(f"\nthe test run wrote {len(new)} file(s) into the checkout (tests write under tmp_path): "
              f"{new[:10]}", file=sys.stderr)
        session.exitstatus = 1
