"""The embedded SmolLM2-135M-Instruct GGUF: our weights, tokenizer and template vs transformers
loading the same file (``gguf_file=``). Everything is loaded once per module."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.assets import resolve
from confu_jax.data.chat import ChatTokenizer
from confu_jax.models.llama import Llama
from confu_jax.models.presets import get_preset
from confu_jax.weights import load_model

pytestmark = pytest.mark.slow

CHAT = [
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Japan, in 2 words?"},
]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def ours(gguf_path):
    cfg, params = load_model("smollm2-135m-instruct")
    return cfg, params, ChatTokenizer.load(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


def test_config_matches_preset(ours):
    cfg, params, _ = ours
    assert cfg == get_preset("smollm2-135m").replace(rms_eps=cfg.rms_eps)
    assert cfg.rms_eps == pytest.approx(1e-5)


def test_logits_match_transformers_on_chat_prompt(ours, gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg, params, tok = ours
    ids = tok.encode(tok.render(CHAT, add_generation_prompt=True))
    assert 40 <= len(ids) <= 120
    x = jnp.asarray([ids])
    out = jax.jit(lambda p, x: Llama(cfg).apply({"params": p}, x, jnp.arange(x.shape[1])[None]))(params, x)
    mine = np.asarray(out.logits_btv[0])
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    err = np.abs(mine - ref).max()
    assert err <= 1e-3, f"max |logit diff| {err}"
    np.testing.assert_array_equal(mine.argmax(-1), ref.argmax(-1))


TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "Numbers: 12345, 3.14159, 1,000,000 and -42.",
    "ünïcödé — 😀 中文 русский العربية",
    "def f(x):\n\treturn x ** 2  # comment\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "it's I'm we'll they've DON'T",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers(ours, hf_tok, text):
    tok = ours[2]
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == hf_tok.decode(ids) == text


def test_special_ids_match_transformers(ours, hf_tok):
    tok = ours[2]
    assert tok.bos_id == hf_tok.bos_token_id
    assert hf_tok.eos_token_id in tok.eos_ids
    assert tok.pad_id == hf_tok.pad_token_id
    assert tok.vocab_size == len(hf_tok) == ours[0].vocab_size


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("with_system", [False, True])
def test_template_render_matches_apply_chat_template(ours, hf_tok, gen, with_system):
    tok = ours[2]
    msgs = ([{"role": "system", "content": "Be brief."}] if with_system else []) + CHAT
    want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.render(msgs, add_generation_prompt=gen) == want
    ids, mask = tok.encode_chat(msgs, add_generation_prompt=gen)
    assert ids == hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=True)["input_ids"]
    assert len(mask) == len(ids) and sum(mask) == len(tok.encode("The capital of France is Paris.")) + 1
