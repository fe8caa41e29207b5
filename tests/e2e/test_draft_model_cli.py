"""Draft models through the command line and the benchmark, on tiny random GGUF models (real
tokenizer path): ``launch.generate --method draft_model|sd2 --draft_model SOURCE`` equals
``--method ar`` greedy for the early-exit drafter and for an independent GGUF with the target's
tokenizer; a GGUF with another tokenizer is refused with a message; the benchmark runs draft-model
rows (``--heads draft_model=SOURCE``) lossless, under the plans their family reads."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.tiny_chat_model import TEMPLATE, tiny_chat_gguf
from tests.helpers.tiny_checkpoints import hf_llama, write_gguf
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    target = tiny_chat_gguf(d)
    out = {"target": target}
    for name, vocab in (("draft", 300), ("other_tok", 310)):
        m = hf_llama(d / f"hf_{name}", vocab=vocab, layers=2, hidden=32, heads=2, kv_heads=1, ffn=48, seed=1,
                     max_pos=512)
        out[name] = str(d / f"{name}.gguf")
        write_gguf(out[name], m, chat_template=TEMPLATE)
    return out


def _generate(model, *args, ok=True):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "launch.generate", "--model", model, "--prompt",
                        "Hello world, 12345", "--max_new_tokens", "16", "--print_ids",
                        "--config.decode.top_p=1.0", "--temperature", "0", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not ok:
        return r, None
    assert r.returncode == 0, r.stderr[-3000:]
    ids = re.search(r"^ids: (.*)$", r.stderr, re.M).group(1).split()
    return r, [int(i) for i in ids]


@pytest.mark.slow
def test_generate_cli_draft_models(models):
    target = models["target"]
    _, ar_ids = _generate(target, "--method", "ar")
    for method, source, tree in (("draft_model", "self:2", "chain:3"), ("draft_model", models["draft"], "dynamic:2,2,4"),
                                 ("sd2", "self:1", "chain:2")):
        r, ids = _generate(target, "--method", method, "--draft_model", source, "--tree", tree)
        assert ids == ar_ids, (method, source)
        assert re.search(r"tau = [0-9.]+ tokens per target pass", r.stderr)
        assert "UNTRAINED" not in r.stderr
    r, _ = _generate(target, "--method", "draft_model", "--draft_model", models["other_tok"], ok=False)
    assert r.returncode != 0 and "does not share" in r.stderr and "vocabulary of 310 tokens" in r.stderr
    r, _ = _generate(target, "--method", "eagle3", "--draft_model", "self:2", ok=False)
    assert r.returncode != 0 and "--draft_model is for --method draft_model" in r.stderr


@pytest.mark.slow
def test_benchmark_draft_model_rows(models, tmp_path):
    from confu_jax.bench import cli_args, spec_bench
    from confu_jax.bench.prompts import load_question_file
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.runs.draft_models import TokenizerMismatchError
    from confu_jax.weights import load_model

    fixture = os.path.join(ROOT, "tests", "fixtures", "specbench_sample.jsonl")
    cfg, params = load_model(models["target"])
    prompts = load_question_file(fixture)[:2]
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(models["target"]), max_new_tokens=10,
                                  min_bucket=64)
    budgets = cli_args.parse_budgets("chain:2,lookup:3,2")
    from confu_jax.decode.families import FAMILIES

    # chain:2 is a plan of every drafter family (registry order)
    assert cli_args.plan_families("chain:2") == tuple(f for f in FAMILIES if f not in ("ar", "auto"))
    messages = []
    rows = spec_bench.run_benchmark(setup, prompts, methods=["ar", "draft_model"], temperatures=[0.0],
                                    budgets=budgets, heads={"draft_model": models["draft"]}, log=messages.append)
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("draft_model", "chain:2")]
    assert rows[1]["lossless_greedy"] is True and rows[1]["head"] == models["draft"]
    assert any("lookup:3,2 is not a draft_model plan: skipped" in m for m in messages)
    with pytest.raises(TokenizerMismatchError):
        spec_bench.run_benchmark(setup, prompts, methods=["ar", "draft_model"], temperatures=[0.0],
                                 budgets=["chain:2"], heads={"draft_model": models["other_tok"]}, log=messages.append)
