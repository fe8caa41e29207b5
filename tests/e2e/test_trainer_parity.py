"""The trainer-parity pipeline (experiments/trainer_parity.py) on a tiny Llama checkpoint: the reference
trainer sees exactly our rows, our draft vocabulary and our target's features, and speculators 0.9's own
trainer trains through the CPU patches, resumes where it stopped and writes a head our loader binds.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import trainer_parity as tp
from tests.helpers.tiny_checkpoints import hf_llama, write_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from confu_jax.data import formats

    base = tmp_path_factory.mktemp("parity")
    model = str(base / "model")
    hf_llama(model, seed=5, vocab=300, hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, ffn=96, max_pos=512)
    write_hf_tokenizer(model)
    convs = formats.load_conversations("sharegpt", max_records=28)[0]
    data = str(base / "convs.jsonl")
    with open(data, "w") as f:
        for i, c in enumerate(convs):
            f.write(json.dumps({"id": str(i), "conversations": [{"role": m["role"], "content": m["content"]}
                                                                for m in c["messages"]]}) + "\n")
    out = str(base / "run")
    info = tp.prepare(out, model, data, max_length=384, draft_vocab=64, eval_records=4)
    return out, model, data, info


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_reference_reads_our_rows_vocabulary_and_features(prepared):
    import torch
    from datasets import load_from_disk
    from safetensors.numpy import load_file

    from confu_jax.data.draft_vocab import DraftVocab
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.models.target import real_forward
    from confu_jax.train.target_loading import resolve_target
    from confu_jax.weights import load_model

    out, model, data, info = prepared
    assert info["conversations"] == {"train": 24, "heldout": 4}
    # speculators' prepare-data kept every row as we rendered it (its order is its own shuffle); its index
    # split puts exactly our training rows first and our held-out rows after
    ref = load_from_disk(os.path.join(out, "ref_data"))
    n_train = info["rows"]["train"]
    key = lambda r: (tuple(int(t) for t in r["input_ids"]), tuple(int(m) for m in r["loss_mask"]))  # noqa: E731
    ours_train, ours_eval = _rows(os.path.join(out, tp.TRAIN_ROWS)), _rows(os.path.join(out, tp.EVAL_ROWS))
    assert sorted(map(key, ref.select(range(n_train)))) == sorted(map(key, ours_train))
    assert sorted(map(key, ref.select(range(n_train, len(ref))))) == sorted(map(key, ours_eval))
    assert int(len(ref) * info["train_data_ratio"]) == n_train
    # one draft vocabulary: speculators' d2t offsets / t2d mask are our .npz
    vocab = DraftVocab.load(os.path.join(out, "draft_vocab.npz"))
    again = DraftVocab.from_eagle3(np.load(os.path.join(out, "d2t.npy")), np.load(os.path.join(out, "t2d.npy")))
    np.testing.assert_array_equal(again.d2t, vocab.d2t)
    np.testing.assert_array_equal(again.t2d, vocab.t2d)
    assert vocab.draft_size == 64

    # the hidden states transformers wrote are our target's taps, and the last entry is pre-norm
    assert tp.write_hidden_states(out, threads=1, limit=3) == 3
    config = tp.our_config(model, data, 384, 64, 4)
    resolve_target(config)
    spec = model_spec_from_config(config)
    _, params = load_model(model)
    for i in range(3):
        f = load_file(os.path.join(out, "ref_data", "hidden_states", f"hs_{i}.safetensors"))
        ids = np.asarray(ref[i]["input_ids"], np.int32)
        np.testing.assert_array_equal(f["token_ids"], ids)
        o = real_forward(spec, params, ids[None])
        taps = np.asarray(o.taps_btc[0], np.float32)
        hs = f["hidden_states"]
        assert hs.shape == (len(ids), 4, 64) and hs.dtype == np.float32
        np.testing.assert_allclose(hs[:, :3].reshape(len(ids), -1), taps, atol=2e-5, rtol=1e-4)
        logits = np.asarray(o.logits_btv[0], np.float32)
        last = torch.tensor(hs[:, 3])
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + spec.target.rms_eps)
        ref_logits = (normed.numpy() * np.asarray(params["final_norm"]["scale"])) @ np.asarray(
            params["lm_head"]["kernel"], np.float32)
        np.testing.assert_allclose(ref_logits, logits, atol=1e-4, rtol=1e-4)


def test_speculators_trains_on_cpu_resumes_and_its_head_binds_to_our_target(prepared):
    import jax

    from confu_jax.data.draft_vocab import DraftVocab
    from confu_jax.weights import load_model
    from confu_jax.weights.eagle3_formats import bind_to_target, load_head

    out, model, _, _ = prepared
    tp.write_hidden_states(out, threads=1)
    run = dict(steps=6, threads=1, checkpoint_every=0.2, tokens_per_step=512)  # ~14 steps an epoch: saves at 3
    from experiments.speculators_cpu import KILL_AFTER_SAVES

    def state(ckpts):
        with open(os.path.join(ckpts, "0", "training_state.json")) as f:
            return json.load(f)

    # killed right after its first (mid-epoch) checkpoint, then started again: it resumes at that step
    ckpts = os.path.join(out, "reference", "checkpoints")
    assert tp.train_reference(out, env={KILL_AFTER_SAVES: "1"}, **run) == 137
    killed = state(ckpts)
    assert killed["local_step"] > 0 and 0 < killed["global_step"] < run["steps"], killed
    assert tp.train_reference(out, **run) == 0
    assert state(ckpts)["global_step"] == run["steps"]
    with open(os.path.join(out, "reference", "train.log")) as f:
        assert f"Resuming mid-epoch from epoch=0 local_step={killed['local_step']} " \
               f"global_step={killed['global_step']}" in f.read()

    # the head it wrote binds to our target, with our draft vocabulary and EAGLE-3's taps
    cfg, params = load_model(model)
    spec, trainable, vocab = bind_to_target(load_head(os.path.join(ckpts, "0")), cfg, params)
    np.testing.assert_array_equal(vocab["d2t"], DraftVocab.load(os.path.join(out, "draft_vocab.npz")).d2t)
    assert spec.taps == (2, 4, 5)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(trainable))

    # released like our heads: manifest naming the trainer, its patches and settings; decoding loads it (hashes
    # and target checked) to the weights the reference wrote
    from confu_jax.decode.families import decode_head
    from confu_jax.runs.head_release import verify_head_release

    record = tp.training_record(out, "reference")
    release = os.path.join(out, "release")
    r = subprocess.run([sys.executable, "-m", "launch.release_head", "--head", os.path.join(ckpts, "0"), "--target",
                        model, "--training", record, "--release", release], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = verify_head_release(release)
    assert manifest["training"]["trainer"] == "speculators" and manifest["training"]["version"] == "0.9.0"
    assert len(manifest["training"]["patches"]) == 4 and manifest["training"]["step"] == run["steps"]
    assert manifest["training"]["different"]["optimizer"]["speculators"].startswith("Muon")
    loaded = decode_head("eagle3", cfg, params, release)
    released = jax.tree_util.tree_leaves(loaded.drafter_params)
    assert any(np.array_equal(np.asarray(x, np.float32), np.asarray(trainable["draft"]["fc"]["kernel"], np.float32))
               for x in released if np.shape(x) == np.shape(trainable["draft"]["fc"]["kernel"]))


def test_vllm_counters_pair_by_question(tmp_path):
    """vLLM's per-prompt counters become decode_bench's per-question counts: the paired τ of each head is
    vLLM's own 1 + accepted / drafts over the prompts, and a result without per-prompt counters is refused."""
    rng = np.random.default_rng(0)
    ids = [[f"q{i}", "ab"[i % 2]] for i in range(12)]
    paths = []
    for name in ("a", "b"):
        per = [{"drafts": int(d), "accepted": int(rng.integers(0, 2 * d)), "draft_tokens": 3 * int(d)}
               for d in rng.integers(20, 40, len(ids))]
        res = {"per_prompt": per, "drafts": sum(p["drafts"] for p in per), "accepted": sum(p["accepted"] for p in per),
               "accepted_per_pos": [1, 0, 0]}
        res["tau"] = 1 + res["accepted"] / res["drafts"]
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(res))
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    out = tp.vllm_compare(str(paths[0]), str(paths[1]), str(tmp_path / "ids.json"), n_boot=200)
    a, b = (json.loads(p.read_text()) for p in paths)
    assert out["n_questions"] == 12
    assert out["tau"]["row"] == pytest.approx(a["tau"]) and out["tau"]["reference"] == pytest.approx(b["tau"])
    lo, hi = out["tau_ratio"]["ci"]
    assert lo <= a["tau"] / b["tau"] <= hi
    with pytest.raises(ValueError, match="--per_prompt"):
        tp.vllm_questions({"drafts": 3}, ids)


def test_vllm_position_counts_give_our_conditional_depth_rates():
    """vLLM counts accepted tokens per draft position; in a chain, count_k / count_{k-1} is our loop's
    acceptance rate at depth k (metrics.depth_acceptance_rates on the same passes)."""
    from confu_jax.bench.metrics import GenerationLog, depth_acceptance_rates

    lengths = np.random.default_rng(1).choice(4, size=500, p=[0.5, 0.25, 0.15, 0.1]) + 1  # emitted per pass
    per_pos = [int((lengths - 1 >= k).sum()) for k in (1, 2, 3)]
    log = GenerationLog(question_id="q", category="c", accept_lengths=tuple(lengths), new_tokens=int(lengths.sum()),
                        wall_s=1.0)
    np.testing.assert_allclose(tp.conditional_acceptance(per_pos, len(lengths)), depth_acceptance_rates([log], 3))


def test_a_variant_changes_one_thing():
    """Each ablation is our run's flags plus its own, in its own workdir, and sets nothing the equal settings
    set (a variant changes one difference from the reference, never the shared recipe); a variant with longer
    packed rows takes fewer of them, the token slots a step unchanged."""
    base = tp.our_flags("/o", "asset:t", "d", 10)
    set_by_base = {f.split("=")[0] for f in base if f.startswith("--config.")}
    for name, extra in tp.VARIANTS.items():
        assert not {f.split("=")[0] for f in extra} & set_by_base, name
        flags = tp.our_flags("/o", "asset:t", "d", 10, variant=name)
        assert flags[flags.index("--workdir") + 1] == f"/o/ours_{name}"
        rows = [f for f in flags if f.startswith("--config.data.global_batch_size=")]
        row_length = tp.ROW_LENGTH.get(name, tp.EQUAL["max_length"])
        assert rows == [f"--config.data.global_batch_size={tp.EQUAL['tokens_per_step'] // row_length}"], name
        assert [f for f in flags if f not in base and not f.startswith("/o/") and f not in rows] == extra
    with pytest.raises(ValueError, match="variant"):
        tp.our_flags("/o", "asset:t", "d", 10, variant="nope")


def test_the_report_gathers_every_measurement(tmp_path):
    """``report`` on a run directory written the way the stages write it: each head's τ and interval come from
    its bench row, the paired comparisons are the stored files, each trainer's held-out figures are its own
    evaluation's last, the token fill is real tokens over slots; the table shows vLLM's depth rates as our
    conditional ones; a measurement not taken yet is named."""
    from confu_jax.bench.compare import compare

    out = tmp_path / "run"
    rng = np.random.default_rng(2)
    (out / "reference").mkdir(parents=True)
    (out / "ours").mkdir()
    (out / "reference" / "train.log").write_text(
        "".join(f"profile/step_ms={ms:.1f}, profile/tokens_per_s={tps:.1f}, epoch=0\n" for ms, tps in
                ((2000.0, 4000.0), (4000.0, 2000.0)))  # 8000 real tokens a step
        + "INFO val/loss_0_epoch=3.5, val/full_acc_0_epoch=0.3, val/cond_acc_0_epoch=0.3, val/loss_1_epoch=4.0, "
          "val/full_acc_1_epoch=0.1, val/cond_acc_1_epoch=0.25, val/loss_2_epoch=4.25, val/full_acc_2_epoch=0.02, "
          "val/cond_acc_2_epoch=0.2, val/loss_epoch=11.75, epoch=0\n")
    cols = [f"{m}/step{s}" for m in ("loss", "acc", "cond_acc") for s in range(3)]
    (out / "ours" / "eval.csv").write_text("step," + ",".join(cols) + "\n" + "".join(
        f"{st}," + ",".join(str(st / 100 + i) for i in range(9)) + "\n" for st in (5, 10)))
    (out / "ours" / "throughput.csv").write_text("step,throughput/real_tokens_per_s,throughput/step_s,"
                                                 "throughput/tokens_per_s\n1,3072.0,2.0,4096.0\n2,1024.0,4.0,2048.0\n")
    for d in ("bench", "vllm"):
        (out / d).mkdir()
    ids = [[f"q{i}", "ab"[i % 2]] for i in range(6)]
    rows = {}
    for p in ("mtbench", "grounded"):
        (out / "vllm" / f"prompts_{p}.ids.json").write_text(json.dumps(ids))
        for h in ("ours", "reference"):
            results = []
            for t in (0.0, 1.0):
                qs = {q: {"category": c, "emitted": int(rng.integers(30, 60)), "passes": 25} for q, c in ids}
                tau = sum(v["emitted"] for v in qs.values()) / sum(v["passes"] for v in qs.values())
                row = {"method": "eagle3", "temperature": t, "budget": "chain:3", "tau": tau, "tau_ci": [tau - .1, tau + .1],
                       "acceptance_rate_per_depth": [0.3, 0.2, 0.1], "n_questions": 6, "accept_length_histogram": [1],
                       "questions": qs}
                results.append(row)
                rows[(h, p, t)] = row
                per = [{"drafts": 20, "accepted": int(rng.integers(0, 20)), "draft_tokens": 60} for _ in ids]
                acc = sum(x["accepted"] for x in per)
                (out / "vllm" / f"{h}_{p}_T{int(t)}.json").write_text(json.dumps(
                    {"per_prompt": per, "drafts": 120, "accepted": acc, "accepted_per_pos": [acc - 10, 8, 2],
                     "tau": 1 + acc / 120}))
            (out / "bench" / f"{h}_{p}.json").write_text(json.dumps({"results": results}))
        for t in (0, 1):
            (out / "bench" / f"compare_{p}_T{t}.json").write_text(json.dumps(
                compare(rows[("ours", p, float(t))], rows[("reference", p, float(t))], n_boot=100)))
            with pytest.raises(FileNotFoundError, match=f"compare_{p}_T{t}.json: not measured yet"):
                tp.report(str(out))
            c = tp.vllm_compare(str(out / "vllm" / f"ours_{p}_T{t}.json"), str(out / "vllm" / f"reference_{p}_T{t}.json"),
                                str(out / "vllm" / f"prompts_{p}.ids.json"), n_boot=100)
            (out / "vllm" / f"compare_{p}_T{t}.json").write_text(json.dumps(c))
    rec = tp.report(str(out))
    for p in ("mtbench", "grounded"):
        for t in (0, 1):
            for h in ("ours", "reference"):
                assert rec["our_loop"][f"{p}_T{t}"][h]["tau"] == rows[(h, p, float(t))]["tau"]
            assert rec["vllm"][f"{p}_T{t}"]["tau"]["row"] == pytest.approx(
                json.loads((out / "vllm" / f"ours_{p}_T{t}.json").read_text())["tau"])
    assert rec["heldout"]["reference"]["kl"] == [3.5, 4.0, 4.25]
    assert rec["heldout"]["ours"]["step"] == 10 and rec["heldout"]["ours"]["kl"] == [0.1, 1.1, 2.1]
    assert rec["tokens"]["reference"] == {"steps_counted": 2, "real_tokens": 16000, "fill": 16000 / 16384}
    assert rec["tokens"]["ours"]["real_tokens"] == 10240
    table = tp.report_table(rec)
    assert table.count("| our loop |") == 4 and table.count("| vLLM CPU |") == 4
    acc = json.loads((out / "vllm" / "ours_mtbench_T0.json").read_text())["accepted"]
    first = tp.conditional_acceptance([acc - 10, 8, 2], 120)
    assert " / ".join(f"{a:.2f}" for a in first) in table
    # a variant: its bench rows, its comparisons with ours, its own evaluation and throughput log
    import shutil

    shutil.copytree(out / "ours", out / "ours_x")
    for p in ("mtbench", "grounded"):
        shutil.copy(out / "bench" / f"ours_{p}.json", out / "bench" / f"ours_x_{p}.json")
        for t in (0, 1):
            (out / "bench" / f"compare_x_{p}_T{t}.json").write_text(json.dumps(
                compare(rows[("reference", p, float(t))], rows[("ours", p, float(t))], n_boot=100)))
    rec = tp.report(str(out), ("x",))
    assert rec["heldout"]["ours_x"] == rec["heldout"]["ours"] and rec["tokens"]["ours_x"] == rec["tokens"]["ours"]
    table = tp.variants_table(rec)
    ratio = rec["variants"]["x"]["mtbench_T0"]["tau_ratio"]
    assert ratio["ratio"] == pytest.approx(rows[("reference", "mtbench", 0.0)]["tau"] / rows[("ours", "mtbench", 0.0)]["tau"])
    assert table.count("| x | 0.10 / 1.10 / 2.10 | 10,240 (62%) | ") == 1 and f"{ratio['ratio']:.3f} [" in table
