"""Self-distillation (launch.generate_data): turn-by-turn regeneration, resume after a kill."""

import json

import jax
import numpy as np
import pytest

from confu_jax.decode import self_distill as sd
from tests.helpers.fake_chat import END, FakeChatTokenizer
from tests.helpers.xla_env import SINGLE_DEVICE


def _conv(i, turns):
    msgs = [{"role": "system", "content": "sys"}] if i % 3 == 0 else []
    for t in range(turns):
        msgs += [
            {"role": "user", "content": f"q{i} turn {t}"},
            {"role": "assistant", "content": f"original answer {i} {t}"},
        ]
    return {"id": f"r{i}", "messages": msgs}


class ScriptedGenerate:
    """A generate_fn whose answer encodes the prompt it saw: [len(prompt), 7, END]."""

    def __init__(self):
        self.prompts = []

    def __call__(self, prompts, seed):
        self.prompts.append([list(p) for p in prompts])
        b = len(prompts)
        tokens = np.full((b, 5), -1, np.int32)
        tokens[:, 0] = [len(p) for p in prompts]
        tokens[:, 1] = 7
        tokens[:, 2] = END
        return tokens, np.full((b,), 3), np.ones((b,), bool)


def test_regenerate_batch_conditions_each_turn_on_the_regenerated_answers():
    tok, gen = FakeChatTokenizer(), ScriptedGenerate()
    convs = [_conv(0, 2), _conv(1, 1)]
    convs[1]["messages"].append({"role": "user", "content": "trailing question"})
    out = sd.regenerate_batch(convs, tok, gen, batch_size=3, max_prompt_len=1000)
    # Call 1: both first turns (+ one padding row); call 2: only conversation 0's second turn.
    assert len(gen.prompts) == 2 and all(len(p) == 3 for p in gen.prompts)
    ctx0 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q0 turn 0"}]
    assert gen.prompts[0][0] == tok.encode_chat(ctx0, add_generation_prompt=True)[0]
    ans0 = f"t{len(gen.prompts[0][0])} t7"  # END stripped: the template adds it back
    ctx0b = ctx0 + [{"role": "assistant", "content": ans0}, {"role": "user", "content": "q0 turn 1"}]
    assert gen.prompts[1][0] == tok.encode_chat(ctx0b, add_generation_prompt=True)[0]
    assert out[0] == {
        "id": "r0",
        "conversations": ctx0b + [{"role": "assistant", "content": f"t{len(gen.prompts[1][0])} t7"}],
    }
    # The trailing user turn (no answer to regenerate) is dropped.
    assert [m["role"] for m in out[1]["conversations"]] == ["user", "assistant"]


def test_an_empty_answer_ends_the_conversation_before_its_turn():
    """The target ending its turn at once gives no example (and an empty turn is not a usable record):
    the conversation keeps the answers before that turn, or is not written when it is the first; both
    engines alike."""
    tok = FakeChatTokenizer()

    class EmptySecondTurn(ScriptedGenerate):
        def __call__(self, prompts, seed):
            tokens, n, eos = super().__call__(prompts, seed)
            if len(self.prompts) == 2:  # the second call: every row answers END at once
                tokens[:, 0], n[:] = END, 1
            return tokens, n, eos

    convs = [_conv(0, 2), _conv(1, 1)]
    out = sd.regenerate_batch(convs, tok, EmptySecondTurn(), batch_size=2, max_prompt_len=1000)
    assert [m["role"] for m in out[0]["conversations"]] == ["system", "user", "assistant"]
    assert out[0]["conversations"][-1]["content"] != ""
    out = sd.regenerate_batch([_conv(2, 1)], tok, lambda p, s: (np.full((1, 2), END, np.int32), np.ones(1, int),
                                                                  np.ones(1, bool)), batch_size=1, max_prompt_len=1000)
    assert out == [None]
    conv = sd.Conversation(_conv(0, 2))
    assert conv.next_prompt(tok, 1000) is not None
    conv.add_answer([7, END], True, tok)
    assert conv.next_prompt(tok, 1000) is not None
    conv.add_answer([END], True, tok)
    assert conv.next_prompt(tok, 1000) is None
    assert [m["role"] for m in conv.record()["conversations"]] == ["system", "user", "assistant"]


def test_prompt_limit_keeps_earlier_answers_and_drops_answerless_records():
    tok, gen = FakeChatTokenizer(), ScriptedGenerate()
    convs = [_conv(1, 2), {"id": "long", "messages": [
        {"role": "user", "content": "w " * 50}, {"role": "assistant", "content": "a"}]}]
    first_len = len(tok.encode_chat(convs[0]["messages"][:1], add_generation_prompt=True)[0])
    out = sd.regenerate_batch(convs, tok, gen, batch_size=2, max_prompt_len=first_len + 2)
    assert len(out[0]["conversations"]) == 2  # second turn's prompt is over the limit
    assert out[1] is None


def test_read_done_ids_cuts_a_torn_last_line_and_refuses_foreign_files(tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_bytes(b'{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}\n{"id": "c", "conv')
    assert sd.read_done_ids(str(p)) == {"a", "b"}
    assert p.read_bytes().endswith(b'"b", "conversations": []}\n')
    p.write_bytes(b'{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"o\.jsonl:2: not a generated record"):
        sd.read_done_ids(str(p))
    assert sd.read_done_ids(str(tmp_path / "missing.jsonl")) == set()


class Killed(Exception):
    pass


@pytest.mark.slow
def test_resume_after_kill_on_tiny_model_has_no_duplicates_or_gaps(tmp_path):
    from confu_jax.models.llama import init_params
    from confu_jax.models.presets import get_preset

    cfg = get_preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0))
    tok = FakeChatTokenizer()
    real = sd.make_generate_fn(params, cfg, max_new_tokens=4, temperature=0.0, top_p=1.0,
                               eos_ids=tok.eos_ids, min_bucket=32)  # one bucket: one compile
    convs = [_conv(i, 1 + i % 2) for i in range(7)]
    kw = dict(batch_size=2, max_prompt_len=200, progress=False)

    ref_path = tmp_path / "ref.jsonl"
    stats = sd.generate_dataset(convs, str(ref_path), tok, real, **kw)
    assert stats == {"already_done": 0, "written": 7, "no_answer": 0, "duplicates": 0}

    calls = [0]

    def dying(prompts, seed):
        calls[0] += 1
        if calls[0] == 4:  # batches are [r0 r1] (2 turns: calls 1-2), [r2 r3] (calls 3-4)
            raise Killed
        return real(prompts, seed)

    out = tmp_path / "out.jsonl"
    with pytest.raises(Killed):
        sd.generate_dataset(convs, str(out), tok, dying, **kw)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["r0", "r1"]
    with open(out, "a") as f:  # a kill in the middle of a write leaves a torn line
        f.write('{"id": "r2", "conversations": [{"role": "us')
    stats = sd.generate_dataset(convs + [convs[3]], str(out), tok, real, **kw)
    assert stats == {"already_done": 2, "written": 5, "no_answer": 0, "duplicates": 1}
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in got] == [f"r{i}" for i in range(7)]
    # Greedy and the same batches: the resumed file equals an uninterrupted run's.
    assert got == [json.loads(line) for line in ref_path.read_text().splitlines()]
    # Every assistant turn was regenerated (fake decode yields 't<id>' words), users kept verbatim.
    for r, c in zip(got, convs):
        orig_users = [m for m in c["messages"] if m["role"] != "assistant"]
        assert [m for m in r["conversations"] if m["role"] != "assistant"] == orig_users
        answers = [m["content"] for m in r["conversations"] if m["role"] == "assistant"]
        assert len(answers) == 1 + int(c["id"][1:]) % 2
        assert all(a.split() and all(w.startswith("t") for w in a.split()) for a in answers)
    # Rerunning a finished file does nothing.
    assert sd.generate_dataset(convs, str(out), tok, real, **kw)["written"] == 0


@pytest.mark.slow
def test_cli_on_smollm2_writes_the_targets_greedy_answers(tmp_path):
    """End to end: the CLI's answers are SmolLM2's greedy continuations (teacher-forced argmax)."""
    import os
    import subprocess
    import sys

    import jax.numpy as jnp

    from confu_jax import assets
    from confu_jax.models.llama import Llama

    try:
        assets.resolve("smollm2-135m-instruct")
    except assets.AssetNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "regen.jsonl"
    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specforge.jsonl")
    cmd = [sys.executable, "-m", "launch.generate_data", f"--output={out}", f"--input={fixture}",
           "--max_records=2", "--max_new_tokens=12", "--batch_size=2"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # one device: the suite's 8 fake CPU devices would each hold a SmolLM2 replica and an engine
    # (every-device generation: tests/e2e/test_distill_shards.py)
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["written"] == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["sf_1", "sf_2"]

    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    tok = ChatTokenizer.load("smollm2-135m-instruct")
    cfg, params = load_model("smollm2-135m-instruct")
    for r in records:
        ids, mask = tok.encode_chat(r["conversations"])
        ids_t = jnp.asarray([ids], jnp.int32)
        logits = Llama(cfg).apply({"params": params}, ids_t, jnp.arange(len(ids))[None]).logits_btv[0]
        pred = np.asarray(jnp.argmax(logits, -1))
        answer_pos = [i for i, m in enumerate(mask) if m]
        n_answer = len(answer_pos)
        assert 1 < n_answer <= 12 + 1
        # Each answer token (through <|im_end|> when the target chose to stop) is the argmax.
        last = answer_pos[-1]
        stopped = ids[last] in tok.eos_ids and n_answer <= 12
        check = answer_pos if stopped else answer_pos[:-1]
        assert all(pred[i - 1] == ids[i] for i in check), (r["id"], tok.decode([ids[i] for i in answer_pos]))


@pytest.mark.slow
def test_continuous_engine_resumes_after_kill_and_matches_the_static_engine(tmp_path):
    """The continuous-batching path writes the same records as the static one (greedy), in input
    order, and a kill mid-run resumes with no duplicate and no gap."""
    from confu_jax.decode.continuous import ContinuousGenerator
    from confu_jax.models.llama import init_params
    from confu_jax.models.presets import get_preset

    cfg = get_preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0))
    tok = FakeChatTokenizer()
    convs = [_conv(i, 1 + i % 3) for i in range(9)]
    convs.append({"id": "long", "messages": [{"role": "user", "content": "w " * 300},
                                             {"role": "assistant", "content": "a"}]})
    static = sd.make_generate_fn(params, cfg, max_new_tokens=4, temperature=0.0, top_p=1.0,
                                 eos_ids=tok.eos_ids, min_bucket=32)
    ref = tmp_path / "static.jsonl"
    sd.generate_dataset(convs, str(ref), tok, static, batch_size=3, max_prompt_len=200, progress=False)

    def engine():
        return ContinuousGenerator(params, cfg, batch=3, max_len=204, max_new_tokens=4, eos_ids=tok.eos_ids,
                                   steps_per_sync=2, min_bucket=32)

    class Dying:
        """The engine, killed after its 5th finished request."""

        def __init__(self):
            self.inner, self.batch = engine(), 3

        def run(self, requests, more=None):
            for i, fin in enumerate(self.inner.run(requests, more)):
                if i == 5:
                    raise Killed
                yield fin

    out = tmp_path / "cont.jsonl"
    with pytest.raises(Killed):
        sd.generate_dataset_continuous(convs, str(out), tok, Dying(), max_prompt_len=200, progress=False)
    partial = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert partial == [c["id"] for c in convs[:len(partial)]]  # an input-order prefix
    stats = sd.generate_dataset_continuous(convs + [convs[1]], str(out), tok, engine(), max_prompt_len=200,
                                           progress=False)
    assert stats == {"already_done": len(partial), "written": 9 - len(partial), "no_answer": 1, "duplicates": 1}
    assert out.read_text() == ref.read_text()
    from confu_jax.data.distill_shards import shard_of, shard_output

    assert shard_output("d/x.jsonl", 2, 4) == "d/x.shard-00002-of-00004.jsonl"
    assert sorted({shard_of(c["id"], 3) for c in convs}) == [0, 1, 2]


def test_first_questions_keeps_the_first_question_that_fits():
    """What the quickstart self-distils: each conversation cut to the turns before its first answer
    (plus that answer, which the target replaces), long prompts and answerless records skipped."""
    tok = FakeChatTokenizer()
    convs = [_conv(i, turns=2) for i in range(6)]
    convs[1]["messages"][0]["content"] = "a very long question " * 40
    convs.insert(2, {"id": "no-answer", "messages": [{"role": "user", "content": "hi"}]})
    limit = max(len(tok.encode_chat(c["messages"][:2 if i % 3 else 3], add_generation_prompt=True)[0])
                for i, c in enumerate(convs) if c["id"] in ("r0", "r2"))
    got = sd.first_questions(convs, tok, limit, n=3)
    assert [c["id"] for c in got] == ["r0", "r2", "r3"]
    for c in got:
        src = next(s for s in convs if s["id"] == c["id"])["messages"]
        k = next(i for i, m in enumerate(src) if m["role"] == "assistant")
        assert c["messages"] == src[: k + 1]  # question, its context and the first answer only
        assert len(tok.encode_chat(src[:k], add_generation_prompt=True)[0]) <= limit
    assert [c["id"] for c in sd.first_questions(convs, tok, limit, n=10)][-1] == "r5"


def test_keep_turns_cuts_after_the_nth_answer():
    c = _conv(3, turns=3)  # system + 3 x (user, assistant)
    assert sd.keep_turns(c, 0) is c and sd.keep_turns(c, 5) is c
    one = sd.keep_turns(c, 1)["messages"]
    assert [m["role"] for m in one] == ["system", "user", "assistant"]
    two = sd.keep_turns(c, 2)["messages"]
    assert two == c["messages"][:5] and len(c["messages"]) == 7  # the input is not modified


def test_continuous_progress_log_counts_finished_conversations(tmp_path, monkeypatch, caplog):
    """Without a terminal (no bar) the once-a-minute log line says how many conversations are done
    (a disabled tqdm bar counts nothing: the line said 0 for a whole run)."""
    import logging
    import time

    from tests.helpers.fake_chat import InstantEngine as Instant

    clock = iter(range(0, 10_000, 61))  # every reading a minute after the last: a log line each time
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    convs = [_conv(i, 1) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="self_distill"):
        stats = sd.generate_dataset_continuous(convs, str(tmp_path / "o.jsonl"), FakeChatTokenizer(), Instant(),
                                               max_prompt_len=200, progress=True)
    assert stats["written"] == 4
    counts = [r.args[0] for r in caplog.records if "conversations done" in r.getMessage()]
    assert counts and counts == sorted(counts) and counts[-1] == 4
    assert all(r.args[1] == 4 for r in caplog.records if "conversations done" in r.getMessage())
