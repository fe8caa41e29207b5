"""Benchmark prompt loaders on the real wheel files, a Spec-Bench-format fixture and broken files."""

import gzip
import json
import os
import re

import pytest

from confu_jax import assets
from confu_jax.bench import prompts as P

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specbench_sample.jsonl")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mtbench_wheel_file_is_the_80_question_set():
    path = assets.resolve("mtbench")
    assert path.endswith(os.path.join("mt_bench", "question.jsonl"))
    qs = P.load_mtbench()
    assert len(qs) == 80
    assert P.categories(qs) == list(P.MTBENCH_CATEGORIES)
    for c in P.MTBENCH_CATEGORIES:
        assert sum(q.category == c for q in qs) == 10
    assert all(len(q.turns) == 2 for q in qs)
    assert [q.question_id for q in qs] == list(range(81, 161))
    # content equals the raw file, independently parsed
    with open(path) as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert [list(q.turns) for q in qs] == [r["turns"] for r in raw]


def test_humaneval_wheel_file_has_164_instruction_wrapped_prompts():
    qs = P.load_humaneval()
    assert len(qs) == 164
    assert {q.category for q in qs} == {"humaneval"}  # its own category, not MT-Bench's coding
    assert qs[0].question_id == "HumanEval/0" and qs[-1].question_id == "HumanEval/163"
    with gzip.open(assets.resolve("humaneval"), "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    for q, r in zip(qs, raw):
        assert q.turns == (P.HUMANEVAL_INSTRUCTION + r["prompt"],)
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in qs[0].turns[0]


def test_specbench_fixture_loads_exactly():
    qs = P.load_question_file(FIXTURE)
    with open(FIXTURE) as f:
        raw = [json.loads(line) for line in f]
    assert [(q.question_id, q.category, list(q.turns)) for q in qs] == \
        [(r["question_id"], r["category"], r["turns"]) for r in raw]
    assert P.categories(qs) == ["translation", "summarization", "qa", "math_reasoning", "rag",
                                "writing"]


def test_load_prompts_combines_sources_and_rejects_unknown():
    qs = P.load_prompts(f"mtbench+{FIXTURE}")
    assert len(qs) == 90
    with pytest.raises(P.QuestionFileError, match="share question_id"):
        P.load_prompts(f"{FIXTURE}+{FIXTURE}")
    with pytest.raises(P.QuestionFileError, match="neither a named set"):
        P.load_prompts("no_such_set")
    assert len(P.load_prompts("mtbench+humaneval")) == 244
    # the headline set: all 80 MT-Bench questions + HumanEval's first 20, everything kept with n = 0
    head = P.sample_prompts(P.load_prompts("mtbench+humaneval:20"), 0)
    assert len(head) == 100 and [q.question_id for q in head[80:]] == [f"HumanEval/{i}" for i in range(20)]
    assert P.categories(head)[-1] == "humaneval"
    for bad in ("humaneval:0", "humaneval:x"):
        with pytest.raises(P.QuestionFileError, match="positive integer"):
            P.load_prompts(bad)


GOOD = '{"question_id": 1, "category": "qa", "turns": ["Why?"]}'


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question_id": 2, "category": "qa", "turns": ["x"]', "invalid JSON"),
        ('[1, 2]', "expected a JSON object"),
        ('{"question_id": 2, "turns": ["x"]}', r"missing key\(s\) \['category'\]"),
        ('{"question_id": 2, "category": "qa", "turns": "x"}', "turns must be a non-empty list"),
        ('{"question_id": 2, "category": "qa", "turns": []}', "turns must be a non-empty list"),
        ('{"question_id": 2, "category": "qa", "turns": ["ok", 3]}', r"turns\[1\] must be"),
        ('{"question_id": 2, "category": "", "turns": ["x"]}', "category must be"),
        ('{"question_id": true, "category": "qa", "turns": ["x"]}', "question_id must be"),
        ('{"question_id": 1, "category": "qa", "turns": ["x"]}', "duplicate question_id 1"),
    ],
)
def test_malformed_question_file_error_names_the_line(tmp_path, bad_line, message):
    path = tmp_path / "specbench_bad.jsonl"
    # line 1 good, line 2 blank (still counted), line 3 the bad one
    path.write_text(GOOD + "\n\n" + bad_line + "\n")
    with pytest.raises(P.QuestionFileError) as e:
        P.load_question_file(path)
    assert str(e.value).startswith(f"{path}:3: ")
    assert re.search(message, str(e.value))


def test_empty_or_missing_question_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(P.QuestionFileError, match="no questions"):
        P.load_question_file(empty)
    with pytest.raises(P.QuestionFileError, match="not found"):
        P.load_question_file(tmp_path / "missing.jsonl")


def test_sample_prompts_is_seeded_per_category_subset():
    qs = P.load_mtbench()
    a = P.sample_prompts(qs, 3, seed=0)
    assert a == P.sample_prompts(qs, 3, seed=0)
    assert len(a) == 24
    assert all(sum(p.category == c for p in a) == 3 for c in P.MTBENCH_CATEGORIES)
    # a subsequence of the input, in input order
    pos = [qs.index(p) for p in a]
    assert pos == sorted(pos)
    assert P.sample_prompts(qs, 3, seed=1) != a
    # categories smaller than n keep everything
    fx = P.load_question_file(FIXTURE)
    assert P.sample_prompts(fx, 5, seed=3) == fx
    one = P.sample_prompts(fx, 1, seed=3)
    assert [p.category for p in one] == P.categories(fx)
    assert P.sample_prompts(fx, 0) == fx  # 0 = every question
    with pytest.raises(ValueError):
        P.sample_prompts(fx, -1)


def test_prompt_to_messages_replays_earlier_answers():
    q = P.BenchPrompt(7, "writing", ["first?", "second?"])
    assert P.prompt_to_messages(q) == [{"role": "user", "content": "first?"}]
    assert P.prompt_to_messages(q, 1, ["ans1"], system="sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "ans1"},
        {"role": "user", "content": "second?"},
    ]
    with pytest.raises(ValueError, match="needs the model's answers"):
        P.prompt_to_messages(q, 1)
    with pytest.raises(IndexError):
        P.prompt_to_messages(q, 2, ["a", "b"])


def test_run_conversation_feeds_turn_one_answer_into_turn_two():
    q = P.BenchPrompt(7, "writing", ["first?", "second?"])
    seen = []

    def generate_turn(messages):
        seen.append(messages)
        n = len(seen)
        return f"answer{n}", [2] * n, 2 * n + 1, 0.5 * n

    answers, logs = P.run_conversation(q, generate_turn, n_turns=2)
    assert answers == ["answer1", "answer2"]
    assert seen[1][-2] == {"role": "assistant", "content": "answer1"}
    assert [(g.turn, g.accept_lengths, g.new_tokens, g.wall_s) for g in logs] == \
        [(0, (2,), 3, 0.5), (1, (2, 2), 5, 1.0)]
    # first turn only by default; more turns than the question has runs what it has
    assert len(P.run_conversation(q, generate_turn)[1]) == 1
    assert len(P.run_conversation(q, generate_turn, n_turns=5)[1]) == 2


@pytest.mark.slow
def test_second_turn_renders_after_first_answer_with_smollm2_template():
    """MT-Bench turn 2 = turn-1 prompt + the model's answer + the second user turn (ChatML)."""
    from confu_jax.data.chat import ChatTokenizer

    tok = ChatTokenizer.load("smollm2-135m-instruct")
    q = P.load_mtbench()[0]
    answer = "Aloha! Hawaii was great."
    first = tok.render(P.prompt_to_messages(q, 0), add_generation_prompt=True)
    second = tok.render(P.prompt_to_messages(q, 1, [answer]), add_generation_prompt=True)
    assert first.endswith(f"<|im_start|>user\n{q.turns[0]}<|im_end|>\n<|im_start|>assistant\n")
    assert second == (first + answer + "<|im_end|>\n<|im_start|>user\n" + q.turns[1]
                      + "<|im_end|>\n<|im_start|>assistant\n")
    ids1, _ = tok.encode_chat(P.prompt_to_messages(q, 0), add_generation_prompt=True)
    ids2, _ = tok.encode_chat(P.prompt_to_messages(q, 1, [answer]), add_generation_prompt=True)
    assert ids2[:len(ids1)] == ids1  # turn 2's prompt extends turn 1's token for token


def test_heldout_questions_are_the_conversations_training_holds_out(tmp_path):
    # launch.heldout_questions and training's evaluation (train.real_data) split with the same
    # function: the questions are the prompts of exactly the last eval_records conversations.
    import json as _json
    import subprocess
    import sys

    from confu_jax.data import formats

    path = tmp_path / "data.jsonl"
    with open(path, "w") as f:
        for i in range(7):
            msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
            if i == 6:
                msgs = [{"role": "system", "content": "be brief"}] + msgs + [
                    {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
            f.write(_json.dumps({"id": f"c{i}", "conversations": msgs}) + "\n")
    convs, _ = formats.load_conversations(str(path))
    train, held = formats.split_held_out(convs, 3)
    assert [c["id"] for c in train] == ["c0", "c1", "c2", "c3"] and [c["id"] for c in held] == ["c4", "c5", "c6"]
    assert formats.split_held_out(convs, 100)[1] == convs[4:]  # at most half is held out

    out = tmp_path / "q.jsonl"
    res = subprocess.run([sys.executable, "-m", "launch.heldout_questions", "--data", str(path), "--out", str(out),
                          "--eval_records", "3"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "wrote 3 held-out questions" in res.stdout and "1 system turns dropped" in res.stdout
    got = P.load_prompts(str(out))
    assert [(p.question_id, p.category, p.turns) for p in got] == [
        ("c4", "heldout", ("question 4",)), ("c5", "heldout", ("question 5",)), ("c6", "heldout", ("question 6",))]


def test_grounded_set_is_deterministic_and_copies_its_input():
    from confu_jax.bench.grounded import GROUNDED_CATEGORIES, humaneval_solutions, sharegpt_passages

    ps = P.load_prompts("grounded")
    again = P.load_prompts("grounded:8")
    assert [p.question_id for p in ps[:8]] == [p.question_id for p in again]
    assert len(ps) == 40 and [p.category for p in ps] == [c for c in GROUNDED_CATEGORIES for _ in range(10)]
    passages = sharegpt_passages(30)
    assert len(set(passages)) == 30 and all(500 <= len(t) <= 1500 and "```" not in t for t in passages)
    # each prompt holds its passage verbatim (what lookup can copy from)
    for p, text in zip(ps[:30], passages):
        assert text in p.turns[0] and p.question_id.startswith(f"grounded/{p.category}/")
    for p, code in zip(ps[30:], humaneval_solutions(10)):
        assert code in p.turns[0] and code.startswith(("def ", "from ", "import "))
