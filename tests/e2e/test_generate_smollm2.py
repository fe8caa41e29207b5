"""Greedy jitted AR generation on the embedded SmolLM2-135M-Instruct equals Hugging Face
``generate`` (torch CPU, fp32, the same GGUF via ``gguf_file=``) token for token."""

import os

import numpy as np
import pytest

from confu_jax.assets import resolve
from confu_jax.data.chat import ChatTokenizer
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.stopping import StopReason
from confu_jax.weights import load_model

pytestmark = pytest.mark.slow

N_NEW = 40
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",  # open-ended: runs past 32 tokens
    "Explain in detail, step by step, how a bicycle's gears work and why cyclists shift them "
    "when riding uphill.",
]


@pytest.fixture(scope="module")
def setup():
    gguf = resolve("smollm2-135m-instruct")
    cfg, params = load_model("smollm2-135m-instruct")
    tok = ChatTokenizer.load(gguf)
    prompts = [tok.encode(tok.render([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in QUESTIONS]
    return cfg, params, tok, prompts


@pytest.fixture(scope="module")
def hf_greedy(setup):
    """Hugging Face greedy continuation of each prompt, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg, _, tok, prompts = setup
    gguf = resolve("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW,
                               do_sample=False, eos_token_id=list(tok.eos_ids),
                               pad_token_id=tok.pad_id)
            outs.append(y[0, len(p):].tolist())
    return outs


def _rows(res):
    toks, n_gen, why = (np.asarray(x) for x in res)
    return [toks[b, : n_gen[b]].tolist() for b in range(toks.shape[0])], why


def test_prompts_differ_in_length_and_hf_runs_long(setup, hf_greedy):
    _, _, _, prompts = setup
    assert len(prompts[0]) != len(prompts[1])
    assert all(len(h) >= 32 for h in hf_greedy), [len(h) for h in hf_greedy]


def test_greedy_batch1_equals_hf(setup, hf_greedy):
    cfg, params, tok, prompts = setup
    res = generate_ar(params, cfg, prompts[:1], max_new_tokens=N_NEW, eos_ids=tok.eos_ids)
    rows, why = _rows(res)
    assert rows[0] == hf_greedy[0], (tok.decode(rows[0]), tok.decode(hf_greedy[0]))
    expect = StopReason.EOS if len(hf_greedy[0]) < N_NEW else StopReason.MAX_NEW_TOKENS
    assert why[0] == expect


def test_greedy_batch2_different_lengths_equals_hf_per_prompt(setup, hf_greedy):
    cfg, params, tok, prompts = setup
    res = generate_ar(params, cfg, prompts, max_new_tokens=N_NEW, eos_ids=tok.eos_ids)
    rows, _ = _rows(res)
    for b in range(2):
        assert rows[b] == hf_greedy[b], (b, tok.decode(rows[b]), tok.decode(hf_greedy[b]))


def test_cli_prints_the_greedy_completion(setup, hf_greedy):
    """``python -m launch.generate`` end to end: chat template, default config, decode."""
    import subprocess
    import sys

    _, _, tok, _ = setup
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "launch.generate", "--prompt", QUESTIONS[0],
                        "--max_new_tokens", "12"], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == tok.decode(hf_greedy[0][:12], skip_special_tokens=True).strip()
    assert "generated 12 (stop: max_new_tokens)" in r.stderr and "tokens/s" in r.stderr
