"""``python -m launch.generate`` / ``launch.decode_bench`` flag handling (no model loaded)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("module,flags", [
    ("launch.generate", ["prompt", "model", "method", "max_new_tokens", "temperature", "top_p", "seed", "config"]),
    ("launch.decode_bench", ["method", "model", "max_new_tokens", "n_prompts", "threads", "hf", "json_out"]),
])
def _flag_help(stdout, flag):
    """The help text of ``--flag``: its line plus the deeper-indented lines absl wraps it onto, with
    an enum's ``<a|b|...>:`` option list removed (a long list pushes the text onto the next lines)."""
    lines = stdout.splitlines()
    for i, ln in enumerate(lines):
        head = ln.strip()
        if head.startswith((f"--{flag}:", f"--[no]{flag}:")):
            indent = len(ln) - len(ln.lstrip())
            block = [head.split(":", 1)[1]]
            for nxt in lines[i + 1:]:
                if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt.strip())
            return re.sub(r"^\s*<[^>]*>:", "", " ".join(block)).strip()
    return None


@pytest.mark.parametrize("module,flags", [
    ("launch.generate", ["prompt", "model", "method", "max_new_tokens", "temperature", "top_p", "seed", "config"]),
    ("launch.decode_bench", ["method", "model", "max_new_tokens", "n_prompts", "threads", "hf", "json_out"]),
])
def test_help_documents_every_flag(module, flags):
    r = _run(module, "--help")  # absl prints the help to stdout and exits with status 1
    assert "flags:" in r.stdout, r.stderr
    for f in flags:
        text = _flag_help(r.stdout, f)
        assert text is not None and len(text) > 5, f"--{f} undocumented: {text!r}"


def test_misspelt_config_field_and_unknown_method_fail_loudly():
    r = _run("launch.generate", "--prompt", "Hi", "--config.decode.max_new_token=3")
    assert r.returncode != 0 and "max_new_token" in r.stderr
    r = _run("launch.generate", "--prompt", "Hi", "--method", "eagle9")
    assert r.returncode != 0 and "ar" in r.stderr
