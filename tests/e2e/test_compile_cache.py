"""The CLIs' persistent compilation cache: a program compiled once is stored on disk and found by
the next process; 'off' stores nothing."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import jax, jax.numpy as jnp
from confu_jax.compile_cache import enable_compilation_cache
print("dir", enable_compilation_cache(min_compile_secs=0.0))
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
print("value", float(f(jnp.arange(64.0).reshape(8, 8) / 64)))
"""


def _run(env_value):
    env = dict(os.environ, CONFU_JAX_COMPILE_CACHE=env_value, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_cache_entries_are_written_and_reused(tmp_path):
    cache = tmp_path / "cache"
    first = _run(str(cache))
    entries = {e: os.stat(cache / e).st_mtime_ns for e in os.listdir(cache)}
    assert any(e.startswith("jit__lambda") for e in entries), entries
    second = _run(str(cache))
    # found by the second process: nothing compiled and stored again
    assert {e: os.stat(cache / e).st_mtime_ns for e in os.listdir(cache)} == entries
    assert first.splitlines()[-1] == second.splitlines()[-1]


def test_off_disables_it(tmp_path):
    assert "dir None" in _run("off")
