"""``python -m launch.generate --method eagle3|confu|dflash|peagle|dspark|jetspec|dflash2|domino`` (DFlash and
P-EAGLE under DDTree's ``ddtree:`` plan, DSpark with a confidence-scheduled length, JetSpec under its
``accum_logp`` tree, DFlash2 and Domino under a tree whose children follow their parent): on a tiny random GGUF model (real chat
template and tokenizer path) the speculative output equals ``--method ar``'s greedy output token
for token, τ is printed, and a missing head is announced as random on stderr."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.tiny_chat_model import tiny_chat_gguf
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return tiny_chat_gguf(tmp_path_factory.mktemp("tiny"))


def _generate(model, *args):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "launch.generate", "--model", model, "--prompt",
                        "Hello world, 12345", "--max_new_tokens", "20", "--print_ids",
                        "--config.decode.top_p=1.0", "--temperature", "0", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ids = re.search(r"^ids: (.*)$", r.stderr, re.M).group(1).split()
    return r, [int(i) for i in ids]


@pytest.mark.slow
def test_speculative_cli_equals_ar_and_prints_tau(tiny_gguf):
    _, ar_ids = _generate(tiny_gguf, "--method", "ar")
    assert len(ar_ids) >= 2
    # one method for each plan syntax the CLI parses (every family's loop under every plan kind is
    # tests/contract/test_family_contract.py's, through the same decode_head and loop; P-EAGLE's and Domino's
    # DDTree runs here were DFlash's command again, ~10 s each)
    for method, tree in (("eagle3", "chain:3"), ("confu", "dynamic:3,3,8"), ("dflash", "ddtree:6,3"),
                         ("dspark", "chain:4@0.3"), ("jetspec", "accum_logp:6,2,3"), ("dflash2", "tree:2,2,1")):
        r, ids = _generate(tiny_gguf, "--method", method, "--plan", tree)
        assert ids == ar_ids, (method, tree)
        assert "UNTRAINED" in r.stderr
        tau = float(re.search(r"tau = ([0-9.]+) tokens per target pass over (\d+) passes", r.stderr).group(1))
        assert 1.0 <= tau <= 4.0 + 1e-6  # at most depth + 1 tokens per pass


@pytest.mark.slow
def test_bad_tree_and_bad_ckpt_fail_with_a_message(tiny_gguf, tmp_path):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    base = [sys.executable, "-m", "launch.generate", "--model", tiny_gguf, "--prompt", "Hi",
            "--max_new_tokens", "4", "--method", "eagle3"]
    r = subprocess.run(base + ["--tree", "chain"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "chain:K" in r.stderr
    r = subprocess.run(base + ["--draft_ckpt", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode != 0 and "config.json" in r.stderr


@pytest.mark.slow
def test_smollm2_speculative_cli_equals_ar():
    _, ar_ids = _generate("smollm2-135m-instruct", "--method", "ar")
    r, ids = _generate("smollm2-135m-instruct", "--method", "confu", "--tree", "dynamic:3,4,8")
    assert ids == ar_ids
    assert re.search(r"tau = [0-9.]+ tokens per target pass", r.stderr)


def test_quickstart_flags_documented():
    """launch.quickstart imports cleanly (no flag clashes with the modules it uses) and documents
    the flags that shrink it."""
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "launch.quickstart", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    for f in ("train", "train_steps", "n_prompts", "max_new_tokens", "plan", "tree", "cache", "out", "n_calibration"):
        line = next((ln for ln in r.stdout.splitlines()
                     if ln.strip().startswith((f"--{f}:", f"--[no]{f}:"))), None)
        assert line is not None and len(line.split(":", 1)[1].strip()) > 5, (f, r.stdout[-2000:], r.stderr[-2000:])
