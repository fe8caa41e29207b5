"""Speculative benchmark on a tiny random GGUF model and the Spec-Bench-format fixture (2 prompts):
the results file has the required fields, greedy speculative decoding is lossless for every method
and budget, the AR row is its own baseline (SR 1), and parse helpers reject malformed flags."""

import json
import os

import pytest

from confu_jax.bench import cli_args, report, spec_bench
from confu_jax.bench.prompts import load_question_file
from tests.helpers.tiny_chat_model import tiny_chat_gguf
from tests.helpers.xla_env import SINGLE_DEVICE

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specbench_sample.jsonl")


def test_parse_budgets_and_heads():
    assert cli_args.parse_budgets("chain:4,dynamic:6,8,30,dynamic:6,10,60,auto") == [
        "chain:4", "dynamic:6,8,30", "dynamic:6,10,60", "auto"]
    with pytest.raises(ValueError, match="does not continue a plan"):
        cli_args.parse_budgets("4,chain:2")
    with pytest.raises(ValueError, match="dynamic:DEPTH,TOPK,NODES"):
        cli_args.parse_budgets("dynamic:6,8")
    assert cli_args.parse_heads("eagle3=a/b,confu=c") == {"eagle3": "a/b", "confu": "c"}
    with pytest.raises(ValueError, match="METHOD=WORKDIR"):
        cli_args.parse_heads("eagle3")


@pytest.mark.slow
def test_tiny_benchmark_rows(tmp_path):
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    prompts = load_question_file(FIXTURE)[:2]
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=16, min_bucket=64)
    messages = []
    rows = spec_bench.run_benchmark(setup, prompts, methods=["ar", "eagle3", "confu"], temperatures=[0.0],
                                    budgets=["chain:2", "dynamic:2,2,4"], heads={}, log=messages.append)
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("ar", None), ("eagle3", "chain:2"), ("eagle3", "dynamic:2,2,4"), ("confu", "chain:2"),
        ("confu", "dynamic:2,2,4")]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["tau"] == pytest.approx(1.0)
    cats = {p.category for p in prompts}
    for r in rows[1:]:
        assert r["lossless_greedy"] is True and r["n_mismatched_turns"] == 0, r
        assert r["trained"] is False and r["head"].startswith("random")
        assert 1.0 <= r["tau"] <= r["nodes"]
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and r["compile_s"] > 0
        assert set(r["per_category"]) == cats
        assert all({"tau", "speedup"} <= set(c) for c in r["per_category"].values())
    assert any("UNTRAINED" in m for m in messages)
    out = tmp_path / "results.json"
    report.write_results(out, rows)
    doc = json.loads(out.read_text())
    assert {"jax_version", "devices", "git_commit"} <= set(doc["environment"])
    assert [r["lossless_greedy"] for r in doc["results"]] == [None, True, True, True, True]


@pytest.mark.slow
def test_interleaved_rows_decode_the_same_tokens(tmp_path):
    """interleave: every row's questions decoded in turn give the rows of the row-after-row run
    (same tokens, τ, losslessness; only timings differ), in the same order; compile time is still
    kept out of the timed calls."""
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    prompts = load_question_file(FIXTURE)[:2]
    kw = dict(methods=["ar", "eagle3"], temperatures=[0.0], budgets=["chain:1", "chain:2"], heads={},
              log=lambda m: None)
    rows = {}
    for mode in (False, True):
        setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=12, min_bucket=64,
                                      interleave=mode, ar_again=True)
        rows[mode] = spec_bench.run_benchmark(setup, prompts, **kw)
    seq, inter = rows[False], rows[True]
    assert [(r["method"], r["budget"]) for r in inter] == [(r["method"], r["budget"]) for r in seq] == [
        ("ar", None), ("eagle3", "chain:1"), ("eagle3", "chain:2"), ("ar_again", None)]
    for a, b in zip(seq, inter):
        assert (a["tau"], a["new_tokens"], a["n_target_passes"], a["lossless_greedy"]) == \
            (b["tau"], b["new_tokens"], b["n_target_passes"], b["lossless_greedy"])
    assert all(r["interleaved"] for r in inter[1:3]) and inter[1]["compile_s"] > 0
    assert inter[-1]["lossless_greedy"] is True and inter[-1]["tau"] == pytest.approx(1.0)


def test_interleaved_order_rotates():
    """Question i is decoded by every row, the row going first rotating with i."""
    calls = []

    class Tok:
        eos_ids = ()

        def render(self, messages, add_generation_prompt=True):
            return messages[-1]["content"]

        def encode(self, text):
            return [1, 2]

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    def decoder(name):
        def decode_one(ids):
            calls.append(name)
            return [5, 6], [1], 0.01
        return decode_one

    from confu_jax.bench.prompts import BenchPrompt

    setup = spec_bench.BenchSetup(None, None, Tok())
    prompts = [BenchPrompt(question_id=i, category="c", turns=["q"]) for i in range(3)]
    out = spec_bench._run_interleaved(prompts, setup, {k: decoder(k) for k in "abc"}, None)
    assert calls == list("abc" "bca" "cab")
    assert all(len(out[k][0]) == 3 and len(out[k][1]) == 3 for k in "abc")


@pytest.mark.slow
def test_decode_bench_cli_speculative_mode(tmp_path):
    """``python -m launch.decode_bench --methods ...`` on the tiny model: results + table + figure."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    gguf = tiny_chat_gguf(tmp_path)
    questions = tmp_path / "q.jsonl"
    with open(FIXTURE) as f:
        questions.write_text("".join(f.readlines()[:2]))
    out = tmp_path / "res" / "bench.json"
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-m", "launch.decode_bench", "--model", gguf, "--methods", "ar,confu",
                        "--prompts", str(questions), "--n_per_category", "5", "--budgets", "chain:2",
                        "--max_new_tokens", "12", "--out", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    ar, confu = doc["results"]
    assert confu["method"] == "confu" and confu["lossless_greedy"] is True and confu["trained"] is False
    for k in ("tau", "tokens_per_s", "speedup", "per_category", "compile_s"):
        assert confu[k] is not None, k
    assert ar["speedup"] == pytest.approx(1.0)
    assert confu["speedup"] == pytest.approx(confu["tokens_per_s"] / ar["tokens_per_s"], rel=1e-6)
    assert (tmp_path / "res" / "bench.png").stat().st_size > 1000
    md = (tmp_path / "res" / "bench.md").read_text()
    assert "RANDOM random" in md and "| True |" in md
    assert "environment" in doc and doc["environment"]["command_line"]

    # --calibration fixes the calibration prompts even without budget auto: they are resume
    # settings, so a later invocation adding auto to the same --out keeps these parts
    calib = tmp_path / "calib.jsonl"
    with open(FIXTURE) as f:
        calib.write_text("".join(f.readlines()[2:4]))
    out2 = tmp_path / "res2" / "bench.json"
    r = subprocess.run([sys.executable, "-m", "launch.decode_bench", "--model", gguf, "--methods", "ar",
                        "--prompts", str(questions), "--n_per_category", "5", "--budgets", "chain:2",
                        "--max_new_tokens", "4", "--calibration", str(calib), "--n_calibration", "2",
                        "--out", str(out2)], cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    settings = json.loads((tmp_path / "res2" / "bench.parts" / "settings.json").read_text())
    assert len(settings["calibration"]) == 2 and all(settings["calibration"])


@pytest.mark.slow
def test_budget_auto_row(tmp_path):
    """``auto`` resolves to one of its candidates (recorded as the row's plan) and stays lossless."""
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=10,
                                  auto_candidates={None: ("chain:1", "chain:2")}, ar_again=True)
    messages = []
    rows = spec_bench.run_benchmark(setup, load_question_file(FIXTURE)[:1], methods=["ar", "eagle3"],
                                    temperatures=[0.0], budgets=["auto"], heads={}, log=messages.append)
    auto = rows[1]
    # ar_again: AR decoded once more after the last row, its speed-up against the first AR row
    again = rows[-1]
    assert [r["method"] for r in rows] == ["ar", "eagle3", "ar_again"]
    assert again["tau"] == pytest.approx(1.0) and again["lossless_greedy"] is True
    assert again["speedup"] == pytest.approx(again["tokens_per_s"] / rows[0]["tokens_per_s"], rel=0.05)
    assert any(m.startswith("[ar again]") for m in messages)
    assert auto["budget"] == "auto" and auto["setting"]["plan"] in ("ar", "chain:1", "chain:2")
    assert auto["nodes"] == (1 if auto["setting"]["plan"] == "ar" else int(auto["setting"]["plan"][-1]) + 1)
    assert auto["lossless_greedy"] is True
    assert sum("budget auto: chain:" in m for m in messages) == 2
    assert sum("budget auto: ar:" in m for m in messages) == 1  # plain AR is a candidate
    assert any("no held-out calibration prompts" in m for m in messages)
    if auto["setting"]["plan"] == "ar":  # speculation off: the row is the AR decode itself
        assert auto["tau"] == pytest.approx(1.0) and auto["speedup"] == pytest.approx(1.0)


@pytest.mark.slow
def test_the_layer_schedule_reaches_every_program_and_changes_no_token(tmp_path, monkeypatch):
    """``BenchSetup.unroll_layers`` (``--layers``) is the schedule of every program the run compiles —
    AR, the rows and budget auto's calibration — and the rows are the same under both schedules
    (tokens, τ, losslessness): only the cost differs."""
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.decode import generate, loop
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    asked = []
    for mod in (generate, loop):
        real = mod.default_unroll_layers
        monkeypatch.setattr(mod, "default_unroll_layers", lambda u, mesh=None, real=real: asked.append(u) or real(u, mesh))
    rows = {}
    for unroll in (False, True):
        asked.clear()
        setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=8,
                                      auto_candidates={None: ("chain:1",)}, unroll_layers=unroll)
        rows[unroll] = spec_bench.run_benchmark(setup, load_question_file(FIXTURE)[:1], methods=["ar", "eagle3"],
                                                temperatures=[0.0], budgets=["chain:2", "auto"], heads={},
                                                log=lambda m: None)
        assert asked and set(asked) == {unroll}, asked
    assert [(r["method"], r["tau"], r["new_tokens"], r["lossless_greedy"]) for r in rows[False]] == \
        [(r["method"], r["tau"], r["new_tokens"], r["lossless_greedy"]) for r in rows[True]]


def test_budget_auto_calibrates_on_the_given_prompts(tmp_path, monkeypatch):
    """Held-out calibration prompts reach ``auto_plan`` instead of the measured questions."""
    from confu_jax.bench import budget
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    seen = []

    def fake_auto_plan(spec, params, prompts, **kw):
        seen.append(prompts)
        # calibrated at the decoding's own length and bucket (a step's cost depends on both)
        assert (kw["max_new_tokens"], kw["min_bucket"]) == (6, 64)
        c = budget.Candidate(budget.AR, 1.0, 0.01)
        return c, [c]

    monkeypatch.setattr(budget, "auto_plan", fake_auto_plan)
    calib = ((5, 6, 7, 8), (9, 10, 11))
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=6, calibration=calib)
    messages = []
    rows = spec_bench.run_benchmark(setup, load_question_file(FIXTURE)[:1], methods=["ar", "eagle3"],
                                    temperatures=[0.0], budgets=["auto"], heads={}, log=messages.append)
    assert seen == [calib]
    assert rows[1]["setting"]["plan"] == "ar" and rows[1]["tokens_per_s"] == rows[0]["tokens_per_s"]
    assert not any("no held-out calibration prompts" in m for m in messages)


@pytest.mark.slow
def test_benchmark_resumes_from_finished_rows(tmp_path):
    """A killed benchmark rerun with the same settings keeps the rows it finished (AR's logs
    included, so later rows still compare against the same AR run) and redoes only the rest."""
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    prompts = load_question_file(FIXTURE)[:2]
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=10, min_bucket=64)
    settings = {"questions": [p.question_id for p in prompts], "max_new_tokens": 10}
    kw = dict(methods=["ar", "eagle3"], temperatures=[0.0], budgets=["chain:2"], heads={})
    parts = spec_bench.Parts(str(tmp_path / "b.parts"), settings)
    first = spec_bench.run_benchmark(setup, prompts, **kw, log=lambda m: None, parts=parts)
    unit = [f for f in os.listdir(tmp_path / "b.parts") if f.startswith("eagle3")]
    assert len(unit) == 1
    os.remove(tmp_path / "b.parts" / unit[0])  # as if killed during the eagle3 row
    messages = []
    again = spec_bench.run_benchmark(setup, prompts, **kw, log=messages.append,
                                     parts=spec_bench.Parts(str(tmp_path / "b.parts"), settings))
    assert sum("finished in an earlier run" in m for m in messages) == 1  # AR kept, eagle3 redone
    assert json.dumps(report.result_to_json(again[0])) == json.dumps(report.result_to_json(first[0]))
    assert again[1]["lossless_greedy"] is True and again[1]["tau"] == pytest.approx(first[1]["tau"])
    messages.clear()
    third = spec_bench.run_benchmark(setup, prompts, **kw, log=messages.append,
                                     parts=spec_bench.Parts(str(tmp_path / "b.parts"), settings))
    assert sum("finished in an earlier run" in m for m in messages) == 2
    assert [report.result_to_json(r) for r in third] == [report.result_to_json(r) for r in again]
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        spec_bench.Parts(str(tmp_path / "b.parts"), dict(settings, max_new_tokens=12))


def test_a_new_program_runs_once_untimed_before_it_is_returned():
    """The benchmark's program cache executes a freshly compiled program once before handing it to
    a row (a fresh XLA:CPU executable's first run is slower than later ones, and a row would time
    that), compiles and runs each (function, shapes, static args) once, and returns the compiled
    program itself: its outputs are the jitted function's."""
    import jax
    import jax.numpy as jnp

    runs = []

    def body(params, x, *, scale):
        jax.debug.callback(lambda: runs.append(1))  # counts executions of the compiled program
        return params["w"] * x * scale

    jitted = jax.jit(body, static_argnames=("scale",))
    programs = spec_bench._Programs()
    params = {"w": jnp.float32(2.0)}
    x3, x4 = jnp.arange(3.0), jnp.arange(4.0)
    fn = programs.get(jitted, (params,), (x3,), {"scale": 3})
    assert len(runs) == 1 and programs.compile_s > 0  # compiled, then run once
    assert programs.get(jitted, (params,), (x3,), {"scale": 3}) is fn and len(runs) == 1  # cached: not run again
    assert jnp.array_equal(fn(params, x3), jitted(params, x3, scale=3)) and len(runs) == 3  # timed calls: 2
    programs.get(jitted, (params,), (x4,), {"scale": 3})  # another shape: another program, warmed
    programs.get(jitted, (params,), (x3,), {"scale": 5})  # another static argument: likewise
    assert len(runs) == 5 and len(programs.cache) == 3


@pytest.mark.slow
def test_decode_bench_mesh_gives_the_tokens_of_one_device(tmp_path):
    """``launch.decode_bench --mesh tensor=2`` (two fake CPU devices, the target and head split over
    'tensor' as launch.generate --mesh splits them) decodes the same greedy tokens, row by row, as the
    same benchmark on one device; the mesh is part of the resume settings."""
    import subprocess
    import sys

    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    gguf = tiny_chat_gguf(tmp_path)
    questions = tmp_path / "q.jsonl"
    with open(FIXTURE) as f:
        questions.write_text(f.readline())
    out = tmp_path / "mesh" / "bench.json"
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-m", "launch.decode_bench", "--model", gguf, "--methods", "ar,eagle3",
                        "--prompts", str(questions), "--n_per_category", "0", "--budgets", "chain:2",
                        "--max_new_tokens", "6", "--mesh", "tensor=2", "--attention_impl", "xla", "--out", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    parts = tmp_path / "mesh" / "bench.parts"
    assert json.loads((parts / "settings.json").read_text())["mesh"] == "tensor=2"
    meshed = {p.stem: json.loads(p.read_text())["tokens"] for p in parts.glob("*__T0.json")}

    cfg, params = load_model(gguf)
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=6)
    one = spec_bench.Parts(str(tmp_path / "one"), {})
    spec_bench.run_benchmark(setup, load_question_file(str(questions)), methods=["ar", "eagle3"], temperatures=[0.0],
                             budgets=["chain:2"], heads={}, log=lambda m: None, parts=one)
    single = {p.stem: json.loads(p.read_text())["tokens"] for p in (tmp_path / "one").glob("*__T0.json")}
    assert sorted(meshed) == sorted(single) == ["ar__T0", "eagle3__chain-2__T0"]
    for key in single:
        assert meshed[key] == single[key] and all(len(out) > 1 for _, out in single[key]), key
