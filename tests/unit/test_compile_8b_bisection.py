"""experiments/compile_8b.py's search for the largest batch (or row length) that fits: doubling from 8,
then bisecting in steps of the 8 data-parallel rows; rows bisected in steps of 256 when batch 8 does
not fit; every point recorded once and resumed from the file. The compiler is replaced by a fits rule
(tokens per step under a budget) — the real compiles are the experiment's (minutes each)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def c8(monkeypatch):
    spec = importlib.util.spec_from_file_location("compile_8b", os.path.join(REPO, "experiments", "compile_8b.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake(c8, monkeypatch, budget_tokens):
    calls = []

    def compile_point(out, done, family, config, model, topology, rows, batch):
        p = dict(kind="train", family=family, model=model, topology=topology, rows=rows, batch=batch, plan="-")
        if c8._key(p) in done:
            return done[c8._key(p)]
        calls.append((rows, batch))
        p.update(fits=rows * batch <= budget_tokens, per_device_peak_bytes=rows * batch, device_memory_bytes=1)
        c8._append(out, p)
        done[c8._key(p)] = p
        return p

    monkeypatch.setattr(c8, "train_point", compile_point)
    return calls


@pytest.mark.parametrize("budget_batch", [8, 40, 96, 512, 1000])
def test_largest_batch_at_4096_rows(c8, monkeypatch, tmp_path, budget_batch):
    calls = _fake(c8, monkeypatch, 4096 * budget_batch)
    done = {}
    c8.train_point(str(tmp_path), done, "eagle3", "c", "m", "t", 4096, 8)
    c8.bisect_batch(str(tmp_path), done, "eagle3", "c", "m", "t")
    fit = max(b for r, b in calls if c8._fits(done[c8._key(dict(kind="train", family="eagle3", model="m",
                                                                 topology="t", rows=r, batch=b, plan="-"))]))
    assert fit == min(budget_batch // 8 * 8, 512)
    assert len(calls) == len(set(calls))  # no point compiled twice
    n = len(calls)
    again = c8.load(str(tmp_path))  # a rerun resumes: nothing compiled again
    c8.bisect_batch(str(tmp_path), again, "eagle3", "c", "m", "t")
    assert len(calls) == n and len(again) == n
    table = c8.table(again)
    assert f"| eagle3 | m | t | 4096 × 8 |" in table
    if 8 <= budget_batch < 512:
        assert f"| {fit} (not " in table


def test_largest_rows_when_batch_8_does_not_fit(c8, monkeypatch, tmp_path):
    calls = _fake(c8, monkeypatch, 8 * 1500)
    done = {}
    assert not c8._fits(c8.train_point(str(tmp_path), done, "confu", "c", "m", "t", 4096, 8))
    c8.bisect_rows(str(tmp_path), done, "confu", "c", "m", "t")
    fitting = [r for r, b in calls if r * b <= 8 * 1500]
    assert max(fitting) == 1280  # the largest multiple of 256 under 1500
    assert "rows 1280 at batch 8" in c8.table(done)
    lines = [json.loads(x) for x in open(tmp_path / "points.jsonl")]
    assert len(lines) == len(calls)
