"""``python -m launch.generate`` / ``launch.decode_bench`` flag handling (no model loaded)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    ("launch.generate", ["prompt", "model", "method", "max_new_tokens", "temperature", "top_p", "seed", "config",
                         "mesh", "attention_impl"]),
    ("launch.decode_bench", ["method", "model", "max_new_tokens", "n_prompts", "threads", "hf", "json_out", "mesh",
                             "attention_impl"]),
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


@pytest.mark.parametrize("args", [
    ["launch.generate", "--prompt", "Hi", "--attention_impl", "pallas"],
    ["launch.decode_bench", "--methods", "ar", "--attention_impl", "pallas", "--model", "no-such-model"],
    ["launch.decode_bench", "--attention_impl", "pallas", "--nohf", "--model", "no-such-model"],
])
def test_pallas_attention_is_refused_in_one_line_where_there_is_no_kernel(args):
    """On CPU the tree-attention kernel runs only under Pallas' interpreter (a test mode), so
    ``--attention_impl pallas`` stops with exit 2 and one line naming the value and the backend, before
    any model is loaded (the model named here does not exist)."""
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{args[0]}: --attention_impl pallas: the tree-attention kernel needs a CUDA GPU"), line
    assert "'cpu'" in line and "--attention_impl xla" in line and "no-such-model" not in r.stderr


def test_a_bad_mesh_is_one_line_in_decode_bench_as_in_generate():
    """decode_bench parses ``--mesh`` with launch.generate's parser (decode.sharded.parse_mesh): the
    same message, one line, before any model is loaded."""
    r = subprocess.run([sys.executable, "-m", "launch.decode_bench", "--methods", "ar", "--mesh", "model=2",
                        "--model", "no-such-model"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "launch.decode_bench: --mesh 'model=2': 'model=2' is not AXIS=SIZE"), r.stderr[-2000:]


def test_the_attention_flag_resolves_per_backend():
    """What ``--attention_impl`` becomes (``LlamaConfig.attention_impl``) on each backend: 'xla'
    everywhere, 'pallas' on a CUDA GPU only; any other value is refused naming the choices."""
    from confu_jax.bench.cli_args import decode_attention_impl

    assert [decode_attention_impl("xla", b) for b in ("cpu", "gpu", "tpu")] == ["xla"] * 3
    assert decode_attention_impl("pallas", "gpu") == "pallas"
    for backend in ("cpu", "tpu"):
        with pytest.raises(ValueError, match=f"--attention_impl pallas: .* this backend is '{backend}'") as e:
            decode_attention_impl("pallas", backend)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--attention_impl 'pallas_interpret': expected one of xla, pallas"):
        decode_attention_impl("pallas_interpret", "cpu")
