"""Data releases (confu_jax.data.releases, launch.release_data): append-only hashed parts in the repo."""

import hashlib
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from confu_jax.data import formats, pipeline, releases
from confu_jax.decode import self_distill as sd
from launch import generate_data as gd
from tests.helpers.fake_chat import FakeChatTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = {"model": "fake-target", "fingerprint": "ab" * 32}
GENERATION = {"command": "python -m launch.generate_data --output x.jsonl", "model": "fake-target",
              "tokenizer": "fake-target", "dtype": "", "temperature": 0.0, "top_p": 1.0,
              "max_new_tokens": 256, "max_prompt_len": 512, "max_turns": 0}


def _record(i, turns=1):
    msgs = [{"role": "system", "content": "sys"}] if i % 3 == 0 else []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {i} turn {t} " + "w " * (i % 7)},
                 {"role": "assistant", "content": f"answer {i} {t} " + " ".join(f"x{i * j}" for j in range(20))}]
    return {"id": f"r{i}", "conversations": msgs}


def _count(record):
    return sum(len(m["content"].split()) + 1 for m in record["conversations"] if m["role"] == "assistant")


def _append(directory, records, **kw):
    kw = {"count_tokens": _count, "target": TARGET, "tokenizer": "fake-target", "generation": GENERATION,
          "commit": "c0ffee", **kw}
    return releases.append_release(str(directory), records, **kw)


def _parts(directory):
    return {p: (directory / p).read_bytes() for p in sorted(os.listdir(directory)) if p.startswith("part-")}


def test_round_trip_manifest_and_ids(tmp_path):
    rel = tmp_path / "releases" / "data" / "demo"
    recs = [_record(i, turns=1 + i % 3) for i in range(12)]
    stats = _append(rel, recs)
    assert stats["added"] == 12 and stats["new_parts"] == ["part-00000.jsonl.zst"]
    assert list(releases.load_release(str(rel))) == recs
    assert releases.released_ids(str(rel)) == {r["id"] for r in recs}
    m = releases.read_manifest(str(rel))
    assert m["name"] == "demo" and m["target"] == TARGET and m["generation"] == GENERATION
    assert m["conversations"] == 12 and m["n_parts"] == 1
    assert m["answer_tokens"] == sum(_count(r) for r in recs)
    part = m["parts"][0]
    data = (rel / part["file"]).read_bytes()
    assert part["sha256"] == hashlib.sha256(data).hexdigest() and part["bytes"] == len(data) == m["bytes"]
    assert (part["first_id"], part["last_id"], part["git_commit"]) == ("r0", "r11", "c0ffee")
    assert part["generation_command"] == GENERATION["command"] and part["created"]
    assert releases.released_ids(str(tmp_path / "nothing_yet")) == set()
    assert not [p for p in os.listdir(rel) if p.endswith(".tmp")]


def test_tiny_part_size_splits_into_parts_under_the_limit(tmp_path):
    rel = tmp_path / "rel"
    recs = [_record(i, turns=2) for i in range(40)]
    limit = 700
    stats = _append(rel, recs, part_bytes=limit)
    m = releases.read_manifest(str(rel))
    assert len(stats["new_parts"]) == m["n_parts"] >= 4
    assert [p["file"] for p in m["parts"]] == [f"part-{i:05d}.jsonl.zst" for i in range(m["n_parts"])]
    assert all(0 < p["bytes"] <= limit for p in m["parts"])
    assert sum(p["conversations"] for p in m["parts"]) == 40
    assert sum(p["answer_tokens"] for p in m["parts"]) == m["answer_tokens"] == sum(_count(r) for r in recs)
    assert list(releases.load_release(str(rel))) == recs
    # A part is cut only where it is full: its bytes plus the next record stored raw would pass the
    # limit (the slack is one record: nothing at 10 MB parts, much at this tiny size).
    lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in recs]
    end = 0
    for p in m["parts"][:-1]:
        end += p["conversations"]
        assert p["bytes"] + len(lines[end]) + releases._frame_overhead(len(lines[end])) > limit
    with pytest.raises(releases.ReleaseError, match="does not fit in a part"):
        _append(tmp_path / "rel2", [_record(1, turns=30)], part_bytes=100)


def test_appending_adds_only_new_ids_and_never_rewrites_parts(tmp_path):
    rel = tmp_path / "rel"
    first = [_record(i) for i in range(10)]
    _append(rel, first, part_bytes=400)
    before = _parts(rel)
    m1 = releases.read_manifest(str(rel))
    mtimes = {p: os.stat(rel / p).st_mtime_ns for p in before}

    # The generator's output grew: the first 10 again (and a repeat), then 6 new ones.
    second = first + [_record(3)] + [_record(i) for i in range(10, 16)]
    stats = _append(rel, second, part_bytes=400)
    assert stats["added"] == 6 and stats["already_released"] == 11 and stats["duplicates"] == 0
    after = _parts(rel)
    assert {p: after[p] for p in before} == before  # byte for byte
    assert {p: os.stat(rel / p).st_mtime_ns for p in before} == mtimes  # not even reopened for writing
    m2 = releases.read_manifest(str(rel))
    assert m2["parts"][: m1["n_parts"]] == m1["parts"]
    assert set(stats["new_parts"]) == set(after) - set(before)
    ids = [r["id"] for r in releases.load_release(str(rel))]
    assert ids == [f"r{i}" for i in range(16)] and len(set(ids)) == len(ids)
    assert m2["conversations"] == 16 and m2["created"] == m1["created"]

    # Nothing new: nothing is written, the manifest included.
    manifest_bytes = (rel / releases.MANIFEST).read_bytes()
    stats = _append(rel, second + [_record(5)])
    assert stats["added"] == 0 and stats["new_parts"] == []
    assert (rel / releases.MANIFEST).read_bytes() == manifest_bytes and _parts(rel) == after

    # Repeated ids inside one input are kept once (the first).
    dup = {"id": "r16", "conversations": _record(99)["conversations"]}
    stats = _append(rel, [_record(16), dup])
    assert stats["added"] == 1 and stats["duplicates"] == 1
    assert list(releases.load_release(str(rel)))[-1] == _record(16)


def test_a_part_from_an_interrupted_append_is_not_released_and_is_replaced(tmp_path):
    rel = tmp_path / "rel"
    _append(rel, [_record(0)])
    (rel / "part-00001.jsonl.zst").write_bytes(b"half-written")  # died before the manifest
    assert [r["id"] for r in releases.load_release(str(rel))] == ["r0"]
    _append(rel, [_record(1)])
    assert [r["id"] for r in releases.load_release(str(rel))] == ["r0", "r1"]


def test_a_corrupted_or_missing_part_raises_naming_it(tmp_path):
    rel = tmp_path / "rel"
    _append(rel, [_record(i) for i in range(20)], part_bytes=500)
    m = releases.read_manifest(str(rel))
    victim = m["parts"][1]
    path = rel / victim["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    found = hashlib.sha256(bytes(data)).hexdigest()
    for load in (lambda: list(releases.load_release(str(rel))), lambda: releases.released_ids(str(rel)),
                 lambda: formats.load_conversations(str(rel)),
                 lambda: _append(rel, [_record(99)])):
        with pytest.raises(releases.ReleaseHashError) as e:
            load()
        msg = str(e.value)
        assert victim["file"] in msg and victim["sha256"] in msg and found in msg
    path.unlink()
    with pytest.raises(releases.ReleaseHashError, match=rf"{victim['file']}: part missing.*{victim['sha256']}"):
        list(releases.load_release(str(rel)))


def test_data_made_with_another_recipe_or_target_is_refused(tmp_path):
    rel = tmp_path / "rel"
    _append(rel, [_record(0)])
    with pytest.raises(releases.ReleaseError, match=r"max_new_tokens=512 \(release: 256\)"):
        _append(rel, [_record(1)], generation={**GENERATION, "max_new_tokens": 512})
    with pytest.raises(releases.ReleaseError, match="target fingerprint"):
        _append(rel, [_record(1)], target={**TARGET, "fingerprint": "cd" * 32})
    # Another command with the same recipe (a resumed run with a new batch size) is fine.
    stats = _append(rel, [_record(1)], generation={**GENERATION, "command": GENERATION["command"] + " --batch_size 8"})
    assert stats["added"] == 1
    assert releases.read_manifest(str(rel))["parts"][1]["generation_command"].endswith("--batch_size 8")


def test_formats_and_pipeline_read_a_release_as_the_jsonl(tmp_path):
    recs = [_record(i, turns=1 + i % 2) for i in range(10)]
    jsonl = tmp_path / "gen.jsonl"
    sd.append_records(str(jsonl), recs)
    rel = tmp_path / "rel"
    _append(rel, recs, part_bytes=600)
    assert releases.read_manifest(str(rel))["n_parts"] > 1
    from_jsonl, _ = formats.load_conversations(str(jsonl))
    from_release, report = formats.load_conversations([str(rel)])
    assert from_release == from_jsonl and len(from_release) == 10 and report.n_bad == 0
    assert formats.load_conversations(str(rel), max_records=3)[0] == from_jsonl[:3]

    def batches(files):
        c = pipeline.default_data_config()
        c.update(max_length=64, global_batch_size=2, num_threads=0, prefetch_buffer_size=0, num_epochs=1,
                 train_files=files)
        return list(pipeline.make_train_iterator(ml_collections.ConfigDict({"data": c}), FakeChatTokenizer(), seed=3))

    a, b = batches(str(jsonl)), batches(f"{rel}")
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)

    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="without manifest.json"):
        formats.load_conversations(str(tmp_path / "plain_dir"))


class _Scripted:
    """generate_fn for regenerate_batch: answers [7, END]; records every prompt batch it saw."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, seed):
        self.calls += 1
        b = len(prompts)
        tokens = np.full((b, 3), -1, np.int32)
        tokens[:, 0], tokens[:, 1] = 7, 2
        return tokens, np.full((b,), 2), np.ones((b,), bool)


def test_generate_data_skips_conversations_a_release_holds(tmp_path):
    convs = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                          {"role": "assistant", "content": "old"}]} for i in range(8)]
    rel = tmp_path / "rel"
    _append(rel, [_record(i) for i in (1, 2, 5)])
    todo, n = sd.drop_released(convs, str(rel))
    assert n == 3 and [c["id"] for c in todo] == ["r0", "r3", "r4", "r6", "r7"]
    # A fresh output (the released data's JSONL is gone with its machine): only the rest is generated.
    out = tmp_path / "new.jsonl"
    stats = sd.generate_dataset(todo, str(out), FakeChatTokenizer(), _Scripted(), batch_size=2, max_prompt_len=99,
                                progress=False)
    assert stats["written"] == 5
    assert [r["id"] for r in sd.read_records(str(out))] == ["r0", "r3", "r4", "r6", "r7"]
    assert sd.drop_released(convs, str(tmp_path / "no_release_yet"))[1] == 0
    (rel / "part-00000.jsonl.zst").write_bytes(b"x")
    with pytest.raises(releases.ReleaseHashError):
        sd.drop_released(convs, str(rel))


def test_read_records_ignores_a_torn_line_without_touching_the_file(tmp_path):
    p = tmp_path / "o.jsonl"
    raw = b'{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}\n{"id": "c", "conv'
    p.write_bytes(raw)
    assert [r["id"] for r in sd.read_records(str(p))] == ["a", "b"]
    assert p.read_bytes() == raw  # a generate_data run may still be appending to it


def test_generation_command_settings_and_recorded_runs(tmp_path):
    s = gd.parse_generation_command(
        "nice python -m launch.generate_data --output 'a b.jsonl' --max_new_tokens 256 --temperature=0.7")
    assert (s["max_new_tokens"], s["temperature"], s["max_prompt_len"], s["model"], s["tokenizer"]) == (
        256, 0.7, 512, "smollm2-135m-instruct", "smollm2-135m-instruct")
    with pytest.raises(ValueError, match="not a launch.generate_data command"):
        gd.parse_generation_command("python -m launch.train")
    with pytest.raises(ValueError, match="cannot parse"):
        gd.parse_generation_command("python -m launch.generate_data --output x --no_such_flag 1")
    out = tmp_path / "o.jsonl"
    cmd = gd.record_run(str(out), ["/x/launch/generate_data.py", "--output", str(out), "--max_turns", "1"])
    assert cmd == f"python -m launch.generate_data --output {out} --max_turns 1"
    line = json.loads((tmp_path / "o.jsonl.runs.jsonl").read_text())
    assert line["command"] == cmd and line["settings"]["max_turns"] == 1 and line["settings"]["max_new_tokens"] == 512
    assert sd.recorded_settings([str(out)]) == {"command": cmd, **line["settings"]}  # read as JSON, not re-parsed
    # a runs file written before settings were recorded: its command is parsed
    legacy = tmp_path / "old.jsonl"
    (tmp_path / "old.jsonl.runs.jsonl").write_text(json.dumps({"command": cmd, "started": "x"}) + "\n")
    assert sd.recorded_settings([str(legacy)], legacy_parse=gd.parse_generation_command) == line["settings"] | {
        "command": cmd}
    with pytest.raises(ValueError, match="without its settings"):
        sd.recorded_settings([str(legacy)])


def test_release_data_cli_packs_appends_and_reads_back(tmp_path):
    """The CLI on SmolLM2's real tokenizer (no fingerprint: that would load the weights)."""
    inp = tmp_path / "gen.jsonl"
    recs = [_record(i, turns=1 + i % 2) for i in range(6)]
    sd.append_records(str(inp), recs[:4])
    with open(inp, "ab") as f:
        f.write(b'{"id": "r4", "conv')  # a run still writing
    gd.record_run(str(inp), ["generate_data.py", "--output", str(inp), "--max_new_tokens", "64"])
    rel = tmp_path / "releases" / "data" / "sg"
    cmd = [sys.executable, "-m", "launch.release_data", f"--input={inp}", f"--release={rel}", "--nofingerprint",
           "--part_mb=0.0005"]

    def run(*extra):
        p = subprocess.run(cmd + list(extra), cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    out = run()
    assert out["added"] == 4 and out["input_records"] == 4 and out["totals"]["n_parts"] == len(out["new_parts"]) >= 2
    m = releases.read_manifest(str(rel))
    assert m["generation"]["max_new_tokens"] == 64 and m["tokenizer"] == "smollm2-135m-instruct"
    assert m["target"] == {"model": "smollm2-135m-instruct", "fingerprint": None}
    from confu_jax.data.chat import ChatTokenizer
    tok = ChatTokenizer.load("smollm2-135m-instruct")
    want = sum(sum(tok.encode_chat(r["conversations"])[1]) for r in recs[:4])
    assert m["answer_tokens"] == want > 0
    first_parts = _parts(rel)

    # The run finished its line and wrote more; packing again appends only those.
    raw = inp.read_bytes()
    inp.write_bytes(raw[: raw.rindex(b"\n") + 1])
    sd.append_records(str(inp), recs[4:])
    out = run()
    assert out["added"] == 2 and out["already_released"] == 4 and out["totals"]["conversations"] == 6
    assert {p: _parts(rel)[p] for p in first_parts} == first_parts
    assert list(releases.load_release(str(rel))) == recs

    # A run with another recipe writing into the same output is refused.
    gd.record_run(str(inp), ["generate_data.py", "--output", str(inp), "--max_new_tokens", "128"])
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "different settings" in p.stderr
