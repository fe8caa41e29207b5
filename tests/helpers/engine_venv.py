"""The Python of a serving engine's own environment (vLLM's CPU build, tpu-inference), or a test failure
naming the command that makes it: the engine tests run those engines as subprocesses, never in ours."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def engine_python(env_var: str, default_dir: str, what: str, script: str) -> pathlib.Path:
    """``$env_var``'s venv (default ``<repo>/default_dir``)'s ``bin/python``; fails naming ``script``."""
    path = pathlib.Path(os.environ.get(env_var, ROOT / default_dir)) / "bin" / "python"
    if not path.exists():
        pytest.fail(f"{what} is not installed at {path.parent.parent}: run `bash {script}` (README command 2 and "
                    ".ci/run do), or deselect these tests with -m 'not engine'")
    return path
