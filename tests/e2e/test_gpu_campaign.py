"""The GPU campaign's CPU dry run (issue 23 item 6): the same script and stages as on the H100
(``experiments/gpu_campaign.sh`` -> ``experiments.gpu_campaign run``) at ``CAMPAIGN_SCALE=tiny``, on a
tiny random chat GGUF (the ``tiny-chat`` preset) and a dozen short conversations:

* ``bundle`` splits the model over two carried folders; call 1 (wheels/prompts/assets + part 1)
  sets up and waits, call 2 (part 2) reassembles it, checks it bit for bit, self-distils and packs
  the data release (and stops there: ``CAMPAIGN_STOP_AFTER``), call 3 (nothing carried) resumes,
  trains EAGLE-3 then ConFu from EAGLE-3's step E, exports both heads and benchmarks, call 4 finds
  nothing left to do;
* every call's ``$OUT`` keeps the device tool's limits (<= 8 plain files, <= 16 MiB each, <= 64 MiB,
  plain names);
* ``unpack`` reassembles and checks what came back: the results JSON parses and every speculative
  row is lossless, the data release verifies and skips the released CPU conversations, the EAGLE-3
  export loads in the official format, the ConFu bf16 export and its rebuilt workdir give the
  trained parameters rounded to bf16.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers.tiny_chat_model import tiny_chat_gguf
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20


def _conversations(n=12):
    """ShareGPT-format records with short turns (the tiny tokenizer spends ~a token per byte)."""
    topics = ["cats", "rain", "tea", "maps", "jazz", "snow", "bees", "salt", "wind", "moss", "kites", "owls"]
    out = []
    for i in range(n):
        t = topics[i % len(topics)]
        turns = [{"from": "human", "value": f"Tell me about {t}."}, {"from": "gpt", "value": "Sure."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "Yes."}]
        out.append({"id": f"dry_{i}", "conversations": turns})
    return out


def _call(n, wt, state, out, env, extra_env=None, timeout=600):
    out.mkdir()
    e = dict(env, OUT=str(out), CAMPAIGN_STATE=str(state), CAMPAIGN_BUNDLE=str(wt), PY=sys.executable,
             **(extra_env or {}))
    t = time.time()
    r = subprocess.run(["bash", os.path.join(ROOT, "experiments", "gpu_campaign.sh")], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    return {"n": n, "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "out": out,
            "status": json.loads((out / "status.json").read_text()) if (out / "status.json").exists() else None,
            "seconds": time.time() - t}


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("campaign")
    (tmp / "model").mkdir()
    gguf = tiny_chat_gguf(tmp / "model", layers=8, max_pos=2048)
    sharegpt = tmp / "sharegpt.json"
    sharegpt.write_text(json.dumps(_conversations()))
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", CAMPAIGN_SCALE="tiny", PYTHONPATH=ROOT)
    bundle = tmp / "bundle"
    r = subprocess.run([sys.executable, "-m", "experiments.gpu_campaign", "bundle", "--out", str(bundle),
                        "--model_file", gguf, "--sharegpt", str(sharegpt), "--no_wheels"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wt, state = tmp / "worktree" / ".gpu_bundle", tmp / "worktree" / ".gpu_campaign"
    wt.mkdir(parents=True)
    calls = []
    shutil.copytree(bundle / "call1", wt / "call1")  # call 1 carries .gpu_bundle/call1
    calls.append(_call(1, wt, state, tmp / "out1", env))
    shutil.copytree(bundle / "call2", wt / "call2")  # call 2 carries call2; call1 stays (ignored files do)
    calls.append(_call(2, wt, state, tmp / "out2", env, {"CAMPAIGN_STOP_AFTER": "release"}))
    calls.append(_call(3, wt, state, tmp / "out3", env))  # nothing carried: resumes
    calls.append(_call(4, wt, state, tmp / "out4", env))  # nothing left to do
    dest = tmp / "unpacked"
    r = subprocess.run([sys.executable, "-m", "experiments.gpu_campaign", "unpack", *(str(c["out"]) for c in calls),
                        "--dest", str(dest)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return {"calls": calls, "bundle": bundle, "state": state, "dest": dest / "gpu_campaign", "unpack": r,
            "gguf": gguf}


def _why(call):
    return f"call {call['n']} rc {call['rc']}\n{call['stdout'][-4000:]}\n{call['stderr'][-3000:]}"


@pytest.mark.slow
def test_calls_resume_and_finish(campaign):
    c1, c2, c3, c4 = campaign["calls"]
    for c in (c1, c2, c3, c4):
        assert c["rc"] == 0, _why(c)
    assert c1["status"]["status"].startswith("waiting") and "NEXT: the next call, carrying .gpu_bundle/call2" in c1["stdout"]
    assert c1["status"]["stages"]["setup"]["status"] == "done"
    assert c1["status"]["stages"]["model"]["status"] == "waiting"
    assert c2["status"]["status"] == "stopped after release (CAMPAIGN_STOP_AFTER)", _why(c2)
    assert "NEXT: the same command again" in c2["stdout"]
    assert c3["status"]["status"] == "complete" and "CAMPAIGN COMPLETE" in c3["stdout"], _why(c3)
    assert c4["status"]["status"] == "complete" and "CAMPAIGN COMPLETE" in c4["stdout"], _why(c4)
    stages = c4["status"]["stages"]
    assert all(stages[s]["status"] == "done"
               for s in ("setup", "model", "data", "release", "eagle3", "confu", "families", "bench"))
    # each stage finished in the call the protocol puts it in, and call 4 redid nothing
    assert stages["model"]["finished_call"] == 2 and stages["release"]["finished_call"] == 2
    assert stages["eagle3"]["finished_call"] == 3 and stages["bench"]["finished_call"] == 3
    assert c4["status"]["calls"][-1]["delivered"] == []
    assert "model: load_model gives the bundled weights bit for bit" in c2["stdout"]
    # the paper's protocol: ConFu starts from EAGLE-3's step E and trains P, EAGLE-3 trains E + P
    plan = c4["status"]["plan"]
    assert (plan["e3"], plan["plus"]) == (2, 2)
    assert stages["eagle3"]["info"]["steps"] == 4
    assert stages["confu"]["info"]["steps"] == 2 and stages["confu"]["info"]["inherited_steps"] == 2
    init = json.loads((campaign["state"] / "runs" / "confu" / "init_from.json").read_text())
    assert "eagle3/checkpoints" in json.dumps(init)
    # the other families at EAGLE-3's budget: the same rows, length and E + P steps (equal token-steps)
    for family in ("medusa",):  # the dry run's one family (CAMPAIGN_SCALE=tiny)
        info = stages["families"]["info"][family]
        assert info["steps"] == 4 and info["tokens_seen"] == stages["eagle3"]["info"]["tokens_seen"]


@pytest.mark.slow
def test_out_fits_the_device_limits(campaign):
    import re

    for c in campaign["calls"]:
        entries = list(c["out"].iterdir())
        assert all(e.is_file() and not e.is_symlink() for e in entries), entries
        assert len(entries) <= 8
        sizes = [e.stat().st_size for e in entries]
        assert max(sizes) <= 16 * MIB and sum(sizes) <= 64 * MIB
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", e.name) for e in entries)
        assert (c["out"] / "status.json").exists() and (c["out"] / f"call-{c['n']:02d}.log").exists()
    names = {e.name for c in campaign["calls"] for e in c["out"].iterdir()}
    for art in ("data_release", "eagle3_head", "confu_head", "results"):
        assert any(n.startswith(art + ".tar.") for n in names), (art, names)
    # the data release came back with call 2, before training
    assert any(e.name.startswith("data_release.tar.") for e in campaign["calls"][1]["out"].iterdir())


@pytest.mark.slow
def test_bundle_splits_the_model_and_reassembles_bit_for_bit(campaign):
    b = json.loads((campaign["bundle"] / "bundle.json").read_text())
    parts = b["model"]["parts"]
    assert [p["call"] for p in parts] == ["call1", "call2"]
    data = b"".join((campaign["bundle"] / p["call"] / p["file"]).read_bytes() for p in parts)
    assert data == open(campaign["gguf"], "rb").read()
    assert max(b["travel"]["call1"], b["travel"]["call2"]) <= 64 * MIB
    assert "wheels" not in os.listdir(campaign["bundle"] / "call1")  # --no_wheels
    got = json.loads((campaign["state"] / "model_digest.json").read_text())
    assert got["params_sha256"] == b["model"]["digest"]["params_sha256"] and got["dtype"] == "float32"
    assert not (campaign["state"] / "model_parts").exists()  # parts removed once reassembled


@pytest.mark.slow
def test_unpacked_results_parse_and_are_lossless(campaign):
    r = campaign["unpack"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((campaign["dest"] / "bench" / "mtbench.json").read_text())
    rows = doc["results"]
    assert {row["method"] for row in rows} == {"ar", "eagle3", "confu", "lookup", "hybrid", "medusa"}
    for row in rows:
        assert row["temperature"] == 0 and row["tau"] >= 1.0
        if row["method"] != "ar":
            assert row["lossless_greedy"] is True, row
        if row["method"] in ("eagle3", "confu", "hybrid", "medusa"):
            assert row["trained"] is True, row
    assert {row["budget"] for row in rows if row["method"] != "ar"} == {"chain:3"}
    summary = json.loads((campaign["dest"] / "bench" / "summary.json").read_text())
    assert summary["all_lossless"] is True
    for run in ("eagle3", "confu", "medusa"):
        assert (campaign["dest"] / "runs" / run / "metrics.csv").exists()


@pytest.mark.slow
def test_unpacked_releases_verify_and_skip_released_ids(campaign):
    """Pass 1 (greedy) and pass 2 (sampled at T = 1) are two releases of the same prompts."""
    from confu_jax.data.releases import load_release, read_manifest, released_ids

    from confu_jax.data.chat import ChatTokenizer
    from launch.release_data import answer_token_counter

    count = answer_token_counter(ChatTokenizer.load(campaign["gguf"]))
    cpu_ids = released_ids(os.path.join(ROOT, "releases", "data", "sharegpt_smollm2"))
    total = 0
    for name, temperature in (("sharegpt_smollm2_gpu", 0.0), ("sharegpt_smollm2_gpu_sampled", 1.0)):
        rel = campaign["dest"] / "release" / name
        manifest = read_manifest(str(rel))
        records = list(load_release(str(rel)))  # hashes checked
        assert manifest["name"] == name
        assert manifest["conversations"] == len(records) >= 6 and manifest["answer_tokens"] > 0
        assert manifest["target"]["model"] == "smollm2-135m-instruct"
        assert manifest["generation"]["max_new_tokens"] == 8
        assert manifest["generation"]["temperature"] == temperature
        assert all(r["id"].startswith("dry_") for r in records)
        assert not ({r["id"] for r in records} & cpu_ids)
        assert manifest["answer_tokens"] == sum(count(r) for r in records)  # as launch.release_data counts
        total += manifest["answer_tokens"]
        key = "greedy" if temperature == 0 else "sampled"
        summary = json.loads((campaign["dest"] / "data" / f"{key}_summary.json").read_text())
        cov = summary["draft_vocab_coverage"]
        assert cov["held_out_answer_tokens"] > 0 and set(cov["top_k"]) == {"4096", "8192", "16384", "32768"}
    data = json.loads((campaign["dest"] / "data_summary.json").read_text())
    assert data["answer_tokens"] == total
    passes = campaign["calls"][-1]["status"]["stages"]["data"]["passes"]
    assert passes["greedy"]["ended_by"] == passes["sampled"]["ended_by"] == "all prompts done"


@pytest.mark.slow
def test_unpacked_heads_load(campaign):
    import jax

    from confu_jax.runs.heads import load_trained_head
    from confu_jax.weights.eagle3_formats import load_head
    from experiments.gpu_campaign.steps import load_exported

    e3 = load_head(str(campaign["dest"] / "heads" / "eagle3_official"))
    assert e3.fmt == "eagle3"
    trained = load_trained_head(str(campaign["state"] / "runs" / "eagle3"))
    np.testing.assert_array_equal(e3.draft["fc"]["kernel"],
                                  np.asarray(trained.trainable["draft"]["fc"]["kernel"]).astype(jax.numpy.bfloat16)
                                  .astype(np.float32))
    config, trainable, vocab, step = load_exported(str(campaign["dest"] / "heads" / "confu_bf16"))
    confu = load_trained_head(str(campaign["state"] / "runs" / "confu"))
    assert step == confu.step == 2 and config.confu.variant == "confu"
    for a, b in zip(jax.tree_util.tree_leaves(trainable), jax.tree_util.tree_leaves(confu.trainable)):
        np.testing.assert_array_equal(a, np.asarray(b).astype(jax.numpy.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(vocab["d2t"], confu.draft_vocab["d2t"])
    rebuilt = load_trained_head(str(campaign["dest"] / "heads" / "confu_workdir"))  # decode_bench --heads loads it
    for a, b in zip(jax.tree_util.tree_leaves(rebuilt.trainable), jax.tree_util.tree_leaves(trainable)):
        np.testing.assert_array_equal(a, b)
    assert glob.glob(str(campaign["dest"] / "heads" / "confu_bf16" / "*.safetensors"))
    # the unpacked run folders get their heads back as checkpoints (launch.release_head reads them
    # with their metrics: lineage); EAGLE-3's is the official export's weights and vocabulary
    from confu_jax.runs.lineage import lineage

    run = load_trained_head(str(campaign["dest"] / "runs" / "eagle3"))
    assert run.step == trained.step
    for a, b in zip(jax.tree_util.tree_leaves(run.trainable["draft"]), jax.tree_util.tree_leaves(e3.draft)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(run.draft_vocab["d2t"], e3.d2t)
    confu_run = load_trained_head(str(campaign["dest"] / "runs" / "confu"))
    for a, b in zip(jax.tree_util.tree_leaves(confu_run.trainable), jax.tree_util.tree_leaves(trainable)):
        np.testing.assert_array_equal(a, b)
    chain = lineage(str(campaign["dest"] / "runs" / "confu"), step)
    assert chain[0]["tokens_seen"] > 0 and chain[1]["workdir"].endswith("eagle3") and chain[1]["tokens_seen"] > 0


def test_scale_overrides_and_calls():
    from experiments.gpu_campaign.common import Scale, resolve_scale
    from experiments.gpu_campaign.bundle import device_calls

    s = resolve_scale("gpu", {"CAMPAIGN_E3_STEPS": "300", "CAMPAIGN_LR": "5e-4"})
    assert (s.e3_steps, s.lr, s.gen_batch) == (300, 5e-4, Scale().gen_batch)
    assert s.gen_batch >= 256 and s.train_batch * s.train_len * (s.e3_steps + s.plus_steps) >= 90e6
    calls = device_calls("/nonexistent/.gpu_bundle")  # no bundle.json: the two-call default
    assert [c["carry"][0].endswith(f) for c, f in zip(calls, ("/call1", "/call2"))] == [True, True]
    assert calls[-1]["carry"] == [] and all(len(c["command"]) <= 2000 for c in calls)


def test_split_sizes_fit_the_travel_limit():
    from experiments.gpu_campaign.common import TRAVEL_LIMIT, TRAVEL_MARGIN
    from experiments.gpu_campaign.bundle import split_sizes

    gguf, call1_files = 98_362_432, 16_400_000  # SmolLM2's GGUF; wheels + prompts + assets
    for tree in (2_800_000, 12_000_000, 30_000_000):
        sizes = split_sizes(gguf, call1_files, tree)
        carried = [tree + s + (call1_files if i == 0 else 0) for i, s in enumerate(sizes)]
        assert sum(sizes) == gguf and len(sizes) >= 2
        assert max(carried) <= TRAVEL_LIMIT - TRAVEL_MARGIN
        assert len(sizes) == (2 if tree < 5_000_000 else len(sizes))


def test_the_working_tree_travels_and_leaves_the_campaign_room():
    """Every device call sends the working tree, 64 MiB in all (releases store their weights xz-packed
    for it): the repository travels as it is, and with the head releases a campaign does not read set
    aside, SmolLM2's GGUF and call 1's files (wheels, prompts, assets) travel in at most three calls."""
    from experiments.gpu_campaign.bundle import split_sizes
    from experiments.gpu_campaign.common import (TRAVEL_LIMIT, TRAVEL_MARGIN, resolve_scale, set_aside_releases,
                                                 tree_bytes)

    assert tree_bytes() <= TRAVEL_LIMIT - TRAVEL_MARGIN
    gguf, call1_files = 98_362_432, 16_400_000
    for scale, kept in (("gpu15", {"releases/heads/smollm2_eagle3"}), ("gpu", set())):
        aside = set_aside_releases(resolve_scale(scale))
        every = {f"releases/heads/{d}" for d in os.listdir(os.path.join(ROOT, "releases", "heads"))}
        assert set(aside) == every - kept
        assert len(split_sizes(gguf, call1_files, tree_bytes(leave_out=aside))) <= 3, scale


def test_set_aside_and_restore_round_trip(tmp_path, monkeypatch):
    """``set_aside`` moves exactly the releases the bundle names into the (ignored) bundle folder and
    ``restore`` puts them back, byte for byte; a second ``set_aside`` finds nothing to move."""
    from experiments.gpu_campaign import bundle as B

    root = tmp_path / "repo"
    for name in ("smollm2_a", "smollm2_b"):
        (root / "releases" / "heads" / name).mkdir(parents=True)
        (root / "releases" / "heads" / name / "w.bin").write_bytes(name.encode() * 100)
    bdir = tmp_path / "bundle"
    bdir.mkdir()
    (bdir / "bundle.json").write_text(json.dumps({"travel": {"set_aside": ["releases/heads/smollm2_b"]}}))
    monkeypatch.setattr(B, "ROOT", str(root))
    monkeypatch.setattr(B, "tree_bytes", lambda *a, **k: 0)
    args = type("A", (), {"bundle": str(bdir)})
    assert B.cmd_set_aside(args) == 0
    heads = root / "releases" / "heads"
    assert not (heads / "smollm2_b").exists() and (heads / "smollm2_a").exists()
    assert (bdir / "set_aside" / "releases" / "heads" / "smollm2_b" / "w.bin").read_bytes() == b"smollm2_b" * 100
    assert B.cmd_set_aside(args) == 0  # nothing left to move
    assert B.cmd_restore(args) == 0
    assert (root / "releases" / "heads" / "smollm2_b" / "w.bin").read_bytes() == b"smollm2_b" * 100
    assert not (bdir / "set_aside" / "releases" / "heads" / "smollm2_b").exists()


def _campaign(tmp_path, scale="gpu", env=None):
    from experiments.gpu_campaign.driver import Campaign

    return Campaign(str(tmp_path / "state"), str(tmp_path / "bundle"), str(tmp_path / "out"), scale, env or {})


def test_replan_fits_the_time_box(tmp_path):
    """The planner turns EAGLE-3's measured step time into E = P (multiples of the checkpoint
    interval) so that EAGLE-3's rest and ConFu end inside the training box; never past twice the plan."""
    c = _campaign(tmp_path)
    s = c.scale
    c.stage("eagle3")["started_t"] = time.time() - 60  # a minute spent (compile)
    t0 = time.time()
    watch = {"t": [t0 + 10 * i for i in range(5)], "step": [10 * i for i in range(5)]}  # 1 s / step
    assert c._replan(watch) is True
    plan = c.plan()
    assert plan["e3"] == plan["plus"] and plan["e3"] % s.ckpt_every == 0 and plan["replanned"]
    sec = 1.0
    rest = (2 * plan["e3"] - 40) * sec + plan["plus"] * sec * s.confu_cost + 90
    assert rest <= s.train_s - 60 + 1e-6 and rest + s.ckpt_every * sec * (2 + s.confu_cost) > s.train_s - 60
    c2 = _campaign(tmp_path / "fast")
    c2.stage("eagle3")["started_t"] = time.time()
    watch = {"t": [t0 + 0.01 * i for i in range(5)], "step": [10 * i for i in range(5)]}  # 1 ms / step
    c2._replan(watch)
    assert c2.plan()["e3"] == 2 * s.e3_steps  # capped at twice the plan


def test_gpu15_plan_needs_no_relaunch_at_the_measured_step_time(tmp_path):
    """At the step time the third H200 loan measured (2.0 s, re-planned at step 6 after 81 s), the
    15-minute scale's own plan is what the re-plan computes: EAGLE-3 keeps running (no relaunch);
    a machine 4x faster gets more steps (a relaunch that pays)."""
    c = _campaign(tmp_path, scale="gpu15")
    c.stage("eagle3")["started_t"] = time.time() - 81
    t0 = time.time()
    watch = {"t": [t0 + 2.0 * i for i in range(7)], "step": list(range(7))}
    before = (c.plan()["e3"], c.plan()["plus"])
    assert c._replan(watch) is False and (c.plan()["e3"], c.plan()["plus"]) == before
    fast = _campaign(tmp_path / "fast", scale="gpu15")
    fast.stage("eagle3")["started_t"] = time.time() - 81
    watch = {"t": [t0 + 0.5 * i for i in range(7)], "step": list(range(7))}
    assert fast._replan(watch) is True and fast.plan()["e3"] > before[0]


def test_delivery_spills_over_calls(tmp_path, monkeypatch):
    """Pieces that do not fit one call's $OUT (8 files, 64 MiB) wait for the next call."""
    from experiments.gpu_campaign import common as gc

    monkeypatch.setattr(gc, "PIECE_BYTES", 1000)
    monkeypatch.setattr(gc, "OUT_BYTES", 4000 + 2 * 2**20)
    c = _campaign(tmp_path)
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(7000))
    c.add_artifact("results", [(str(src), "blob.bin")])
    n = len(c.state["artifacts"]["results"]["pieces"])
    assert n >= 8
    first = c.deliver()
    assert len(first) == 4  # 4000 bytes of budget
    c.save()
    c2 = _campaign(tmp_path)
    c2.out = str(tmp_path / "out2")
    os.makedirs(c2.out)
    second = c2.deliver()
    assert second and not set(first) & set(second)
    assert c2.call_index == 2


def test_a_fresh_machine_is_told_to_start_again(tmp_path):
    """Call 2 on a machine that lost call 1's state: a clear error, not a half-run campaign."""
    from experiments.gpu_campaign.common import CampaignError

    (tmp_path / "bundle" / "call2").mkdir(parents=True)
    (tmp_path / "bundle" / "call2" / "bundle.json").write_text(json.dumps({"model": {"parts": []}}))
    c = _campaign(tmp_path)
    with pytest.raises(CampaignError, match="start again with call 1"):
        c.st_setup()


def test_auto_candidates_parse_for_every_family():
    """The narrowed budget-auto candidates are plans each family's drafter accepts."""
    from confu_jax.bench.cli_args import parse_auto_candidates
    from confu_jax.decode.families import FAMILIES
    from experiments.gpu_campaign.common import Scale
    from experiments.gpu_campaign.steps import auto_candidates

    given = parse_auto_candidates(auto_candidates(Scale()))
    assert set(given) == {"head", "hybrid", "mtp", "lookup", "medusa", "mlp_speculator", "dflash"}
    assert "dynamic:6,10,60" in given["head"] and all(p.startswith("chain:") for p in given["hybrid"])
    for family, plans in given.items():
        for plan in plans:
            FAMILIES[family].parse(plan)
    assert "head=" not in auto_candidates(Scale(auto_head_plans=""))


def _fake_release(directory, ids, name):
    from confu_jax.data.releases import append_release

    records = [{"id": i, "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
               for i in ids]
    gen = {"model": "smollm2-135m-instruct", "tokenizer": "smollm2-135m-instruct", "dtype": "bfloat16",
           "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 512, "max_prompt_len": 1024, "max_turns": 0}
    append_release(str(directory), records, count_tokens=lambda r: 2, name=name,
                   target={"model": "smollm2-135m-instruct", "fingerprint": "f"}, tokenizer="smollm2-135m-instruct",
                   generation=gen)


def test_earlier_campaign_releases_are_skipped_continued_and_trained_on(tmp_path, monkeypatch):
    """A campaign after one whose release the repository holds: generation skips its ids, training
    reads it (once: not again when this campaign continues it), the CPU release stays last (held out)."""
    from experiments.gpu_campaign import common as gc

    root = tmp_path / "repo"
    _fake_release(root / "releases" / "data" / "sharegpt_smollm2", ["c1"], "sharegpt_smollm2")
    _fake_release(root / "releases" / "data" / "sharegpt_smollm2_gpu", ["g1", "g2"], "sharegpt_smollm2_gpu")
    monkeypatch.setattr(gc, "ROOT", str(root))
    c = _campaign(tmp_path, env={"CAMPAIGN_GEN_PASSES": "1"})
    cpu, gpu = gc.CPU_RELEASE, os.path.join("releases", "data", "sharegpt_smollm2_gpu")
    assert c.released_elsewhere() == [cpu, gpu]
    assert c.training_releases() == [str(root / gpu), str(root / cpu)]
    shutil.copytree(root / gpu, c.path("release", "sharegpt_smollm2_gpu"))  # what st_release does first
    assert c.training_releases() == [c.path("release", "sharegpt_smollm2_gpu"), str(root / cpu)]
    # the dry run's scale ignores the repository's campaign releases (its tiny model made none)
    tiny = _campaign(tmp_path / "tiny", scale="tiny")
    assert tiny.released_elsewhere() == [cpu]
    assert tiny.training_releases() == [str(root / cpu)]


def test_gpu15_scale_trains_on_the_repository_releases(tmp_path, monkeypatch):
    """gen_passes = 0: no generation pass, the release stage ends at once, training reads the
    repository's releases; the 15-minute scale fits its work into call 2."""
    from experiments.gpu_campaign import common as gc

    root = tmp_path / "repo"
    _fake_release(root / "releases" / "data" / "sharegpt_smollm2_gpu", ["g1"], "sharegpt_smollm2_gpu")
    monkeypatch.setattr(gc, "ROOT", str(root))
    c = _campaign(tmp_path, scale="gpu15")
    s = c.scale
    assert c.data_passes() == [] and c.st_data() == "done" and c.st_release() == "done"
    assert "data_release" not in c.state["artifacts"]
    assert c.training_releases() == [str(root / "releases" / "data" / "sharegpt_smollm2_gpu")]
    assert s.train_s + s.bench_s + 30 <= s.call_s - s.margin_s and s.total_s <= 15 * 60
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert c.train_env() == {"XLA_FLAGS": "--xla_dump_to=/tmp/x " + s.train_xla_flags}
    assert "autotune" in s.train_xla_flags
    overrides = dict(o[len("--config."):].split("=", 1) for o in c.train_overrides("eagle3"))
    assert overrides["data.train_files"] == str(root / "releases" / "data" / "sharegpt_smollm2_gpu")
    assert overrides["draft.draft_vocab_size"] == "4096" and s.e3_init == "releases/heads/smollm2_eagle3"
    # the second H200 loan: 64 rows x 2048 ran out of memory; workers off, as the run that trained
    assert overrides["data.global_batch_size"] == "32" and overrides["data.num_workers"] == "0"
    # rows are packed where the family's training is (the catalog's Entry.packs_rows)
    packs = {run: dict(o[len("--config."):].split("=", 1) for o in c.train_overrides(run))["data.pack"]
             for run in ("eagle3", "confu", "mtp", "medusa", "mlp_speculator", "dflash")}
    assert packs == {"eagle3": "True", "confu": "True", "mtp": "True", "medusa": "False", "mlp_speculator": "False",
                     "dflash": "False"}, packs


def test_eagle3_can_continue_a_release(tmp_path, monkeypatch):
    """CAMPAIGN_E3_INIT: EAGLE-3's launch starts from that head (launch.train's init_from, which
    checks the release's hashes and remaps its draft vocabulary); a path that did not travel is an
    error naming it, before any launch."""
    from experiments.gpu_campaign.common import CampaignError

    head = tmp_path / "releases" / "heads" / "smollm2_eagle3"
    head.mkdir(parents=True)
    launched = []

    def fake_run(self, name, cmd, timeout, **kw):
        launched.append(cmd)
        return 0, True  # stopped by its time box: nothing trained

    monkeypatch.setattr("experiments.gpu_campaign.driver.Campaign.run_cmd", fake_run)
    c = _campaign(tmp_path / "a", scale="gpu15", env={"CAMPAIGN_E3_INIT": str(head)})
    c.st_eagle3()
    assert f"--config.train.checkpoint.init_from={head}" in launched[-1]
    c = _campaign(tmp_path / "b", scale="gpu")
    c.st_eagle3()
    assert not any("init_from" in a for a in launched[-1])
    c = _campaign(tmp_path / "c", scale="gpu15", env={"CAMPAIGN_E3_INIT": str(tmp_path / "missing")})
    with pytest.raises(CampaignError, match="missing"):
        c.st_eagle3()
    assert len(launched) == 2


def test_confu_future_options_reach_the_confu_launch(tmp_path, monkeypatch):
    """ConFu's launch carries the future mechanisms: the 15-minute scale's default is confu_future.sh's
    arm aux_input_gc; CAMPAIGN_CONFU_OVERRIDES replaces it ('' = the paper's head, the full scale's
    default) and CAMPAIGN_CONFU_FUTURE_BIAS adds the entry bias."""
    from experiments.gpu_campaign.common import CONFU_FUTURE_AUX_INPUT_GC, CampaignError

    launched = []

    def fake_run(self, name, cmd, timeout, **kw):
        launched.append(cmd)
        return 0, True  # stopped by its time box: nothing trained

    monkeypatch.setattr("experiments.gpu_campaign.driver.Campaign.run_cmd", fake_run)
    _campaign(tmp_path / "a", scale="gpu15").st_confu()
    want = [f"--config.{kv}" for kv in CONFU_FUTURE_AUX_INPUT_GC.split()]
    assert want == [a for a in launched[-1] if a in want] and len(want) == 4
    assert not any(a.startswith("--config.confu.future_bias") for a in launched[-1])
    _campaign(tmp_path / "b", scale="gpu15", env={"CAMPAIGN_CONFU_FUTURE_BIAS": "2.5",
                                                   "CAMPAIGN_CONFU_OVERRIDES": "confu.future_taps=True"}).st_confu()
    assert "--config.confu.future_bias=2.5" in launched[-1] and "--config.confu.future_taps=True" in launched[-1]
    assert "--config.confu.future_input=True" not in launched[-1]
    for name, kw in (("c", dict(scale="gpu15", env={"CAMPAIGN_CONFU_OVERRIDES": ""})), ("d", dict(scale="gpu"))):
        _campaign(tmp_path / name, **kw).st_confu()
        assert not any(a.startswith(("--config.confu.future", "--config.objective.future")) for a in launched[-1]), name
    with pytest.raises(CampaignError, match="key=value"):
        _campaign(tmp_path / "e", scale="gpu15", env={"CAMPAIGN_CONFU_OVERRIDES": "future_input"}).st_confu()
    assert len(launched) == 4
