import os

# 8 fake CPU devices for sharding tests; must be set before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled executables after each test module. One pytest process compiles
    hundreds of XLA:CPU programs; with all of them alive, jaxlib 0.10.2 crashed (SIGSEGV/SIGABRT)
    in a later compile after ~400 tests, whichever test came next."""
    yield
    import jax

    jax.clear_caches()
