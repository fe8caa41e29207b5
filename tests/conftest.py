import os

from xla_env import EIGHT_DEVICES

# 8 fake CPU devices for sharding tests, LLVM at -O1 capped at AVX2 (tests/xla_env.py says why); set
# before JAX initialises.
os.environ.setdefault("XLA_FLAGS", EIGHT_DEVICES)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


# The slowest test files, longest first (their summed --durations on a 2-core Zen 5 host, CI's command).
# With ``--dist loadfile`` a file runs whole on one worker, and xdist would hand files out largest test
# count first, which put the long few-test files (the documented recipe's three tests: ~5 minutes) at the
# very end with one core idle beside them. Longest first, then the rest in collection order, keeps both
# workers busy to the end. Keep it roughly true when a file's time changes by minutes; order is all it sets.
SLOWEST_FIRST = (
    "test_family_contract.py", "test_own_target.py", "test_gpu_campaign.py", "test_scale_memory.py",
    "test_confu_future.py", "test_multihost_tasks.py", "test_draft_model.py", "test_spec_bench.py",
    "test_generate_spec_cli.py", "test_loss.py", "test_spec_loop.py", "test_lookup.py", "test_accelerator_scale.py",
    "test_mlp_speculator.py", "test_confu_task.py", "test_scaling.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
