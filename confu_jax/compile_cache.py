"""JAX's persistent compilation cache for the command-line tools: compile once per machine.

Every CLI run compiles its programs again (the quickstart spends minutes in XLA on 2 cores, and
each new prompt bucket compiles one more program); the persistent cache stores each compiled
executable on disk under a key of the program, the compile options and the JAX/XLA versions, so
a later run of the same shapes loads it instead. ``CONFU_JAX_COMPILE_CACHE`` chooses the
directory (default ``~/.cache/confu_jax/jax_compile_cache``); ``off`` disables it.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

ENV = "CONFU_JAX_COMPILE_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "confu_jax", "jax_compile_cache")


def enable_compilation_cache(directory: Optional[str] = None, min_compile_secs: float = 1.0) -> Optional[str]:
    """Turn the persistent cache on (programs that took >= ``min_compile_secs`` to compile are
    stored) -> the directory used, or None when disabled (``directory`` or the env var 'off')."""
    directory = directory or os.environ.get(ENV) or DEFAULT_DIR
    if directory.strip().lower() == "off":
        return None
    directory = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    return directory
