"""ChatTokenizer: template rendering, assistant loss masks (ChatML and Llama-3), GGUF tokenizers.

Expected masks are built independently of ``encode_chat``'s prefix-rendering: the conversation
text is assembled by hand from each template's documented layout, the assistant spans are known
by construction, and transformers' own ``char_to_token`` maps them to tokens. One case also uses
transformers' ``apply_chat_template(return_assistant_tokens_mask=True)`` on a ChatML template
with ``{% generation %}`` tags.
"""


import pytest
from tokenizers import AddedToken, Tokenizer

from confu_jax.data.chat import ChatTokenizer
from tests.helpers.tiny_checkpoints import hf_llama, write_gguf
from tests.helpers.chat_cases import LLAMA3_SPECIALS, LLAMA3_TEMPLATE, expected_mask, llama3_text

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVS = {
    "two_turns": [
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "Now in words, ünïcödé 😀?"},
        {"role": "assistant", "content": "Forty-two! 😀\n\nThat's it."},
    ],
    "system_and_spaces": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": " hi there \n"},
    ],
    "code": [
        {"role": "user", "content": "Write a function."},
        {"role": "assistant", "content": "def f(x):\n    return x * 2\n"},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.fixture(scope="module")
def smol():
    return ChatTokenizer.load("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def llama3(smol, tmp_path_factory):
    """SmolLM2's vocabulary plus Llama-3's special tokens and template, loaded from an HF directory."""
    tok = Tokenizer.from_str(smol.tokenizer.to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    d = tmp_path_factory.mktemp("llama3tok")
    ChatTokenizer(tok, chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                  eos_token="<|end_of_text|>").save(str(d))
    return ChatTokenizer.load(str(d)), str(d)


def _chatml_text(messages, add_generation_prompt=False):
    """ChatML by hand; returns (text, assistant spans = content + <|im_end|>)."""
    text, spans = "", []
    if messages[0]["role"] != "system":
        text += f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text, spans


def _hf_fast(chat_tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(chat_tok.tokenizer.to_str()))


@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("gen", [False, True])
def test_chatml_mask_matches_hand_built(smol, conv, gen):
    msgs = CONVS[conv]
    text, spans = _chatml_text(msgs, gen)
    assert smol.render(msgs, add_generation_prompt=gen) == text
    ids, mask = smol.encode_chat(msgs, add_generation_prompt=gen)
    want_ids, want_mask = expected_mask(_hf_fast(smol), text, spans)
    assert ids == want_ids == smol.encode(text)
    assert mask == want_mask
    # Masked runs decode to exactly the assistant contents with their <|im_end|>.
    runs, cur = [], []
    for i, m in zip(ids, mask + [False]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(smol.decode(cur)), cur.clear()
    if cur:
        runs.append(smol.decode(cur))
    assert runs == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]


@pytest.mark.parametrize("conv", sorted(CONVS))
def test_llama3_mask_matches_hand_built(llama3, conv):
    tok, _ = llama3
    msgs = CONVS[conv]
    text, spans = llama3_text(msgs, "03 Feb 2025")
    assert tok.render(msgs, date_string="03 Feb 2025") == text
    ids, mask = tok.encode_chat(msgs, date_string="03 Feb 2025")
    want_ids, want_mask = expected_mask(_hf_fast(tok), text, spans)
    assert ids == want_ids
    assert mask == want_mask
    assert sum(mask) > 0


def test_llama3_special_ids(llama3):
    tok, _ = llama3
    eot, end = tok.token_id("<|eot_id|>"), tok.token_id("<|end_of_text|>")
    assert tok.bos_id == tok.token_id("<|begin_of_text|>")
    assert set(tok.eos_ids) == {end, eot}  # <|eot_id|> found from the template's end of turn
    assert tok.pad_id == end


def test_llama3_render_equals_transformers(llama3):
    from transformers import AutoTokenizer

    tok, d = llama3
    hf = AutoTokenizer.from_pretrained(d)
    msgs = CONVS["system_and_spaces"]
    for gen in (False, True):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, date_string="01 Jan 2026")
        assert tok.render(msgs, add_generation_prompt=gen, date_string="01 Jan 2026") == want
    # strftime_now is available to templates, as in transformers.
    assert tok.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)


def test_mask_equals_transformers_generation_tags(smol):
    """transformers' own assistant mask, from a ChatML template with {% generation %} tags."""
    tagged = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    ours = ChatTokenizer(Tokenizer.from_str(smol.tokenizer.to_str()), chat_template=tagged.replace(
        "{% generation %}", "").replace("{% endgeneration %}", ""), eos_token="<|im_end|>")
    hf = _hf_fast(smol)
    for msgs in CONVS.values():
        out = hf.apply_chat_template(msgs, chat_template=tagged, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = ours.encode_chat(msgs)
        assert ids == list(out["input_ids"])
        assert [int(m) for m in mask] == list(out["assistant_masks"])


def test_smollm_eos_and_bos(smol):
    assert smol.eos_ids == (smol.token_id("<|im_end|>"),) == (2,)
    assert smol.bos_id == 1 and smol.pad_id == 2


def test_assistant_first_conversation_is_refused(smol):
    with pytest.raises(ValueError, match="message 0 is an assistant turn before any user turn"):
        smol.encode_chat([{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}])


TEXTS = ["Hello world", " leading space, 12345 and 3.14159!", "ünïcödé — 😀 中文 emoji", "a\n\n  b\tc  ",
         "<|im_start|>user\nhi<|im_end|>", "the the weather 1212 ' s'll"]


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2"])
def test_gguf_tokenizer_matches_transformers(tmp_path, pre):
    """Tiny byte-level BPE GGUF: our ids equal transformers' GGUF tokenizer for the same pre-tokenizer."""
    from transformers import AutoTokenizer

    model = hf_llama(tmp_path / "hf", vocab=300, layers=1)
    path = tmp_path / "t.gguf"
    write_gguf(str(path), model, pre=pre, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ours = ChatTokenizer.load(str(path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for t in TEXTS:
        assert ours.encode(t) == hf(t, add_special_tokens=False)["input_ids"], t
        assert ours.decode(ours.encode(t)) == t


def test_gguf_smollm_pre_splits_digits(tmp_path):
    """'smollm' pre-tokenizer (SmolLM2's tokenizer.json): every digit is its own word, so the tiny
    vocabulary's '1 2' merge never fires; under plain GPT-2 splitting it does."""
    model = hf_llama(tmp_path / "hf", vocab=300, layers=1)
    for pre in ("smollm", "gpt2"):
        write_gguf(str(tmp_path / f"{pre}.gguf"), model, pre=pre)
    smol_tok = ChatTokenizer.load(str(tmp_path / "smollm.gguf"))
    gpt2_tok = ChatTokenizer.load(str(tmp_path / "gpt2.gguf"))
    twelve = smol_tok.token_id("12")
    assert twelve is not None and twelve in gpt2_tok.encode("x12")
    assert twelve not in smol_tok.encode("x12") and smol_tok.decode(smol_tok.encode("x12")) == "x12"
