"""Self-distillation over several processes (``confu_jax.data.distill_shards``, ``launch.generate_data``):
which process answers which conversation, the merge, and the whole thing as a node would run it —
two processes, each with the target split over its 2 CPU devices, against one process on one device
(greedy: the same answers), merged into one output with no conversation twice, then released.
"""

import json
import os
import subprocess
import sys

import pytest

from confu_jax.data import distill_shards as ds
from tests.helpers.tiny_checkpoints import hf_llama, write_hf_tokenizer
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_process_slot_reads_flags_then_the_jax_variables(monkeypatch):
    """Flags, then JAX_PROCESS_ID / JAX_NUM_PROCESSES, else one process (a bare environment: JAX
    detects no cluster). Slots found by JAX's cluster detection (SLURM, TPU pods):
    tests/e2e/test_cluster_launch.py."""
    for key in list(os.environ):
        monkeypatch.delenv(key)
    assert ds.process_slot() == (0, 1)
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    assert ds.process_slot() == (1, 2)
    assert ds.process_slot(2, 3) == (2, 3)  # flags win
    with pytest.raises(ValueError, match="both"):
        ds.process_slot(1, None)
    with pytest.raises(ValueError, match="expected"):
        ds.process_slot(3, 3)


def test_merge_is_in_input_order_and_refuses_a_record_twice(tmp_path):
    out = str(tmp_path / "d.jsonl")
    order = [f"c{i}" for i in range(6)]
    shards = [[], []]
    for cid in reversed(order):  # each shard in the reverse of input order
        shards[ds.shard_of(cid, 2)].append({"id": cid})
    assert all(shards)  # both shards hold some

    def read(path):
        with open(path) as f:
            return [json.loads(line) for line in f]

    for i, recs in enumerate(shards):
        with open(ds.shard_output(out, i, 2), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    assert ds.merge_shards(out, 2, order, read) == {"merged": 6, "shards": 2}
    assert [r["id"] for r in read(out)] == order
    with open(ds.shard_output(out, 1, 2), "a") as f:
        f.write(json.dumps(shards[0][0]) + "\n")
    with pytest.raises(ValueError, match="shard 0 and shard 1"):
        ds.merge_shards(out, 2, order, read)


def test_a_marker_counts_only_for_the_split_it_was_made_for(tmp_path):
    out = str(tmp_path / "d.jsonl")
    assignment = [["a", "c"], ["b"]]
    ds.mark_done(ds.shard_output(out, 0, 2), ["a", "c"], {})
    ds.mark_done(ds.shard_output(out, 1, 2), ["b", "d"], {})  # a marker from a run with more input
    waits = []
    with pytest.raises(TimeoutError, match=r"shards \[1\]"):
        ds.wait_for_shards(out, assignment, poll_s=0.0, timeout_s=0.0, sleep=waits.append)
    ds.mark_done(ds.shard_output(out, 1, 2), ["b"], {})
    ds.wait_for_shards(out, assignment, poll_s=0.0, timeout_s=0.0)


def _cli(args, env, timeout=600):
    return subprocess.Popen([sys.executable, "-m", "launch.generate_data", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_with_a_split_target_write_what_one_process_writes(tmp_path):
    model = tmp_path / "model"
    hf_llama(model, seed=9, vocab=300, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=96, max_pos=512)
    write_hf_tokenizer(model)
    data = tmp_path / "in.jsonl"
    topics = ["cats", "rain", "tea", "maps", "jazz", "snow", "bees", "salt", "wind"]
    with open(data, "w") as f:
        for i, t in enumerate(topics):
            turns = [{"from": "human", "value": f"Tell me about {t}."}, {"from": "gpt", "value": "old"}]
            f.write(json.dumps({"id": f"q{i}", "conversations": turns}) + "\n")
    common = ["--model", str(model), "--input", str(data), "--max_new_tokens", "10", "--batch_size", "4",
              "--max_prompt_len", "96"]
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    one = tmp_path / "one.jsonl"
    p = _cli(common + ["--output", str(one)], env)
    assert p.wait(600) == 0, p.stderr.read()[-3000:]

    node = tmp_path / "node.jsonl"
    procs = [_cli(common + ["--output", str(node), "--shard_target", "--cpu_devices", "2"],
                  dict(env, JAX_PROCESS_ID=str(i), JAX_NUM_PROCESSES="2")) for i in range(2)]
    outs = [(p.wait(600), p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
    want = sorted(_records(one), key=lambda r: int(r["id"][1:]))  # (a conversation whose answer comes back
    assert len(want) >= len(topics) - 2  # empty — the target ended its turn at once — is not written)
    summary = json.loads(outs[0][1].strip().splitlines()[-1])
    assert summary["merged"] == {"merged": len(want), "shards": 2, "output": str(node)}
    shard_ids = [[r["id"] for r in _records(ds.shard_output(str(node), i, 2))] for i in range(2)]
    assert all(shard_ids) and not set(shard_ids[0]) & set(shard_ids[1])  # each process its own conversations
    merged = _records(node)
    assert merged == want  # the same greedy answers, in input order, each once
    assert all(r["conversations"][-1]["content"] != "old" for r in merged)

    # a rerun resumes: nothing is generated again, the merge is rewritten identically
    again = _cli(common + ["--output", str(node), "--shard_index", "1", "--num_shards", "2"], env)
    assert again.wait(600) == 0
    assert json.loads(again.stdout.read().strip().splitlines()[-1])["already_done"] == len(shard_ids[1])

    # the merged output is one release with its manifest (the recorded command is the node's)
    release = tmp_path / "release"
    r = subprocess.run([sys.executable, "-m", "launch.release_data", "--input", str(node), "--release", str(release),
                        "--nofingerprint"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from confu_jax.data import releases

    manifest = releases.verify_release(str(release))
    assert manifest["conversations"] == len(want)
    assert sorted(rec["id"] for rec in releases.load_release(str(release))) == sorted(r["id"] for r in merged)


def test_a_second_writer_of_one_output_stops_in_one_line_naming_the_first(tmp_path):
    """Two resumes of one --output would both skip the ids already written and append the same
    conversations (interleaved): while one holds ``<output>.lock``, the other stops before loading the
    target, exit 2, naming the holder's pid; the lock goes with its holder (released on exit)."""
    from confu_jax.runs.lock import output_lock

    model = tmp_path / "model"
    hf_llama(model, seed=9, vocab=300, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96, max_pos=1024)
    write_hf_tokenizer(model)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "q0", "conversations": [{"from": "human", "value": "Hi."},
                                                              {"from": "gpt", "value": "old"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("CONFU_JAX_TRACEBACK", None)
    args = ["--model", str(model), "--input", str(data), "--output", str(out), "--max_new_tokens", "4"]
    with output_lock(str(out)):
        p = _cli(args, env)
        rc, err = p.wait(300), p.stderr.read()
    lines = [ln for ln in err.splitlines() if ln.startswith("launch.generate_data: ")]
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert f"being written by another process (pid {os.getpid()}" in lines[0]
    assert not out.exists()
    p = _cli(args, env)
    assert p.wait(300) == 0, p.stderr.read()[-2000:]
    assert [r["id"] for r in _records(out)] == ["q0"]


@pytest.mark.slow
def test_every_local_device_generates_and_the_output_is_what_one_device_writes(tmp_path):
    """4 CPU devices in one process: a replica of the target and an engine on each, each device its share
    of the conversations (the summary's per-device counts, all non-zero); merged in input order, the
    records equal a one-device run's (greedy)."""
    model = tmp_path / "model"
    hf_llama(model, seed=9, vocab=300, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96, max_pos=512)
    write_hf_tokenizer(model)
    data = tmp_path / "in.jsonl"
    topics = ["cats", "rain", "tea", "maps", "jazz", "snow", "bees", "salt", "wind", "moss", "clay", "ink"]
    with open(data, "w") as f:
        for i, t in enumerate(topics):
            turns = [{"from": "human", "value": f"Tell me about {t}."}, {"from": "gpt", "value": "old"}]
            f.write(json.dumps({"id": f"q{i}", "conversations": turns}) + "\n")
    common = ["--model", str(model), "--input", str(data), "--max_new_tokens", "8", "--batch_size", "2",
              "--max_prompt_len", "64"]
    # no device count (--cpu_devices sets it), the suite's code generation (LLVM -O1)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=SINGLE_DEVICE)
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    p = _cli(common + ["--output", str(one), "--devices", "1", "--cpu_devices", "4"], env)
    assert p.wait(600) == 0, p.stderr.read()[-3000:]
    p = _cli(common + ["--output", str(four), "--cpu_devices", "4"], env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    per = summary["devices"]
    assert len(per) == 4 and len({d["device"] for d in per}) == 4
    assert all(d["conversations"] > 0 and d["tokens_generated"] > 0 for d in per), per
    assert sum(d["conversations"] for d in per) == len(topics)
    assert summary["merged"]["merged"] == summary["written"] == len(_records(one))
    assert _records(four) == _records(one)
