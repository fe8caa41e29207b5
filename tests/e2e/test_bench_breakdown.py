"""τ by answer position and by prompt source (confu_jax.bench.breakdown): a hand-computed example,
a per-token reference on random logs, the benchmark report reading its parts, and the CLI."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from confu_jax.bench import breakdown, report
from confu_jax.bench.metrics import GenerationLog, summarize, tau
from confu_jax.bench.spec_bench import Parts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EDGES = (0, 4, 8)


def _example():
    return [
        # MT-Bench turn 1: prefill token at 0, passes start at 1, 3, 4, 7, 8
        GenerationLog(81, "writing", (2, 1, 3, 1, 4), 12, 1.0),
        # a loop that emits nothing from prefill: passes start at 0, 1, 2, 3
        GenerationLog("HumanEval/0", "humaneval", (1, 1, 1, 2), 5, 1.0),
        GenerationLog("conv-7", "heldout", (3, 3), 7, 1.0),  # starts 1, 4
        GenerationLog(81, "writing", (1,), 2, 1.0, turn=1),  # MT-Bench turn 2 restarts at 0: start 1
    ]


def test_hand_computed_example():
    logs = _example()
    assert breakdown.pass_starts(logs[0]) == [1, 3, 4, 7, 8]
    assert breakdown.pass_starts(logs[1]) == [0, 1, 2, 3]
    b = breakdown.tau_breakdown(logs, EDGES)
    cells = [(c["lo"], c["hi"], c["tokens"], c["passes"]) for c in b["by_position"]]
    # [0,4): 2+1 (81) + 1+1+1+2 (HumanEval) + 3 (conv-7) + 1 (turn 2) = 12 in 8 passes
    # [4,8): 3+1 (81) + 3 (conv-7) = 7 in 3;  [8,inf): 4 (81) in 1
    assert cells == [(0, 4, 12, 8), (4, 8, 7, 3), (8, None, 4, 1)]
    assert [c["tau"] for c in b["by_position"]] == pytest.approx([1.5, 7 / 3, 4.0])
    assert (b["tokens"], b["passes"]) == (23, 12) and b["tau"] == pytest.approx(tau(logs))
    src = b["by_source"]
    assert list(src) == ["mtbench", "humaneval", "heldout"]
    assert (src["mtbench"]["tokens"], src["mtbench"]["passes"], src["mtbench"]["questions"],
            src["mtbench"]["turns"]) == (12, 6, 1, 2)
    assert src["humaneval"]["tau"] == pytest.approx(5 / 4) and src["heldout"]["tau"] == pytest.approx(3.0)
    assert [c["passes"] for c in src["heldout"]["by_position"]] == [1, 1, 0]
    assert math.isnan(src["heldout"]["by_position"][2]["tau"])  # no pass starts there
    assert list(b["by_category"]) == ["writing", "humaneval", "heldout"]


def test_prompt_sources():
    assert breakdown.prompt_source(81, "writing") == "mtbench"
    assert breakdown.prompt_source("HumanEval/3", "humaneval") == "humaneval"
    assert breakdown.prompt_source("HumanEval/3", "coding") == "humaneval"
    assert breakdown.prompt_source("1234", "heldout") == "heldout"
    assert breakdown.prompt_source("sb-3", "writing") == "writing"  # a Spec-Bench file's writing is not MT-Bench


@pytest.mark.parametrize("seed", range(4))
def test_buckets_match_a_per_token_walk_and_pool_to_tau(seed):
    rng = np.random.default_rng(seed)
    logs = []
    for q in range(12):
        acc = tuple(int(a) for a in 1 + rng.poisson(rng.uniform(0.1, 2.0), size=rng.integers(1, 60)))
        first = int(rng.integers(0, 2))
        logs.append(GenerationLog(q, "writing" if q % 2 else "coding", acc, sum(acc) + first, 1.0))
    edges = (0, 16, 32, 64, 128)
    want = np.zeros((len(edges), 2))
    for g in logs:
        owner = [-1] * (g.new_tokens - sum(g.accept_lengths))  # which pass emitted each answer token
        for i, a in enumerate(g.accept_lengths):
            owner += [i] * a
        for i, a in enumerate(g.accept_lengths):
            start = owner.index(i)
            k = max(e for e in range(len(edges)) if start >= edges[e])
            want[k] += (a, 1)
    got = breakdown.by_position(logs, edges)
    assert [(c["tokens"], c["passes"]) for c in got] == [tuple(int(x) for x in w) for w in want]
    total_t, total_p = sum(c["tokens"] for c in got), sum(c["passes"] for c in got)
    assert total_t / total_p == pytest.approx(tau(logs))


def test_bad_edges_are_refused():
    with pytest.raises(ValueError, match="start at 0"):
        breakdown.by_position(_example(), (4, 8))
    with pytest.raises(ValueError, match="increase"):
        breakdown.by_position(_example(), (0, 8, 8))


def _row(method, logs, ar_logs, budget):
    return dict(dataclasses.asdict(summarize(method, logs, ar_logs, nodes=None if method == "ar" else 4)),
                budget=budget, compile_s=0.0)


def _bench(tmp_path):
    """A benchmark's rows and its parts folder: AR, EAGLE-3 chain:3, plus an EAGLE-3 chain:1 unit
    of an earlier invocation that this report does not include."""
    logs = _example()
    ar = [GenerationLog.autoregressive(g.question_id, g.category, g.new_tokens, 2.0, g.turn) for g in logs]
    other = [GenerationLog(g.question_id, g.category, (1,) * sum(g.accept_lengths), g.new_tokens, 1.0, g.turn)
             for g in logs]
    rows = [_row("ar", ar, ar, None), _row("eagle3", logs, ar, "chain:3")]
    out = tmp_path / "bench.json"
    parts = Parts(str(tmp_path / "bench.parts"), {"questions": "x"})
    parts.save("ar__T0", rows[0], ar, [])
    parts.save("eagle3__chain:3__T0", rows[1], logs, [])
    parts.save("eagle3__chain:1__T0", _row("eagle3", other, ar, "chain:1"), other, [])
    return out, rows


def test_report_adds_the_breakdown_from_its_parts(tmp_path):
    out, rows = _bench(tmp_path)
    report.write_outputs(str(out), rows)
    doc = json.loads(out.read_text())
    (b,) = doc["tau_breakdown"]  # AR left out; the chain:1 unit is not a row of this report
    assert (b["method"], b["budget"]) == ("eagle3", "chain:3")
    assert [c["passes"] for c in b["by_position"]] == [12, 0, 0, 0, 0]  # default edges 0,16,32,64,128
    assert b["by_source"]["mtbench"]["tau"] == pytest.approx(2.0)
    assert b["by_source"]["heldout"]["by_position"][1]["tau"] is None  # nan -> null
    md = (tmp_path / "bench.md").read_text()
    assert "| eagle3 | 0 | chain:3 | mtbench | 2.00 (6) | – | – | – | – | 2.00 (6) |" in md
    assert "| eagle3 | 0 | chain:3 | all | 1.92 (12) | – | – | – | – | 1.92 (12) |" in md
    assert "| eagle3 | 0 | chain:3 | humaneval | 1 | 1 | 4 | 1.25 |" in md


def test_report_without_parts_is_unchanged(tmp_path):
    out, rows = _bench(tmp_path)
    for f in (tmp_path / "bench.parts").iterdir():
        f.unlink()
    (tmp_path / "bench.parts").rmdir()
    report.write_outputs(str(out), rows)
    assert "tau_breakdown" not in json.loads(out.read_text())
    assert "answer position" not in (tmp_path / "bench.md").read_text()


def test_report_is_written_when_a_part_is_unreadable(tmp_path):
    out, rows = _bench(tmp_path)
    (tmp_path / "bench.parts" / "broken.json").write_text("{")
    report.write_outputs(str(out), rows)
    assert "τ breakdown left out" in (tmp_path / "bench.md").read_text()


def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.tau_breakdown", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_reads_a_results_file_or_a_parts_folder(tmp_path):
    out, rows = _bench(tmp_path)
    report.write_outputs(str(out), rows)
    r = _cli(str(out), "--edges=0,4,8", f"--json={tmp_path / 'b.json'}")
    assert r.returncode == 0, r.stderr
    assert "| eagle3 | 0 | chain:3 | all | 1.50 (8) | 2.33 (3) | 4.00 (1) | 1.92 (12) |" in r.stdout
    assert "chain:1" not in r.stdout
    (b,) = json.loads((tmp_path / "b.json").read_text())
    assert b["edges"] == [0, 4, 8]
    r = _cli(str(tmp_path / "bench.parts"), "--edges=0,4,8")  # the folder: every unit in it
    assert r.returncode == 0, r.stderr
    assert "chain:1" in r.stdout and "| ar |" not in r.stdout
    r = _cli(str(tmp_path / "missing.json"))
    assert r.returncode != 0 and "no such file" in r.stderr


def test_cli_names_a_results_file_without_parts(tmp_path):
    out, rows = _bench(tmp_path)
    report.write_outputs(str(out), rows)
    other = tmp_path / "copy.json"
    other.write_text(out.read_text())
    r = _cli(str(other))
    assert r.returncode != 0 and "copy.parts" in r.stderr
