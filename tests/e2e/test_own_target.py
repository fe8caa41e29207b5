"""docs/own_target.md, run as written, on a tiny Llama and a tiny Qwen3 checkpoint no preset describes
(the Qwen3 run without the lines that read nothing architecture-specific: ConFu's, the benchmark's, the
multi-process run's).

The commands are read from the document's ``bash`` blocks (so the document cannot drift from what
works) and run in order with the document's variables set small; ``launch.generate`` gets
``--print_ids``, ``launch.decode_bench`` one prompt width (``--min_bucket``), the two-process run 2 steps. Then the properties each step promises: data written and reloaded, EAGLE-3's loss
falls, ConFu starts from EAGLE-3, the speculators export loads in speculators' own model (the target's
class named as verifier) with our logits, every head decodes exactly the AR tokens, the benchmark is
lossless.
"""

import csv
import json
import os
import re
import subprocess

import numpy as np
import pytest

from tests.helpers.speculators_ref import our_ttt_logits, speculators_ttt_logits
from tests.helpers.tiny_checkpoints import hf_llama, hf_qwen, write_hf_tokenizer
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "own_target.md")

# Shapes no preset has; 8 layers so EAGLE-3's taps (2, L//2, L-3) are distinct; 4096 positions hold the
# benchmark's MT-Bench prompts at the tiny tokenizer's ~1 token per byte.
TARGETS = {
    "llama": dict(vocab=300, hidden=80, layers=8, heads=5, kv_heads=1, head_dim=16, ffn=144, max_pos=4096,
                  rope_theta=500000.0),
    "qwen3": dict(family="qwen3", vocab=300, hidden=64, layers=8, heads=4, kv_heads=2, head_dim=24, ffn=112,
                  max_pos=4096),
}
SMALL = {"PROMPTS": "sharegpt", "N_PROMPTS": "16", "MAX_NEW": "24", "GEN_BATCH": "8", "MAX_LEN": "96",
         "BATCH": "8", "STEPS": "24", "EVAL_EVERY": "12", "PER_CATEGORY": "1"}


def doc_commands(path=DOC) -> list:
    """Every command of the document's ``bash`` blocks, continuation lines joined, in order."""
    text = open(path, encoding="utf-8").read()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return commands


def test_the_document_is_what_the_test_runs():
    cmds = doc_commands()
    modules = [re.search(r"python -m (\S+)", c).group(1) for c in cmds if "python -m" in c]
    assert modules == ["launch.generate_data", "launch.train", "launch.train", "launch.export_head",
                       "launch.export_head"] + ["launch.generate"] * 4 + ["launch.decode_bench"]
    assert all(c.startswith(("export ", "python -m ", "CPU_DEVICES=2 launch/local_multiprocess.sh 2 -- "))
               for c in cmds), cmds
    assert "launch/local_multiprocess.sh" in cmds[-1]
    assert "configs/eagle3.py" in cmds[3] and "configs/confu.py" in cmds[4]  # no preset: the checkpoint decides


def _checkpoint(directory, name):
    kw = dict(TARGETS[name])
    if kw.get("family"):
        hf_qwen(directory, seed=31, **kw)
    else:
        hf_llama(directory, seed=31, **kw)
    write_hf_tokenizer(directory, generation_eos=[2, 0])
    return str(directory)


def _run_document(model, work, skip=()):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, MODEL=model, WORK=work,
               HF_HUB_OFFLINE="1", **SMALL)
    exports, outputs = [], []
    for cmd in doc_commands():
        if any(k in cmd for k in skip):
            continue
        if cmd.startswith("export "):
            exports.append(cmd)
            continue
        if "python -m launch.generate " in cmd + " ":
            cmd += " --print_ids"
        if "python -m launch.decode_bench " in cmd:
            # one padded prompt width: one program per method, not one per power of two the tiny tokenizer's
            # ~1-token-a-byte MT-Bench prompts reach (the compiles were most of this command's time)
            cmd += " --min_bucket=2048"
        steps = []
        if "launch/local_multiprocess.sh" in cmd:
            # two processes x 2 devices: what is asserted of it (the default batch, finite logged losses) needs
            # one logged step; the run's last step is always logged (24 steps took 34 s here, 2 take 25)
            steps = ["export STEPS=2"]
        script = "set -euo pipefail\n" + "\n".join(exports + steps) + "\n" + cmd
        r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{cmd}\n--- stderr ---\n{r.stderr[-4000:]}"
        outputs.append((cmd, r))
    return outputs


def _losses(workdir, key="loss"):
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_recipe_runs_as_written(tmp_path, name, monkeypatch):
    model = _checkpoint(tmp_path / "model", name)
    work = str(tmp_path / "work")
    # The benchmark and the multi-process run read nothing family-specific, and ConFu's lines (its training from
    # EAGLE-3's checkpoint, its decode) nothing architecture-specific that EAGLE-3's do not: the Llama run covers
    # them; the Qwen3 run keeps what reads the checkpoint's architecture (data, EAGLE-3's training on qk-norm
    # features, both export layouts naming Qwen3 as verifier, decoding from the run and from the export).
    whole = name == "llama"
    outputs = _run_document(model, work, skip=() if whole else ("launch.decode_bench", "local_multiprocess.sh",
                                                                "configs/confu.py", "--method confu"))

    # 1. data: the target's own answers, written and read back by the training pipeline's reader
    from confu_jax.data.formats import iter_conversations

    convs = list(iter_conversations(os.path.join(work, "data", "train.jsonl")))
    # (conversations whose prompt exceeds generate_data's --max_prompt_len are skipped, not truncated)
    assert int(SMALL["N_PROMPTS"]) * 2 // 3 <= len(convs) <= int(SMALL["N_PROMPTS"])
    assert all(c["messages"][-1]["role"] == "assistant" for c in convs)

    # 2-3. EAGLE-3's loss falls; ConFu started from it; both recorded the checkpoint's architecture
    e3 = _losses(os.path.join(work, "eagle3"))
    assert e3[-1] < e3[0], e3
    if whole:
        with open(os.path.join(work, "confu", "init_from.json")) as f:
            source = os.path.realpath(json.load(f)["source"])
        assert source.startswith(os.path.realpath(os.path.join(work, "eagle3"))), source
        assert np.isfinite(_losses(os.path.join(work, "confu"))).all()
    for run in ("eagle3", "confu") if whole else ("eagle3",):
        with open(os.path.join(work, run, "config.json")) as f:
            arch = json.load(f)["model"]["arch"]
        assert (arch["n_layers"], arch["d_model"], arch["head_dim"], arch["qk_norm"]) == (
            8, TARGETS[name]["hidden"], TARGETS[name]["head_dim"], name == "qwen3")

    # 4. the speculators export loads in speculators' model, names the target's class, gives our logits
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from confu_jax.runs.heads import load_trained_head
    from confu_jax.weights import load_model

    out = os.path.join(work, "export", "eagle3_speculators")
    with open(os.path.join(out, "config.json")) as f:
        verifier = json.load(f)["speculators_config"]["verifier"]
    assert verifier["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]]
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel.from_pretrained(out, config=config).eval().float()
    cfg, target_params = load_model(model)
    head = load_trained_head(os.path.join(work, "eagle3"))
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, cfg.vocab_size, (1, 10)).astype(np.int32)
    h_cat = rng.normal(size=(1, 10, 3 * cfg.d_model)).astype(np.float32)
    embed = np.asarray(target_params["embed"]["embedding"], np.float32)
    ref = speculators_ttt_logits(theirs, tokens, h_cat, 2)
    ours = our_ttt_logits(head.spec, head.trainable["draft"], embed, tokens, h_cat, 2)
    for r in range(2):
        np.testing.assert_allclose(ours[r, :9 - r], ref[r, :9 - r], atol=1e-4, rtol=1e-4, err_msg=f"step {r}")
    # the official layout (SGLang / SpecForge) reads back, on this target, to the trained head bit for bit
    import jax

    from confu_jax.weights.eagle3_formats import bind_to_target, load_head

    for fmt in ("eagle3_official", "eagle3_speculators"):
        spec2, trainable2, vocab2 = bind_to_target(load_head(os.path.join(work, "export", fmt)), cfg, target_params)
        assert spec2.taps == head.spec.taps and spec2.head.draft_vocab_size == head.spec.head.draft_vocab_size
        jax.tree_util.tree_map(np.testing.assert_array_equal, trainable2["draft"], head.trainable["draft"])
        np.testing.assert_array_equal(vocab2["d2t"], head.draft_vocab["d2t"])

    # 5. every head decodes exactly AR's tokens
    ids = [[int(i) for i in re.search(r"^ids: (.*)$", r.stderr, re.M).group(1).split()]
           for cmd, r in outputs if "launch.generate " in cmd]
    assert len(ids) == (4 if whole else 3) and len(ids[0]) >= 4
    assert all(i == ids[0] for i in ids[1:])

    if not whole:
        return
    # 6. the benchmark: every speculative row lossless
    with open(os.path.join(work, "bench", "decode_bench.json")) as f:
        bench = json.load(f)
    spec_rows = [r for r in bench["results"] if r["method"] != "ar"]
    assert sorted(r["method"] for r in spec_rows) == ["confu", "eagle3"]
    for r in spec_rows:
        assert r["lossless_greedy"] is True and r["n_mismatched_turns"] == 0, r
        assert r["trained"] and r["n_questions"] == 8

    # 7. two processes x 2 devices: the default batch became a multiple of the 4 data-parallel devices
    mp = os.path.join(work, "eagle3_multiprocess")
    with open(os.path.join(mp, "config.json")) as f:
        saved = json.load(f)
    assert saved["data"]["global_batch_size"] == 16 and saved["model"]["arch"]["n_layers"] == 8
    assert len(_losses(mp)) >= 1 and np.isfinite(_losses(mp)).all()
