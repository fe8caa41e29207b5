"""Chat templates that render earlier turns differently from how they were generated, and template
kwargs, end to end on tiny checkpoints.

Two templates written here from their documented layouts: Qwen3's (``<|im_start|>role\\n…<|im_end|>``
turns; the reasoning block of every assistant turn before the last question dropped; an empty
``<think>\\n\\n</think>\\n\\n`` generation prompt when ``enable_thinking`` is false) on a tiny Qwen3, and
Meta's Llama-3.1 template (``<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>``, its
``date_string`` variable) on a tiny Llama. With each, through the real paths: a 3-turn conversation
is self-distilled by the continuous engine (what ``launch.generate_data`` runs), every answer being
the target's greedy answer to the prompt the template gives for that turn; the records reload and
name their template and kwargs; the training rows' loss mask covers exactly the assistant text of
the final rendering (built by hand from the layout, tokenised by transformers); two training steps
run on them; the trained head decodes the same prompts greedily to the AR tokens. A kwarg the
template does not read is one line naming it, from every command and from the training config.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from confu_jax.data.chat import ChatTokenizer
from tests.helpers.tiny_checkpoints import hf_llama, hf_qwen, write_hf_tokenizer
from tests.helpers.chat_cases import LLAMA3_SPECIALS, LLAMA3_TEMPLATE, expected_mask, llama3_text
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen3's template (tool branches left out) with its documented behaviours: turns as ChatML; an assistant
# turn's "<think>…</think>" is split off as its reasoning, which is rendered only for turns after the last
# user question (always for the last turn: an empty block); enable_thinking=false appends an empty block
# to the generation prompt, so the model answers without reasoning.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}\n"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "{%- set content = message.content %}\n"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{%- set reasoning_content = '' %}\n"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}\n"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
NO_THINK = "<think>\n\n</think>\n\n"
DATE = "01 Jan 2025"

CASES = {
    "qwen3": dict(template=QWEN3_TEMPLATE, kwargs={"enable_thinking": False}, eos="<|im_end|>", specials=(),
                  bos=None, unused="enable_thinkin"),
    "llama31": dict(template=LLAMA3_TEMPLATE, kwargs={"date_string": DATE}, eos="<|eot_id|>",
                    specials=tuple(s for s in LLAMA3_SPECIALS), bos="<|begin_of_text|>", unused="enable_thinking"),
}
TINY = dict(vocab=300, hidden=32, layers=8, heads=2, kv_heads=1, head_dim=16, ffn=64, max_pos=1024)
TURNS = [  # three questions per conversation; the answers are regenerated
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the weather in spring?"}],
    [{"role": "user", "content": "and in winter?"}],
    [{"role": "user", "content": "so which is better 12?"}],
]
N_NEW = 6


def _conversations():
    convs = []
    for i in range(2):
        msgs = []
        for turn in TURNS:
            msgs += [m for m in turn if i == 0 or m["role"] != "system"]
            msgs.append({"role": "assistant", "content": f"original answer {len(msgs)}"})
        convs.append({"id": f"c{i}", "messages": msgs})
    return convs


def _tokenizer_dir(directory, case):
    write_hf_tokenizer(directory, eos_token=case["eos"], chat_template=case["template"],
                       extra_specials=case["specials"], bos_token=case["bos"])
    return str(directory)


def qwen3_text(messages, thinking: bool):
    """Qwen3's layout by hand -> (text, spans of what the model generates in each assistant turn).

    Earlier turns lose their reasoning; the last keeps a reasoning block (empty when it has none). With
    thinking off the empty block is part of the generation prompt; with thinking on it is generated."""
    text, spans = "", []
    if messages[0]["role"] == "system":
        text, messages = f"<|im_start|>system\n{messages[0]['content']}<|im_end|>\n", messages[1:]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            continue
        content, reasoning = m["content"], ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        text += "<|im_start|>assistant\n"
        start = len(text)
        if i > last_user:
            text += f"<think>\n{reasoning}\n</think>\n\n"
            if not thinking and not reasoning:
                start = len(text)  # the empty block was the generation prompt
        text += content + "<|im_end|>"
        spans.append((start, len(text)))
        text += "\n"
    return text, spans


def _hand_built(name, messages):
    if name == "qwen3":
        return qwen3_text(messages, thinking=False)
    return llama3_text(messages, DATE)


def _hf_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


# ---------------------------------------------------------------------------------------- no model


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    return ChatTokenizer.load(_tokenizer_dir(tmp_path_factory.mktemp("qwen3tok"), CASES["qwen3"]))


THINKING = [  # data generated with thinking on: every answer has a reasoning block
    {"role": "user", "content": "Q one"},
    {"role": "assistant", "content": "<think>\nfirst thoughts\n</think>\n\nA one"},
    {"role": "user", "content": "Q two"},
    {"role": "assistant", "content": "<think>\nsecond\nthoughts\n</think>\n\nA two"},
    {"role": "user", "content": "Q three"},
    {"role": "assistant", "content": "<think>\nthird\n</think>\n\nA three"},
]


def test_qwen3_thinking_mask_drops_earlier_reasoning_and_keeps_the_last(qwen3_tok):
    """Thinking-on data: the final rendering has no reasoning for the first two answers (they are
    trained on their answer only) and the last answer's whole generated text, reasoning included.
    The template is not prefix-stable here (the case that used to raise)."""
    tok = qwen3_tok
    assert not tok.render(THINKING).startswith(tok.render(THINKING[:2]))  # earlier turns re-rendered
    text, spans = qwen3_text(THINKING, thinking=True)
    assert tok.render(THINKING) == text
    hf = _hf_tokenizer(tok.source)
    ids, mask = tok.encode_chat(THINKING)
    want_ids, want_mask = expected_mask(hf, text, spans)
    assert ids == want_ids and mask == want_mask
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "A one<|im_end|>A two<|im_end|><think>\nthird\n</think>\n\nA three<|im_end|>"


def test_qwen3_no_thinking_prompts_and_mask(qwen3_tok):
    """enable_thinking=false held by the tokenizer reaches every render: each turn's prompt ends with
    the empty reasoning block, and the last answer's mask starts after it (the target was given it)."""
    tok = ChatTokenizer.load(qwen3_tok.source, template_kwargs={"enable_thinking": False})
    answers = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}] * 3
    for k in (1, 3, 5):
        prompt = tok.decode(tok.encode_prompt(answers[:k]))
        assert prompt.endswith("<|im_start|>assistant\n" + NO_THINK)
        assert prompt.count("<think>") == 1  # earlier answers carry no block
    assert not qwen3_tok.decode(qwen3_tok.encode_prompt(answers[:1])).endswith(NO_THINK)  # no kwargs: thinks
    ids, mask = tok.encode_chat(answers)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "A<|im_end|>" * 3
    text, spans = qwen3_text(answers, thinking=False)
    assert (ids, mask) == expected_mask(_hf_tokenizer(tok.source), text, spans)
    assert tok.template_record() == {"sha256": hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest(),
                                     "kwargs": {"enable_thinking": False}}
    # a grain worker process (data.num_workers) reloads the tokenizer with the same kwargs
    import pickle

    from confu_jax.data import pipeline

    enc = pickle.loads(pickle.dumps(pipeline._Encode([{"messages": answers}], tok, 64, 1)))
    assert enc._tokenizer.template_kwargs == {"enable_thinking": False}
    assert enc.map(0)["tokens"].tolist() == (ids + [tok.pad_id] * 64)[:64]


def test_a_kwarg_the_template_does_not_read_is_one_line_naming_it(qwen3_tok):
    with pytest.raises(ValueError) as e:
        ChatTokenizer.load(qwen3_tok.source, template_kwargs={"enable_thinkin": False})
    msg = str(e.value)
    assert "\n" not in msg and "'enable_thinkin'" in msg
    assert msg.endswith("it uses: add_generation_prompt, enable_thinking, messages, reasoning_content"), msg
    from confu_jax.data.chat import parse_template_kwargs

    with pytest.raises(ValueError, match=r"--chat_template_kwargs='\[1\]' is a JSON list; expected an object"):
        parse_template_kwargs("[1]")
    with pytest.raises(ValueError, match="is not JSON"):
        parse_template_kwargs("{enable_thinking: false}")
    # the training config's field goes through the same check
    import ml_collections

    from confu_jax.train.real_data import training_tokenizer

    config = ml_collections.ConfigDict({"model": {"source": qwen3_tok.source},
                                        "data": {"chat_template_kwargs": '{"enable_thinkin": false}'}})
    with pytest.raises(ValueError, match="'enable_thinkin' is not used by the chat template"):
        training_tokenizer(config)


@pytest.mark.parametrize("module", ["launch.generate_data", "launch.generate", "launch.decode_bench"])
def test_every_command_refuses_an_unused_kwarg_in_one_line(module, qwen3_tok, tmp_path):
    """Before any weights load (the directory has none): non-zero exit, one line naming the kwarg and
    the variables the template reads."""
    args = {"launch.generate_data": ["--output", str(tmp_path / "out.jsonl"), "--input", "nothing.jsonl"],
            "launch.generate": ["--prompt", "hi"],
            "launch.decode_bench": ["--nohf"]}[module]
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", module, "--model", qwen3_tok.source, *args,
                        "--chat_template_kwargs", '{"enable_thinkin": false}'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if "enable_thinkin'" in x]
    assert len(lines) == 1 and lines[0].startswith(f"{module}: ") and r.stderr.strip().endswith(lines[0]), r.stderr
    assert "it uses: add_generation_prompt, enable_thinking, messages" in lines[0]


def test_records_generated_with_other_kwargs_are_counted(qwen3_tok):
    from confu_jax.train.real_data import warn_template_mismatch

    tok = ChatTokenizer.load(qwen3_tok.source, template_kwargs={"enable_thinking": False})
    convs = [{"id": "a", "messages": [], "chat_template": tok.template_record()},
             {"id": "b", "messages": [], "chat_template": qwen3_tok.template_record()},
             {"id": "c", "messages": []}]  # not generated here: nothing to compare
    assert warn_template_mismatch(convs, tok) == 1
    assert warn_template_mismatch(convs, qwen3_tok) == 1


# ---------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module", params=sorted(CASES))
def distilled(request, tmp_path_factory):
    """(name, tokenizer with the case's kwargs, target, the self-distilled records' path) for a tiny
    checkpoint of the template's family, regenerated by the continuous engine."""
    from confu_jax.decode.self_distill import regenerate_continuous
    from confu_jax.weights import load_model

    name, case = request.param, CASES[request.param]
    d = tmp_path_factory.mktemp(name)
    if name == "qwen3":
        hf_qwen(d, family="qwen3", seed=5, **TINY)
    else:
        hf_llama(d, seed=5, **TINY)
    _tokenizer_dir(d, case)
    tok = ChatTokenizer.load(str(d), template_kwargs=case["kwargs"])
    cfg, params = load_model(str(d))
    out = str(d / "distilled.jsonl")
    stats = regenerate_continuous(_conversations(), out, tok, cfg, params, batch_size=2, max_new_tokens=N_NEW,
                                  max_prompt_len=448, progress=False)
    assert stats["written"] == 2, stats
    return name, tok, (cfg, params), out


def _turn_prompts(tok, records):
    """The prompt the template gives for every assistant turn of ``records``, in order."""
    return [tok.encode_prompt(r["messages"][:i]) for r in records for i, m in enumerate(r["messages"])
            if m["role"] == "assistant"]


@pytest.mark.slow
def test_every_turn_is_the_greedy_answer_to_the_templates_prompt_for_it(distilled):
    from confu_jax.data.formats import load_conversations
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.stopping import StopReason

    name, tok, (cfg, params), out = distilled
    records, _ = load_conversations([out])
    assert [r["id"] for r in records] == ["c0", "c1"]
    assert all(r["chat_template"] == {"sha256": hashlib.sha256(CASES[name]["template"].encode()).hexdigest(),
                                      "kwargs": CASES[name]["kwargs"]} for r in records)
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) == 3 for r in records)
    prompts = _turn_prompts(tok, records)
    texts = [tok.decode(p) for p in prompts]
    if name == "qwen3":  # kwargs reached every prompt, and later prompts re-render the earlier turns
        assert all(t.endswith("<|im_start|>assistant\n" + NO_THINK) and t.count("<think>") == 1 for t in texts)
        assert not prompts[1][:len(prompts[0])] == prompts[0]
    else:
        assert all(f"Today Date: {DATE}\n" in t for t in texts)
    ar = generate_ar(params, cfg, prompts, max_new_tokens=N_NEW, eos_ids=tok.eos_ids)
    toks, n, reason = (np.asarray(x) for x in (ar.tokens_bn, ar.n_generated_b, ar.stop_reason_b))
    answers = [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]
    for b, answer in enumerate(answers):
        ids = toks[b, :n[b]].tolist()
        if reason[b] == StopReason.EOS:
            ids = ids[:-1]
        assert answer == tok.decode(ids), b
        assert not answer.startswith("original answer")


def test_training_rows_mask_exactly_the_assistant_text_of_the_final_rendering(distilled):
    """The rows the pipeline builds from the reloaded records: ids and loss mask equal the hand-built
    final rendering's, tokenised by transformers, with the mask on each answer and its end of turn."""
    from confu_jax.data import pipeline
    from confu_jax.data.formats import load_conversations

    name, tok, _, out = distilled
    hf = _hf_tokenizer(tok.source)
    records, _ = load_conversations([out])
    eot = CASES[name]["eos"]
    for r in records:
        text, spans = _hand_built(name, r["messages"])
        assert tok.render(r["messages"]) == text
        want_ids, want_mask = expected_mask(hf, text, spans)
        row = pipeline.encode_example(r["messages"], tok, max_length=len(want_ids) + 4)
        n = len(want_ids)
        assert row["tokens"][:n].tolist() == want_ids
        assert row["loss_mask"].tolist() == [False] + want_mask[1:] + [False] * 4
        masked = tok.decode([t for t, m in zip(want_ids, want_mask) if m])
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        if name == "llama31":
            answers = [a.strip() for a in answers]  # the template trims every turn
        assert masked == "".join(a + eot for a in answers)


@pytest.mark.slow
def test_two_training_steps_then_greedy_decoding_equals_ar(distilled, tmp_path):
    """``launch.train``'s loop on the records with ``data.chat_template_kwargs``: two steps, finite
    losses; the trained head decodes the template's prompts (same kwargs) to the AR tokens."""
    from configs.common import base_config
    from confu_jax.decode import loop
    from confu_jax.decode.families import decode_head, parse_drafter
    from confu_jax.decode.generate import generate_ar
    from confu_jax.data.formats import load_conversations
    from confu_jax.train.loop import train
    from confu_jax.train.metric_writers import read_csv

    name, tok, (cfg, params), out = distilled
    config = base_config(None, "eagle3")
    with config.unlocked():
        config.model.source = tok.source
        config.data.train_files = out
        config.data.chat_template_kwargs = json.dumps(CASES[name]["kwargs"])
        config.data.max_length = 256
        config.data.global_batch_size = 8
        config.objective.eval_records = 0
        config.train.steps = 2
        config.train.log_every = 1
        config.train.checkpoint.every = 0
        config.train.checkpoint.async_save = False
        config.train.progress_bar = False
        config.train.tensorboard = "off"
    workdir = str(tmp_path / "eagle3")
    train(config, workdir)
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    assert len(losses) == 2 and np.isfinite(losses).all(), rows

    records, _ = load_conversations([out])
    prompts = _turn_prompts(tok, records)[-2:]  # each conversation's last turn: its whole history re-rendered
    head = decode_head("eagle3", cfg, params, workdir)
    assert head.trained
    want = generate_ar(params, cfg, prompts, max_new_tokens=12, eos_ids=())
    got = loop.generate_speculative(head.target, parse_drafter("eagle3", "chain:3"), head.drafter_params, prompts,
                                    max_new_tokens=12, eos_ids=())
    rows_of = lambda res: [np.asarray(res.tokens_bn)[b, :int(np.asarray(res.n_generated_b)[b])].tolist()
                           for b in range(len(prompts))]
    assert rows_of(got) == rows_of(want) and all(len(r) == 12 for r in rows_of(want))


def test_the_kwargs_are_part_of_the_generation_recipe(tmp_path):
    """``generate_data`` records the kwargs and the template's hash with its settings; a release holds
    one recipe, so other kwargs are another release, while a release or run recorded before either
    existed counts as no kwargs and any template."""
    from confu_jax.data.releases import recipe_differences
    from confu_jax.decode.self_distill import recorded_settings
    from launch import generate_data as gd

    out = str(tmp_path / "o.jsonl")
    gd.record_run(out, ["generate_data.py", "--output", out, "--chat_template_kwargs", '{"enable_thinking": false}'],
                  "ab" * 32)
    settings = recorded_settings([out])
    assert settings["chat_template_kwargs"] == {"enable_thinking": False}
    assert settings["chat_template_sha256"] == "ab" * 32
    old = {k: v for k, v in settings.items() if not k.startswith("chat_template")}  # recorded before both
    assert recipe_differences(old, settings) == {"chat_template_kwargs": ({}, {"enable_thinking": False})}
    assert recipe_differences(old, {**settings, "chat_template_kwargs": {}}) == {}
    assert recipe_differences(settings, {**settings, "chat_template_sha256": "cd" * 32}) == {
        "chat_template_sha256": ("ab" * 32, "cd" * 32)}
