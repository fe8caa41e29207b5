"""``gs://`` paths end to end, against a local GCS emulator this module starts (tests/helpers/gcs_emulator.py).

A target checkpoint, its tokenizer, the training data, the workdir (config, metric CSVs, orbax
checkpoints) and released heads and data all live in the emulated bucket; each result is checked
against the same thing done on a local disk: the sharded load equals the local one and reads each
byte once, a training run there gives the local run's losses bit for bit and resumes to them, a
release loads with its hash check (and a changed byte is caught). The workdir lock says plainly that
an object store cannot be locked.

Every other command that takes a path runs with its paths in the bucket too, as a subprocess (the
emulator's address reaches it through the environment): ``launch.export_head`` (a gs:// run in, a
gs:// export out, equal to the local export), ``launch.release_head``, ``launch.generate_data`` and
``launch.release_data`` (self-distilled output appended to an object, then released there),
``launch.decode_bench --out``, ``launch.sweep`` and ``launch.plot_training``; no staging or append
leftovers remain in the bucket.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")

from confu_jax import sharding as shd, storage  # noqa: E402
from confu_jax.models.llama import init_params, param_shapes  # noqa: E402
from confu_jax.models.presets import get_preset  # noqa: E402
from confu_jax.weights import load_model, load_model_sharded  # noqa: E402
from confu_jax.weights.export import save_hf  # noqa: E402
from confu_jax.weights.hf import open_tensors  # noqa: E402
from confu_jax.weights.tree import ReadCounter  # noqa: E402
from tests.helpers.gcs_emulator import SERVED, emulated_gcs  # noqa: E402

from tests.helpers.tiny_checkpoints import tiny_vocab  # noqa: E402
from tests.helpers.xla_env import SINGLE_DEVICE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the test tokenizer's vocabulary, rounded up to a multiple of the 8 devices
CFG = get_preset("tiny").replace(tie_embeddings=False, n_layers=4, vocab_size=-(-len(tiny_vocab()[0]) // 64) * 64)
ROWS = [{"messages": [{"role": "user", "content": f"q {i} a b"},
                      {"role": "assistant", "content": f"d e {i} f g " * 3}]} for i in range(48)]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The emulated bucket holding ``target/`` (a Hugging Face directory) and ``data.jsonl``; and the
    same files on the local disk."""
    from tests.helpers.tiny_checkpoints import write_hf_tokenizer

    local = tmp_path_factory.mktemp("local")
    target = str(local / "target")
    save_hf(CFG, jax.device_get(init_params(CFG, jax.random.PRNGKey(3))), target)
    write_hf_tokenizer(target)
    (local / "data.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    with emulated_gcs() as root:
        storage.copy_tree(target, f"{root}/target")
        with storage.open(f"{root}/data.jsonl", "w") as f:
            f.write((local / "data.jsonl").read_text())
        yield {"root": root, "local": str(local)}


@pytest.fixture(scope="module")
def trained_head(bucket, tmp_path_factory):
    """An EAGLE-3 head of the bucket's target as a trainable-tree export (what ``load_trained_head``
    reads like a workdir), on the local disk: ``dir``, ``spec``, ``trainable``, ``vocab``."""
    from confu_jax.models.params import init_trainable
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.trainable_export import TrainedHead, write_trainable
    from confu_jax.train.target_loading import resolve_target

    config = _config(os.path.join(bucket["local"], "target"), "unused", 1)
    resolve_target(config)
    spec = model_spec_from_config(config)
    trainable = jax.device_get(init_trainable(spec, jax.random.PRNGKey(0)))
    vocab = {"d2t": np.arange(spec.head.draft_vocab_size, dtype=np.int32),
             "t2d": np.arange(spec.target.vocab_size) < spec.head.draft_vocab_size}
    head_dir = str(tmp_path_factory.mktemp("trained") / "head")
    write_trainable(TrainedHead(config, spec, trainable, vocab, 7), head_dir, dtype="float32")
    return {"dir": head_dir, "spec": spec, "trainable": trainable, "vocab": vocab}


def _cli(module: str, *args, cwd=REPO) -> subprocess.CompletedProcess:
    """``python -m module args`` on one CPU device; the emulator's address (STORAGE_EMULATOR_HOST) comes
    with the environment."""
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    return r


def _objects(prefix: str) -> list:
    return storage.files_under(prefix) if storage.isdir(prefix) else []


@pytest.mark.slow
def test_a_target_on_gs_loads_sharded_and_reads_each_byte_once(bucket):
    root, local = bucket["root"], bucket["local"]
    mesh = shd.make_mesh(1, 4, 2)
    shardings = shd.tree_shardings(param_shapes(CFG), mesh, axis_units=shd.llama_axis_units(CFG.head_dim))
    counter = ReadCounter()
    SERVED.clear()
    cfg, sharded = load_model_sharded(f"{root}/target", shardings, "float32", counter)
    served = dict(SERVED)
    cfg_local, host = load_model(os.path.join(local, "target"), "float32")
    assert cfg == cfg_local
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree_util.tree_leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    files = open_tensors(os.path.join(local, "target"))
    assert counter.bytes == sum(int(np.prod(f.info(n)[1])) * 4 for n, f in files.items())
    # what crossed the wire: each byte of the weights once (ranged GETs of the header and of each row slab
    # the devices need, no read-ahead), and no per-read metadata request
    size = os.path.getsize(os.path.join(local, "target", "model.safetensors"))
    assert served["target/model.safetensors"]["bytes"] == size, served
    assert served["requests"] <= served["target/model.safetensors"]["gets"] + 30, served


def _config(source: str, data: str, steps: int):
    from configs.common import base_config

    config = base_config(None, "eagle3")
    with config.unlocked():
        config.model.source = source
        config.data.train_files = data
        config.data.max_length = 32
        config.data.global_batch_size = 8
        config.objective.eval_records = 0
        config.train.steps = steps
        config.train.log_every = 1
        config.train.checkpoint.every = 2
        config.train.checkpoint.async_save = False
        config.train.progress_bar = False
        config.train.tensorboard = "off"
    return config


@pytest.mark.slow
def test_training_in_a_gs_workdir_matches_the_local_run_and_resumes(bucket, tmp_path, caplog):
    """Target, data and workdir on gs://: the losses of a run preempted at step 2 and resumed to 4 are
    those of the uninterrupted local run; the checkpoints and CSVs are in the bucket."""
    from confu_jax.train.loop import train
    from confu_jax.train.metric_writers import read_csv

    root, local = bucket["root"], bucket["local"]
    ref_dir = str(tmp_path / "ref")
    train(_config(os.path.join(local, "target"), os.path.join(local, "data.jsonl"), 4), ref_dir)
    ref = read_csv(os.path.join(ref_dir, "metrics.csv"))

    workdir = f"{root}/runs/eagle3"

    def preempt_after_step_1(step, state, metrics):  # the notice a preempted VM gets: save and stop
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with caplog.at_level(logging.WARNING):
        first = train(_config(f"{root}/target", f"{root}/data.jsonl", 4), workdir, hooks=[preempt_after_step_1])
    assert first.step == 2 and first.preempted
    assert any("cannot be locked" in r.getMessage() for r in caplog.records)
    assert storage.isdir(f"{workdir}/checkpoints/2")
    resumed = train(_config(f"{root}/target", f"{root}/data.jsonl", 4), workdir)
    assert resumed.step == 4
    rows = read_csv(f"{workdir}/metrics.csv")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for r, q in zip(rows, ref):
        np.testing.assert_allclose(r["loss"], q["loss"], rtol=1e-6, atol=0, err_msg=f"step {q['step']}")
    # a run initialised from the gs:// run's checkpoints starts from its step-4 parameters
    init = _config(f"{root}/target", f"{root}/data.jsonl", 1)
    with init.unlocked():
        init.train.checkpoint.init_from = workdir
    train(init, str(tmp_path / "from_gs"))
    record = json.loads((tmp_path / "from_gs" / "init_from.json").read_text())
    assert record["step"] == 4 and record["source"].startswith(f"{workdir}/checkpoints"), record
    saved = json.loads(storage.read_text(f"{workdir}/config.json"))
    assert saved["model"]["source"] == f"{root}/target"
    assert json.loads(storage.read_text(f"{workdir}/target.json")) == \
        json.loads(open(os.path.join(ref_dir, "target.json")).read()) | {"source": saved["model"]["source"]}


def test_released_heads_and_data_load_from_gs_with_their_hash_check(bucket, trained_head, tmp_path):
    """A data release, a trainable-tree head release and an EAGLE-3 export in speculators' layout, each
    copied to the bucket: read back equal to the local copy; a changed byte fails the hash check."""
    from confu_jax.data.releases import ReleaseError, ReleaseHashError, append_release, load_release
    from confu_jax.runs.head_release import HeadReleaseError, verify_head_release, write_head_manifest
    from confu_jax.runs.heads import load_trained_head

    root = bucket["root"]
    # data: a release appended locally, copied to the bucket, read back with every part's hash checked
    records = [{"id": f"r{i}", "conversations": r["messages"]} for i, r in enumerate(ROWS[:12])]
    data_dir = str(tmp_path / "data_release")
    append_release(data_dir, records, count_tokens=lambda r: 5, target={"model": "tiny", "fingerprint": "f"},
                   tokenizer="tiny", generation={"command": "test"}, part_bytes=600)
    storage.copy_tree(data_dir, f"{root}/releases/data")
    assert list(load_release(f"{root}/releases/data")) == list(load_release(data_dir)) == records
    # appended in the bucket (unlocked there, with a warning): only the new records, a new part, the
    # manifest replaced after it; the recipe is checked as on a disk
    more = [{"id": f"m{i}", "conversations": r["messages"]} for i, r in enumerate(ROWS[12:15])]
    stats = append_release(f"{root}/releases/data", records + more, count_tokens=lambda r: 5,
                           target={"model": "tiny", "fingerprint": "f"}, tokenizer="tiny",
                           generation={"command": "test"}, part_bytes=600)
    assert stats["added"] == 3 and stats["already_released"] == 12 and len(stats["new_parts"]) == 1
    assert list(load_release(f"{root}/releases/data")) == records + more
    with pytest.raises(ReleaseError, match="temperature"):
        append_release(f"{root}/releases/data", more, count_tokens=lambda r: 5, target={"model": "tiny",
                       "fingerprint": "f"}, tokenizer="tiny", generation={"command": "t", "temperature": 0.7})
    part = f"{root}/releases/data/part-00000.jsonl.zst"
    with storage.open(part, "rb") as f:
        blob = bytearray(f.read())
    blob[-1] ^= 1
    with storage.open(part, "wb") as f:
        f.write(bytes(blob))
    with pytest.raises(ReleaseHashError, match="sha256 mismatch"):
        list(load_release(f"{root}/releases/data"))

    # a head: a trainable-tree export with its manifest, copied to the bucket, loads as the local one
    head_dir = str(tmp_path / "head")
    shutil.copytree(trained_head["dir"], head_dir)
    spec, trainable, vocab = trained_head["spec"], trained_head["trainable"], trained_head["vocab"]
    write_head_manifest(head_dir, name="tiny", files=sorted(os.listdir(head_dir)), data=None, training={"step": 7},
                        target={}, tau={}, command="test", commit=None)
    storage.copy_tree(head_dir, f"{root}/releases/head")
    verify_head_release(f"{root}/releases/head")
    remote, here = load_trained_head(f"{root}/releases/head"), load_trained_head(head_dir)
    assert remote.step == here.step == 7
    for a, b in zip(jax.tree_util.tree_leaves(remote.trainable), jax.tree_util.tree_leaves(here.trainable)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(remote.draft_vocab["d2t"], here.draft_vocab["d2t"])
    # the same head in speculators' layout (vLLM's EAGLE-3 format) reads from the bucket as from disk
    from confu_jax.weights.eagle3_formats import export_head, load_head

    spec_dir = str(tmp_path / "speculators")
    export_head(spec_dir, "speculators", spec, trainable["draft"], vocab["d2t"], vocab["t2d"])
    storage.copy_tree(spec_dir, f"{root}/releases/speculators")
    got, want = load_head(f"{root}/releases/speculators"), load_head(spec_dir)
    assert got.head == want.head and got.fmt == want.fmt == "speculators"
    for a, b in zip(jax.tree_util.tree_leaves(got.draft), jax.tree_util.tree_leaves(want.draft)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(got.d2t, want.d2t)
    np.testing.assert_array_equal(got.t2d, want.t2d)

    with storage.open(f"{root}/releases/head/draft_vocab.npz", "wb") as f:
        f.write(b"changed")
    with pytest.raises(HeadReleaseError, match="sha256"):
        verify_head_release(f"{root}/releases/head")


def test_export_head_reads_a_gs_run_and_writes_a_gs_export_equal_to_the_local_one(bucket, trained_head, tmp_path):
    """``launch.export_head --workdir gs://... --out gs://...``: the export in the bucket is the one the
    local writer makes (same config.json, same tensors), and no staging object is left beside it."""
    from confu_jax.decode.families import EXPORT_FORMATS
    from confu_jax.weights.eagle3_formats import load_head

    root = bucket["root"]
    storage.copy_tree(trained_head["dir"], f"{root}/heads/export_src")
    r = _cli("launch.export_head", "--workdir", f"{root}/heads/export_src", "--format", "eagle3",
             "--out", f"{root}/exports/e3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"to {root}/exports/e3 in the eagle3 format" in r.stdout, r.stdout
    local = str(tmp_path / "e3")
    EXPORT_FORMATS["eagle3"].write(trained_head["dir"], local)
    assert _objects(f"{root}/exports") == ["e3/config.json", "e3/model.safetensors"]
    assert storage.read_text(f"{root}/exports/e3/config.json") == (tmp_path / "e3" / "config.json").read_text()
    got, want = load_head(f"{root}/exports/e3"), load_head(local)
    assert got.head == want.head
    for a, b in zip(jax.tree_util.tree_leaves(got.draft), jax.tree_util.tree_leaves(want.draft)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(got.d2t, want.d2t)


@pytest.mark.slow
def test_release_head_from_a_gs_run_into_a_gs_release(bucket, trained_head, tmp_path):
    """``launch.release_head`` with the run, the data release and the release folder in the bucket: the
    release verifies there (every file's hash), names the data release by its manifest's hash, and a
    second release with no τ gain is refused and leaves the first one as it was."""
    import hashlib

    from confu_jax.data.releases import append_release
    from confu_jax.runs.head_release import read_head_manifest, verify_head_release

    root = bucket["root"]
    storage.copy_tree(trained_head["dir"], f"{root}/heads/release_src")
    data = f"{root}/releases/head_data"
    append_release(data, [{"id": "a", "conversations": ROWS[0]["messages"]}], count_tokens=lambda r: 3,
                   target={"model": "tiny", "fingerprint": None}, tokenizer="tiny", generation={"command": "t"})
    release = f"{root}/releases/heads/tiny_eagle3"
    r = _cli("launch.release_head", "--workdir", f"{root}/heads/release_src", "--release", release, "--data", data,
             "--tau", "heldout_decode_chain3=1.5")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = verify_head_release(release)
    assert manifest["data"]["manifest_sha256"] == hashlib.sha256(
        storage.read_bytes(f"{data}/manifest.json")).hexdigest()
    assert manifest["training"]["step"] == 7 and manifest["tau"] == {"heldout_decode_chain3": 1.5}
    assert _objects(release) == sorted(["manifest.json", *(f["file"] for f in manifest["files"])])
    before = storage.read_text(f"{release}/manifest.json")
    r = _cli("launch.release_head", "--workdir", f"{root}/heads/release_src", "--release", release,
             "--tau", "heldout_decode_chain3=1.52")
    assert r.returncode == 1 and "not released" in r.stderr, r.stderr[-2000:]
    assert storage.read_text(f"{release}/manifest.json") == before
    assert read_head_manifest(release)["tau"] == {"heldout_decode_chain3": 1.5}


@pytest.mark.slow
def test_self_distillation_appends_to_a_gs_object_and_is_released_there(bucket):
    """``launch.generate_data`` with target, input and output in the bucket: the output object grows
    by composed appends (no piece left over), its runs are recorded beside it, a torn last line is cut
    on resume; ``launch.release_data`` packs it into a release in the bucket, hash-checked on reading."""
    from confu_jax.data.releases import load_release, verify_release
    from confu_jax.decode import self_distill

    root = bucket["root"]
    out = f"{root}/distill/out.jsonl"
    r = _cli("launch.generate_data", "--model", f"{root}/target", "--input", f"{root}/data.jsonl", "--output", out,
             "--max_records", "3", "--max_new_tokens", "4", "--batch_size", "3", "--max_prompt_len", "32")
    assert r.returncode == 0, r.stderr[-3000:]
    records = self_distill.read_records(out)
    ids = [rec["id"] for rec in records]
    assert ids and len(set(ids)) == len(ids) and json.loads(r.stdout.strip().splitlines()[-1])["written"] == len(ids)
    assert all(rec["conversations"][-1]["role"] == "assistant" for rec in records)
    assert _objects(f"{root}/distill") == ["out.jsonl", "out.jsonl.runs.jsonl"]
    run = json.loads(storage.read_text(out + ".runs.jsonl"))
    assert run["settings"]["model"] == f"{root}/target" and run["settings"]["max_new_tokens"] == 4
    # a resumed run skips what is there and cuts a torn line first (the object is rewritten to its good bytes)
    storage.append_text(out, '{"id": "torn", "conv')
    assert self_distill.read_done_ids(out) == set(ids)
    assert self_distill.read_records(out) == records and storage.read_text(out).endswith("\n")

    release = f"{root}/releases/distilled"
    r = _cli("launch.release_data", "--input", out, "--release", release, "--nofingerprint")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = verify_release(release)
    assert manifest["conversations"] == len(records) and manifest["generation"]["model"] == f"{root}/target"
    assert list(load_release(release)) == records


def test_self_distillation_writes_a_gs_object_at_most_once_per_interval(bucket, monkeypatch):
    """GCS takes about one mutation a second per object: the continuous engine finishing a conversation
    every 0.1 s (a fake clock) appends to the output object once per ``REMOTE_APPEND_INTERVAL_S`` (5 s),
    not once per conversation; every record is there, in input order, after the run (the buffer is
    written at the end), and a local output is still appended at once."""
    import time

    from confu_jax.decode import self_distill as sd
    from tests.helpers.fake_chat import FakeChatTokenizer, InstantEngine as Instant

    now = [0.0]

    def clock():
        now[0] += 0.05  # two readings per conversation: 0.1 s each
        return now[0]

    monkeypatch.setattr(time, "monotonic", clock)
    writes = []
    real = storage.append_text
    monkeypatch.setattr(storage, "append_text", lambda path, text: (writes.append(path), real(path, text)))
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                          {"role": "assistant", "content": "old"}]} for i in range(200)]
    out = f"{bucket['root']}/distill_rate/out.jsonl"
    stats = sd.generate_dataset_continuous(convs, out, FakeChatTokenizer(), Instant(), max_prompt_len=200,
                                           progress=False)
    assert stats["written"] == 200 and [r["id"] for r in sd.read_records(out)] == [c["id"] for c in convs]
    assert 2 <= len(writes) <= 200 * 0.1 / sd.REMOTE_APPEND_INTERVAL_S + 2, len(writes)
    local = []
    monkeypatch.setattr(storage, "append_text", lambda path, text: (local.append(path), real(path, text)))
    with sd.RecordAppender(os.path.join(bucket["local"], "local.jsonl")) as a:
        for c in convs[:5]:
            a.add([{"id": c["id"]}])
    assert len(local) == 5


def test_distill_shards_are_marked_and_merged_in_the_bucket(bucket):
    """The multi-process parts of generate_data on gs://: each shard appended to its own object, its
    ``.done`` marker, the wait for every marker and the merge in input order."""
    from confu_jax.data import distill_shards as ds
    from confu_jax.decode.self_distill import append_records, read_records

    out = f"{bucket['root']}/shards/merged.jsonl"
    order = ["a", "b", "c", "d", "e"]
    assignment = [[i for i in order if ds.shard_of(i, 2) == s] for s in range(2)]
    for s, ids in enumerate(assignment):
        path = ds.shard_output(out, s, 2)
        for i in ids:  # one append per conversation, as the continuous engine writes
            append_records(path, [{"id": i, "conversations": [{"role": "assistant", "content": i}]}])
        assert [r["id"] for r in read_records(path)] == ids
        assert not ds.is_done(path, ids)
        ds.mark_done(path, ids, {"written": len(ids)})
        assert ds.is_done(path, ids) and not ds.is_done(path, ids + ["x"])
    ds.wait_for_shards(out, assignment, poll_s=0.0, timeout_s=0.0)
    assert ds.merge_shards(out, 2, order, read_records) == {"merged": 5, "shards": 2}
    assert [r["id"] for r in read_records(out)] == order


@pytest.mark.slow
def test_decode_bench_writes_results_table_figure_and_parts_to_gs(bucket, tmp_path):
    """``launch.decode_bench --out gs://...``: results.json, the .md table, the .png figure and the
    resumable parts are objects in the bucket; a rerun resumes from those parts."""
    from confu_jax.bench.report import load_results
    from tests.helpers.tiny_chat_model import tiny_chat_gguf

    gguf = tiny_chat_gguf(tmp_path)
    questions = tmp_path / "q.jsonl"
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specbench_sample.jsonl")) as f:
        questions.write_text(f.readline())
    base = f"{bucket['root']}/bench/run"
    args = ["--model", gguf, "--methods", "ar", "--prompts", questions, "--n_per_category", "0",
            "--max_new_tokens", "4", "--out", base + ".json"]
    r = _cli("launch.decode_bench", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = load_results(base + ".json")
    assert row["method"] == "ar" and row["tau"] == pytest.approx(1.0)
    assert "| ar |" in storage.read_text(base + ".md") and storage.read_bytes(base + ".png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert _objects(f"{bucket['root']}/bench") == ["run.json", "run.md", "run.parts/ar__T0.json",
                                                   "run.parts/settings.json", "run.png"]
    r = _cli("launch.decode_bench", *args)
    assert r.returncode == 0 and "finished in an earlier run" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_sweep_in_a_gs_directory_claims_logs_and_collects_there(bucket, tmp_path):
    """``launch.sweep --sweep_dir gs://...``: each point's ``point.json`` and ``train.log`` (here: a
    launch.train that stops at a bad flag) are objects in the bucket, the failure's log tail is read
    back from there, and the results table and figure collect a point's held-out metric."""
    from confu_jax.runs import sweep as sw

    spec = tmp_path / "spec.py"
    spec.write_text("def get_sweep():\n    return dict(config=%r, product={'train.optim.lr': [1e-4, 3e-4]})\n"
                    % os.path.join(REPO, "configs", "tiny.py"))
    sweep_dir = f"{bucket['root']}/sweeps/lr"
    points = sw.load_sweep(str(spec)).points
    storage.write_text(f"{sweep_dir}/{points[1].name}/eval.csv", "step,acceptance_length\n10,1.25\n20,1.5\n")
    r = _cli("launch.sweep", "--spec", spec, "--sweep_dir", sweep_dir, "--train_flags=--no_such_flag=1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stdout.count("FAILED") == 2 and "no_such_flag" in r.stdout, r.stdout[-3000:]
    for p in points:
        d = f"{sweep_dir}/{p.name}"
        assert json.loads(storage.read_text(f"{d}/point.json"))["overrides"] == json.loads(json.dumps(p.overrides))
        log = storage.read_text(f"{d}/train.log")
        assert log.startswith("\n=== ") and "no_such_flag" in log
    md = storage.read_text(f"{sweep_dir}/results.md")
    assert "| 1.5 |" in md and storage.read_bytes(f"{sweep_dir}/results.png")[:4] == b"\x89PNG"
    assert "0.0003" in storage.read_text(f"{sweep_dir}/results.csv")


def test_plot_training_reads_gs_runs_and_writes_a_gs_figure(bucket):
    root = bucket["root"]
    storage.write_text(f"{root}/runs/plotted/metrics.csv", "step,loss,acceptance_length,acc/step0\n"
                       "1,3.5,1.1,0.2\n2,2.25,1.3,0.4\n")
    storage.write_text(f"{root}/runs/plotted/eval.csv", "step,loss,acceptance_length\n2,2.75,1.2\n")
    r = _cli("launch.plot_training", "--runs", f"e3={root}/runs/plotted@100", "--out", f"{root}/figs/curves.png",
             "--every", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| e3 | 102 | 2.250 | 1.300 | 0.400 | 2.750 | 1.200 | – |" in r.stdout, r.stdout
    assert storage.read_bytes(f"{root}/figs/curves.png")[:4] == b"\x89PNG"


def test_an_object_store_cannot_append(bucket):
    with pytest.raises(ValueError, match="cannot append"):
        storage.open(f"{bucket['root']}/x.csv", "a")


def test_an_unreachable_store_is_one_line_and_exit_2(monkeypatch, capsys):
    """What gcsfs raises when the bucket's endpoint cannot be reached (after its bounded retries)
    reaches the user as one line naming the path, through the CLIs' boundary."""
    from confu_jax.user_errors import one_line_errors

    class Unreachable:
        def __init__(self, path):
            self.path = path

        def exists(self):
            raise ConnectionRefusedError("Cannot connect to host storage.googleapis.com:443\n(more lines)")

    monkeypatch.setattr(storage, "_epath", Unreachable)
    with pytest.raises(SystemExit) as stop, one_line_errors("launch.train"):
        storage.exists("gs://no-such-bucket/model")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("launch.train: gs://no-such-bucket/model: cannot look")
    assert "ConnectionRefusedError" in err
