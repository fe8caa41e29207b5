"""Released heads (``runs.head_release``, ``launch.release_head``): a trained EAGLE-3 head exported
bf16 in the official layout with a manifest; decoding loads it only after its hashes and its
target's fingerprint check out, and greedy decoding with it equals AR; an altered file is named;
a release is replaced only for a τ gain >= 0.05."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.tiny import get_config
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.runs import head_release as hr
from confu_jax.train.loop import train
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    base = tmp_path_factory.mktemp("rel")
    workdir = str(base / "eagle3")
    config = get_config("eagle3")
    config.train.steps = 2
    config.train.eval_every = 0
    config.train.checkpoint.every = 1
    config.train.checkpoint.async_save = False
    config.train.progress_bar = False
    config.train.tensorboard = "off"
    train(config, workdir)
    release = str(base / "releases" / "heads" / "tiny_eagle3")
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "launch.release_head", "--workdir", workdir, "--release", release,
           "--tau", "heldout_decode_chain3=1.30"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return workdir, release, cmd, env


@pytest.mark.slow
def test_release_layout_and_manifest(released):
    workdir, release, _, _ = released
    m = hr.verify_head_release(release)
    files = {e["file"]: e for e in m["files"]}
    assert set(files) == {"config.json", "model.safetensors.xz"} and m["format_version"] == 2
    assert m["training"]["step"] == 2 and m["tau"] == {"heldout_decode_chain3": 1.30}
    assert m["target"]["fingerprint"]
    import hashlib
    import lzma

    from confu_jax.weights.tensor_files import read_tensors

    # plain xz: what any xz decompresses the stored file to is the weights file the manifest names
    raw = lzma.decompress(open(os.path.join(release, "model.safetensors.xz"), "rb").read())
    assert files["model.safetensors.xz"]["unpacks_to"] == {"file": "model.safetensors", "bytes": len(raw),
                                                           "sha256": hashlib.sha256(raw).hexdigest()}
    tensors = read_tensors(release)  # the readers' path: the packed file, unpacked into the cache
    floats = [v for v in tensors.values() if v.dtype.kind == "f" or str(v.dtype) == "bfloat16"]
    assert floats and all(str(v.dtype) == "bfloat16" for v in floats)
    # what an engine serves: the plain files, no manifest (a published layout, not a release)
    served = hr.unpacked_release(release)
    assert sorted(os.listdir(served)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(served, "model.safetensors"), "rb").read() == raw
    with open(os.path.join(served, "model.safetensors"), "r+b") as f:  # an altered cached copy is written again
        f.write(b"x")
    assert hr.unpacked_release(release) == served
    assert open(os.path.join(served, "model.safetensors"), "rb").read() == raw


@pytest.mark.slow
def test_decoding_loads_a_verified_release(released):
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.families import decode_head
    from confu_jax.decode.loop import generate_speculative
    from confu_jax.decode.plans import parse_plan
    from confu_jax.runs.heads import load_trained_head
    from confu_jax.train.target_loading import load_target

    workdir, release, _, _ = released
    head = load_trained_head(workdir)
    spec, target = load_target(head.config, head.spec)
    dh = decode_head("eagle3", spec.target, target, release)
    assert dh.trained and "(eagle3 format)" in dh.source
    prompts = [[3, 5, 7, 2, 9], [4, 4, 1]]
    ar = generate_ar(target, spec.target, prompts, max_new_tokens=10, eos_ids=())
    sp = generate_speculative(dh.target, HeadDrafter(parse_plan("chain:2")), dh.drafter_params, prompts,
                              max_new_tokens=10, eos_ids=())
    for b in range(2):
        assert np.asarray(sp.tokens_bn)[b].tolist() == np.asarray(ar.tokens_bn)[b].tolist()
    # another target's weights: refused by fingerprint
    other = jax.tree_util.tree_map(lambda x: x * 1.01, target)
    with pytest.raises(ValueError, match="fingerprint"):
        decode_head("eagle3", spec.target, other, release)


def test_altered_file_is_named_and_replacement_needs_a_gain(released, tmp_path):
    import shutil

    workdir, release, cmd, env = released
    copy = str(tmp_path / "copy")
    shutil.copytree(release, copy)
    with open(os.path.join(copy, "model.safetensors.xz"), "r+b") as f:
        f.seek(-8, 2)
        tail = f.read(8)
        f.seek(-8, 2)
        f.write(bytes(b ^ 0xFF for b in tail))
    with pytest.raises(hr.HeadReleaseError, match="model.safetensors.xz: sha256 mismatch"):
        hr.verify_head_release(copy)
    # the unpacked copy readers load is checked too: one altered byte there is named
    from confu_jax.weights import packed_files

    unpacked = packed_files.local(os.path.join(release, "model.safetensors"))
    before_bytes = open(unpacked, "rb").read()
    try:
        with open(unpacked, "r+b") as f:
            f.seek(-2, 2)
            f.write(bytes([before_bytes[-2] ^ 1]))
        with pytest.raises(hr.HeadReleaseError, match="unpacked from .*model.safetensors.xz.*sha256 mismatch"):
            hr.verify_head_release(release)
    finally:
        with open(unpacked, "wb") as f:
            f.write(before_bytes)
    assert hr.better_than_released(release, {"heldout_decode_chain3": 1.34}) [0] is False
    assert hr.better_than_released(release, {"heldout_decode_chain3": 1.36})[0] is True
    assert hr.better_than_released(release, {"mtbench_chain3": 2.0})[0] is False  # no shared metric
    assert hr.better_than_released(str(tmp_path / "none"), {})[0] is True
    before = json.load(open(os.path.join(release, "manifest.json")))
    r = subprocess.run(cmd[:-1] + ["heldout_decode_chain3=1.31"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "not released" in r.stderr
    assert json.load(open(os.path.join(release, "manifest.json"))) == before


def test_a_format_1_release_repacks_to_the_same_content_and_unpacks_for_an_engine(released, tmp_path):
    """``--repack`` stores a plain-file (format 1) release xz-packed: the manifest keeps every field, the
    packed file unpacks to the hash the old manifest listed, the release still verifies and loads; a
    plain file that differs from what the manifest lists is refused before anything is packed.
    ``--unpack`` prints the folder of plain files an engine reads."""
    import shutil

    _, release, _, env = released
    old = tmp_path / "v1"
    shutil.copytree(hr.unpacked_release(release), old)  # config.json + model.safetensors
    m2 = hr.read_head_manifest(release)
    entries = [hr.file_entry(str(old), f) for f in sorted(os.listdir(old))]
    (old / "manifest.json").write_text(json.dumps(dict(m2, format_version=1, files=entries)))
    assert hr.verify_head_release(str(old))["format_version"] == 1
    bad = tmp_path / "v1_bad"
    shutil.copytree(old, bad)
    with open(bad / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(hr.HeadReleaseError, match="config.json: sha256 mismatch"):
        hr.repack_release(str(bad))
    assert (bad / "model.safetensors").exists()  # nothing packed
    r = subprocess.run([sys.executable, "-m", "launch.release_head", "--release", str(old), "--repack"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = hr.verify_head_release(str(old))
    assert m["format_version"] == 2 and m["repacked"]["from_version"] == 1
    assert sorted(os.listdir(old)) == ["config.json", "manifest.json", "model.safetensors.xz"]
    packed = next(e for e in m["files"] if e["file"] == "model.safetensors.xz")
    assert packed["unpacks_to"] == next(e for e in entries if e["file"] == "model.safetensors")
    assert {k: v for k, v in m.items() if k not in ("files", "format_version", "repacked")} == {
        k: v for k, v in m2.items() if k not in ("files", "format_version")}
    r = subprocess.run([sys.executable, "-m", "launch.release_head", "--release", str(old), "--unpack"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    served = r.stdout.strip().splitlines()[-1]
    assert sorted(os.listdir(served)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(served, "model.safetensors"), "rb").read() == open(
        os.path.join(hr.unpacked_release(release), "model.safetensors"), "rb").read()


def test_manifest_names_every_data_release(released, tmp_path):
    """--data with several releases (a head trained on two): the manifest hashes each one's manifest."""
    import hashlib
    import shutil

    workdir, release, cmd, env = released
    copy = str(tmp_path / "rel")
    shutil.copytree(release, copy)
    data = []
    for name, n in (("a", 3), ("b", 5)):
        d = tmp_path / "data" / name
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"conversations": n, "answer_tokens": 10 * n}))
        data.append(d)
    cmd = [c if c != release else copy for c in cmd] + ["--force", "--data", ",".join(map(str, data))]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = hr.verify_head_release(copy)["data"]
    assert [e["release"] for e in got] == [str(d) for d in data]
    assert [e["conversations"] for e in got] == [3, 5] and [e["answer_tokens"] for e in got] == [30, 50]
    assert got[1]["manifest_sha256"] == hashlib.sha256((data[1] / "manifest.json").read_bytes()).hexdigest()


def test_tokens_seen_follow_the_init_from_lineage(tmp_path):
    """A head continued from a release and then pruned (a 1-step run initialised from it) has seen
    what its ancestors saw: lineage() sums metrics.csv's positions over the init_from.json chain."""
    def run(name, positions, init_from=None):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.csv").write_text("step,positions/step0\n" + "".join(f"{10 * (i + 1)},{p}\n"
                                                                          for i, p in enumerate(positions)))
        if init_from:
            (d / "init_from.json").write_text(json.dumps(init_from))
        return d

    rel = tmp_path / "released"
    rel.mkdir()
    (rel / "manifest.json").write_text(json.dumps({"training": {"step": 320, "tokens_seen": 196220}}))
    big = run("big", [100, 300], {"source": str(rel), "step": 0})
    pruned = run("pruned", [7], {"source": str(big / "checkpoints"), "step": 250})
    code = ("import json, sys; from confu_jax.runs.lineage import lineage; "
            "print(json.dumps(lineage(sys.argv[1], 1)))")
    r = subprocess.run([sys.executable, "-c", code, str(pruned)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    chain = json.loads(r.stdout.strip().splitlines()[-1])
    assert [c["tokens_seen"] for c in chain] == [7, 200 * 250, 196220]
    assert chain[1]["workdir"] == str(big) and chain[1]["step"] == 250 and chain[2]["release"] == str(rel)
    # a run moved from where it trained (GPU campaign runs unpacked here): the ancestor of the same
    # name beside it
    moved = run("moved", [5], {"source": "/gone/elsewhere/big/checkpoints", "step": 250})
    from confu_jax.runs.lineage import lineage

    assert [c["tokens_seen"] for c in lineage(str(moved), 1)] == [5, 200 * 250, 196220]
    # a run records its ancestors when it starts: a release replaced later does not change them
    pinned = run("pinned", [9], {"source": str(rel), "step": 0,
                                 "source_lineage": [{"release": str(rel), "step": 320, "tokens_seen": 1000}]})
    assert [c["tokens_seen"] for c in lineage(str(pinned), 1)] == [9, 1000]
    # every step logged (log_every 1): the exact sum up to the step, not a mean scaled to it
    from confu_jax.runs.lineage import tokens_seen

    exact = tmp_path / "exact"
    exact.mkdir()
    (exact / "metrics.csv").write_text("step,positions/step0\n1,10\n2,30\n3,50\n4,70\n")
    assert [tokens_seen(str(exact), s) for s in (1, 2, 3, 4)] == [10, 40, 90, 160]


@pytest.mark.slow
def test_confu_release_is_its_trainable_tree_and_decodes_after_its_checks(tmp_path):
    """A ConFu head (no published layout) is released as its whole trainable tree in bf16
    (``runs.trainable_export``): it loads back as the run's head rounded to bf16, decodes equal to
    AR wherever a head is accepted, and is refused when a file is altered or the target differs.
    ``init_from`` the release (to train it further) copies every leaf; a leaf it lacks (here the
    future-entry bias) keeps its init; an altered file is refused there too."""
    import ml_dtypes

    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.families import decode_head
    from confu_jax.decode.loop import generate_speculative
    from confu_jax.decode.plans import parse_plan
    from confu_jax.models.params import init_trainable
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.checkpoint import init_params_from
    from confu_jax.runs.heads import load_trained_head
    from confu_jax.train.target_loading import load_target

    workdir = str(tmp_path / "confu")
    config = get_config("confu")
    config.train.steps = 2
    config.train.eval_every = 0
    config.train.checkpoint.async_save = False
    config.train.progress_bar = False
    config.train.tensorboard = "off"
    train(config, workdir)
    release = str(tmp_path / "releases" / "heads" / "tiny_confu")
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "launch.release_head", "--workdir", workdir, "--release", release,
                        "--tau", "mtbench_chain3=1.2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = hr.verify_head_release(release)
    assert {e["file"] for e in m["files"]} == {"config.json", "model.safetensors.xz", "draft_vocab.npz",
                                               "export.json", "target.json"}
    assert m["training"]["step"] == 2 and m["target"]["fingerprint"]

    run, rel = load_trained_head(workdir), load_trained_head(release)
    assert rel.step == 2 and rel.spec.head == run.spec.head
    np.testing.assert_array_equal(rel.draft_vocab["d2t"], run.draft_vocab["d2t"])
    np.testing.assert_array_equal(rel.draft_vocab["t2d"], run.draft_vocab["t2d"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(run.trainable), jax.tree_util.tree_leaves(rel.trainable)):
        want = np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(b), want, err_msg=jax.tree_util.keystr(path))

    biased = get_config("confu")
    biased.confu.future_bias = 3.0
    biased.confu.future_input = True  # the release grows the new mechanisms' parameters at their init
    fresh = init_trainable(model_spec_from_config(biased), jax.random.PRNGKey(9))
    params, report = init_params_from(release, fresh, draft_vocab_d2t=np.asarray(run.draft_vocab["d2t"]))
    assert report.step == 2 and sorted(report.kept_init) == ["draft/future_bias", "draft/future_in/kernel"]
    assert not report.shape_mismatch
    assert not np.asarray(params["draft"]["future_in"]["kernel"]).any()
    got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(rel.trainable):
        np.testing.assert_array_equal(np.asarray(got[jax.tree_util.keystr(path)]), np.asarray(leaf))
    np.testing.assert_array_equal(np.asarray(params["draft"]["future_bias"]), 3.0)

    spec, target = load_target(run.config, run.spec)
    dh = decode_head("confu", spec.target, target, release)
    assert dh.trained
    prompts = [[3, 5, 7, 2, 9], [4, 4, 1]]
    ar = generate_ar(target, spec.target, prompts, max_new_tokens=10, eos_ids=())
    sp = generate_speculative(dh.target, HeadDrafter(parse_plan("chain:2")), dh.drafter_params, prompts,
                              max_new_tokens=10, eos_ids=())
    for b in range(2):
        assert np.asarray(sp.tokens_bn)[b].tolist() == np.asarray(ar.tokens_bn)[b].tolist()
    with pytest.raises(ValueError, match="fingerprint"):
        decode_head("confu", spec.target, jax.tree_util.tree_map(lambda x: x * 1.01, target), release)
    with open(os.path.join(release, "draft_vocab.npz"), "r+b") as f:
        f.seek(-4, 2)
        tail = f.read(4)
        f.seek(-4, 2)
        f.write(bytes(b ^ 0xFF for b in tail))
    with pytest.raises(hr.HeadReleaseError, match="draft_vocab.npz: sha256 mismatch"):
        decode_head("confu", spec.target, target, release)
    with pytest.raises(hr.HeadReleaseError, match="draft_vocab.npz: sha256 mismatch"):
        init_params_from(release, fresh)


@pytest.mark.parametrize("damage", ["truncated", "not_an_object", "format_field"])
def test_a_damaged_manifest_never_turns_the_hash_check_off(damage, tmp_path):
    """The shipped release with a flipped weight byte and a damaged manifest: refused on every path that
    reads a release (``is_head_release`` raises or says yes, and the check then fails), init_from included."""
    import shutil

    from confu_jax.runs.checkpoint import init_params_from

    copy = tmp_path / "smollm2_eagle3"
    shutil.copytree(os.path.join(ROOT, "releases", "heads", "smollm2_eagle3"), copy)
    with open(copy / "model.safetensors.xz", "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 1]))
    text = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text({"truncated": text[: len(text) // 2], "not_an_object": "[1, 2]",
                                         "format_field": text.replace(hr.FORMAT, hr.FORMAT[:-1] + "x")}[damage])
    says = "expected format" if damage == "format_field" else "manifest.json: .*(does not parse|JSON object)"
    with pytest.raises(hr.HeadReleaseError, match=says):
        hr.is_head_release(str(copy)) and hr.verify_head_release(str(copy))
    with pytest.raises(hr.HeadReleaseError, match=says):
        init_params_from(str(copy), params={})


@pytest.mark.parametrize("name,trainer", [("smollm2_eagle3_parity_ours", "confu_jax"),
                                          ("smollm2_eagle3_parity_speculators", "speculators")])
def test_the_trainer_parity_heads_verify_and_bind_to_smollm2(name, trainer):
    """Both parity heads (docs/RESULTS.md "Trainer parity") as shipped: hashes and target fingerprint checked,
    the manifest naming the trainer and both settings lists, and the weights bound to SmolLM2 as EAGLE-3 heads
    over the 4,096-token draft vocabulary they were trained with."""
    from confu_jax.decode.families import decode_head
    from confu_jax.weights import load_model

    release = os.path.join(ROOT, "releases", "heads", name)
    m = hr.verify_head_release(release)
    assert m["training"]["trainer"] == trainer and m["training"]["step"] == 110
    assert set(m["training"]["equal"]) >= {"max_length", "tokens_per_step", "draft_vocab_size", "ttt_steps", "lr"}
    assert "packing" in m["training"]["different"] and m["training"]["equal"]["tokens_per_step"] == 8192
    if trainer == "speculators":
        assert m["training"]["version"] == "0.9.0" and len(m["training"]["patches"]) == 4
    cfg, params = load_model("smollm2-135m-instruct")
    head = decode_head("eagle3", cfg, params, release)
    assert head.spec.head.draft_vocab_size == 4096 and head.spec.taps == (2, 15, 27)
