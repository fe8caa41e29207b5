"""``gs://`` paths end to end, against a local GCS emulator this module starts (tests/gcs_emulator.py).

A target checkpoint, its tokenizer, the training data, the workdir (config, metric CSVs, orbax
checkpoints) and released heads and data all live in the emulated bucket; each result is checked
against the same thing done on a local disk: the sharded load equals the local one and reads each
byte once, a training run there gives the local run's losses bit for bit and resumes to them, a
release loads with its hash check (and a changed byte is caught). The workdir lock says plainly that
an object store cannot be locked.
"""

from __future__ import annotations

import json
import logging
import os
import signal

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
from tests.gcs_emulator import SERVED, emulated_gcs  # noqa: E402

from tests.fixtures.tiny_checkpoints import tiny_vocab  # noqa: E402

# the test tokenizer's vocabulary, rounded up to a multiple of the 8 devices
CFG = get_preset("tiny").replace(tie_embeddings=False, n_layers=4, vocab_size=-(-len(tiny_vocab()[0]) // 64) * 64)
ROWS = [{"messages": [{"role": "user", "content": f"q {i} a b"},
                      {"role": "assistant", "content": f"d e {i} f g " * 3}]} for i in range(48)]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The emulated bucket holding ``target/`` (a Hugging Face directory) and ``data.jsonl``; and the
    same files on the local disk."""
    from tests.fixtures.tiny_checkpoints import write_hf_tokenizer

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


def test_released_heads_and_data_load_from_gs_with_their_hash_check(bucket, tmp_path):
    """A data release, a trainable-tree head release and an EAGLE-3 export in speculators' layout, each
    copied to the bucket: read back equal to the local copy; a changed byte fails the hash check."""
    from confu_jax.data.releases import ReleaseError, ReleaseHashError, append_release, load_release
    from confu_jax.runs.head_release import HeadReleaseError, verify_head_release, write_head_manifest
    from confu_jax.runs.heads import load_trained_head
    from confu_jax.runs.trainable_export import TrainedHead, write_trainable
    from confu_jax.models.params import init_trainable
    from confu_jax.models.spec import model_spec_from_config

    root = bucket["root"]
    # data: a release appended locally, copied to the bucket, read back with every part's hash checked
    records = [{"id": f"r{i}", "conversations": r["messages"]} for i, r in enumerate(ROWS[:12])]
    data_dir = str(tmp_path / "data_release")
    append_release(data_dir, records, count_tokens=lambda r: 5, target={"model": "tiny", "fingerprint": "f"},
                   tokenizer="tiny", generation={"command": "test"}, part_bytes=600)
    storage.copy_tree(data_dir, f"{root}/releases/data")
    assert list(load_release(f"{root}/releases/data")) == list(load_release(data_dir)) == records
    with pytest.raises(ReleaseError, match="object store"):
        append_release(f"{root}/releases/data", records, count_tokens=lambda r: 5,
                       target={"model": "tiny", "fingerprint": "f"}, tokenizer="tiny", generation={"command": "t"})
    part = f"{root}/releases/data/part-00000.jsonl.zst"
    with storage.open(part, "rb") as f:
        blob = bytearray(f.read())
    blob[-1] ^= 1
    with storage.open(part, "wb") as f:
        f.write(bytes(blob))
    with pytest.raises(ReleaseHashError, match="sha256 mismatch"):
        list(load_release(f"{root}/releases/data"))

    # a head: a trainable-tree export with its manifest, copied to the bucket, loads as the local one
    from confu_jax.train.target_loading import resolve_target

    config = _config(os.path.join(bucket["local"], "target"), "unused", 1)
    resolve_target(config)
    spec = model_spec_from_config(config)
    trainable = jax.device_get(init_trainable(spec, jax.random.PRNGKey(0)))
    vocab = {"d2t": np.arange(spec.head.draft_vocab_size, dtype=np.int32),
             "t2d": np.arange(spec.target.vocab_size) < spec.head.draft_vocab_size}
    head_dir = str(tmp_path / "head")
    write_trainable(TrainedHead(config, spec, trainable, vocab, 7), head_dir, dtype="float32")
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
