"""Conversation parsing: fixtures with malformed records, and the real (truncated) ShareGPT file."""

import json
import os
import re

import pytest

from confu_jax import assets
from confu_jax.data import formats

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
SHAREGPT_FIX = os.path.join(FIX, "sharegpt_truncated.json")
SPECFORGE_FIX = os.path.join(FIX, "specforge.jsonl")
ULTRACHAT_FIX = os.path.join(FIX, "ultrachat.jsonl")


def _bad(report):
    return [(os.path.basename(b.path), b.line, b.reason) for b in report.bad_examples]


def test_sharegpt_fixture_records_reasons_and_lines():
    convs, report = formats.load_conversations(SHAREGPT_FIX)
    assert [c["id"] for c in convs] == ["good_1", "leading_gpt", "system_prompt", "good_last"]
    f = "sharegpt_truncated.json"
    # Lines are where each record starts (hand-checked in the fixture).
    assert _bad(report) == [
        (f, 17, "unknown_role"),
        (f, 24, "invalid_json"),
        (f, 40, "not_an_object"),
        (f, 41, "empty_turn"),
        (f, 48, "no_conversation"),
        (f, 49, "no_assistant"),
        (f, 55, "bad_turn"),
    ]
    assert report.n_ok == 4 and report.n_bad == 7
    assert report.truncated == [(SHAREGPT_FIX, 63)]
    assert report.n_leading_assistant_dropped == 1
    summary = report.summary()
    assert "4 records" in summary and "unknown_role=1" in summary and ":63" in summary


def test_sharegpt_fixture_normalisation():
    convs, _ = formats.load_conversations(SHAREGPT_FIX)
    by_id = {c["id"]: c["messages"] for c in convs}
    assert by_id["good_1"] == [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ]
    # The leading assistant turn of a split conversation is dropped.
    assert [m["role"] for m in by_id["leading_gpt"]] == ["user", "assistant"]
    assert by_id["system_prompt"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": 'Say "hi" with braces {like [this]}.'},
        {"role": "assistant", "content": "hi {like [this]}"},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "hi"},
    ]
    assert by_id["good_last"][0]["content"] == "Unicode: caf\u00e9 \u2603"


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 20])
def test_json_array_streaming_is_independent_of_chunk_size(chunk_chars):
    """Records straddling read boundaries (any chunk size) decode to the same values and lines."""
    got = list(formats.iter_json_array(SHAREGPT_FIX, chunk_chars=chunk_chars))
    ref = list(formats.iter_json_array(SHAREGPT_FIX, chunk_chars=1 << 24))
    assert got == ref
    assert [line for line, _, _ in got] == [2, 9, 17, 24, 30, 40, 41, 48, 49, 55, 56, 63]
    assert got[-1][2].startswith("truncated")


def test_json_array_complete_file_and_separator_errors(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[{"a": 1},\n {"b": [1, 2]}\n {"c": 3},, {"d": 4},\n]', encoding="utf-8")
    items = list(formats.iter_json_array(str(p), chunk_chars=3))
    values = [v for _, v, e in items if e is None]
    errors = [(line, e.split(":")[0]) for line, _, e in items if e is not None]
    assert values == [{"a": 1}, {"b": [1, 2]}, {"c": 3}, {"d": 4}]
    # A missing comma, a doubled comma and a trailing comma are each reported on their line.
    assert errors == [
        (3, "expected ',' or ']' between records, found '{'"),
        (3, "invalid JSON"),
        (4, "invalid JSON"),
    ]


def test_fail_mode_names_file_and_line():
    with pytest.raises(formats.BadRecordError, match=r"sharegpt_truncated\.json:17: unknown_role.*'robot'"):
        formats.load_conversations(SHAREGPT_FIX, on_bad_record="fail")
    with pytest.raises(ValueError, match="on_bad_record"):
        formats.load_conversations(SHAREGPT_FIX, on_bad_record="ignore")


def test_specforge_and_ultrachat_jsonl():
    convs, report = formats.load_conversations([SPECFORGE_FIX, ULTRACHAT_FIX])
    assert [c["id"] for c in convs] == ["sf_1", "sf_2", "sf_3", "uc_1", "ultrachat.jsonl:2"]
    assert convs[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in convs[2]["messages"]] == ["1+1?", "2", "2+2?", "4"]
    assert convs[3]["messages"][1] == {"role": "assistant", "content": "By flapping their wings fast."}
    assert _bad(report) == [
        ("specforge.jsonl", 3, "invalid_json"),
        ("specforge.jsonl", 4, "unknown_role"),
        ("specforge.jsonl", 6, "empty_turn"),
        ("specforge.jsonl", 7, "not_an_object"),
        ("ultrachat.jsonl", 3, "bad_turn"),
    ]
    assert report.truncated == []


def test_max_records_stops_early():
    convs, report = formats.load_conversations([SPECFORGE_FIX, ULTRACHAT_FIX], max_records=3)
    assert [c["id"] for c in convs] == ["sf_1", "sf_2", "sf_3"]
    assert report.n_ok == 3


def test_missing_file_error_names_path():
    with pytest.raises(FileNotFoundError, match="no_such_file.jsonl"):
        formats.load_conversations("no_such_file.jsonl")


def test_real_sharegpt_yields_every_complete_record():
    """Every record of the wheel's truncated file is decoded, checked against the file's own layout.

    The file is pretty-printed with records starting at a line ``  {`` and their id on the next line;
    that independent view lists every record start, the last one being the cut-off record.
    """
    try:
        path = assets.resolve("sharegpt")
    except assets.AssetNotFoundError as e:
        pytest.skip(str(e))
    starts, ids = [], []
    id_re = re.compile(r'^    "id": (".*"),$')
    with open(path, encoding="utf-8") as f:
        prev = None
        for lineno, text in enumerate(f, start=1):
            if prev == "  {\n":
                m = id_re.match(text)
                assert m, f"line {lineno} of {path} does not hold a record id"
                starts.append(lineno - 1)
                ids.append(json.loads(m.group(1)))
            prev = text
    items = list(formats.iter_json_array(path))
    complete = [(line, v) for line, v, e in items if e is None]
    assert [line for line, _ in complete] == starts[:-1]
    assert [v["id"] for _, v in complete] == ids[:-1]
    assert items[-1][0] == starts[-1] and items[-1][2].startswith("truncated")
    assert len(complete) > 17000

    convs, report = formats.load_conversations(path)
    assert report.n_ok + report.n_bad == len(complete)
    assert report.truncated == [(path, starts[-1])]
    assert all(m["role"] in formats.ROLES and m["content"].strip() for c in convs for m in c["messages"])
