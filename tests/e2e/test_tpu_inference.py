"""A JAX serving engine loads what this project exports: tpu-inference 0.32.0 (vLLM on TPU) in its own
environment (``bash launch/tpu_inference_venv.sh`` makes ``.venv-tpu-inference``; CI does it).

The released SmolLM2 EAGLE-3 head, exported by ``launch.export_head --format tpu_inference``, goes
through tpu-inference's own code: its model registry must pick its JAX ``EagleLlama3ForCausalLM`` (not
the torchax fallback), its ``EagleLlama3WeightLoader`` must load every tensor (names, reshapes,
transposes, head-dim handling, ``d2t`` offsets), and its forward (``combine_hidden_states``, the draft
layer, ``compute_logits``) on SmolLM2's real tapped states for an MT-Bench prompt must give our
loop's draft logits. The one patch (its TPU attention kernel -> its own pure-JAX reference; Mosaic TPU
does not run on a CPU) is in ``tests/helpers/tpu_inference_eagle3.py``. What a CPU cannot show: its
engine loop (scheduler, proposer, paged-cache kernels) on a TPU; docs/interop.md "TPU: tpu-inference".
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.engine_venv import engine_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "tpu_inference_eagle3.py"
RELEASED_E3 = ROOT / "releases" / "heads" / "smollm2_eagle3"
TARGET = "smollm2-135m-instruct"
N_TOKENS = 48

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def tpu_inference_python() -> pathlib.Path:
    return engine_python("CONFU_JAX_TPU_INFERENCE_VENV", ".venv-tpu-inference", "tpu-inference",
                         "launch/tpu_inference_venv.sh")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Export through the CLI, our draft logits on real taps, and tpu-inference's on the same inputs."""
    import jax.numpy as jnp

    from confu_jax.bench.prompts import first_turn_ids, load_mtbench, sample_prompts
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.models.target import real_forward
    from confu_jax.runs.exports import read_eagle_source
    from confu_jax.weights import load_model
    from confu_jax.weights.export import hf_config_dict
    from tests.helpers.speculators_ref import our_ttt_logits

    py = tpu_inference_python()
    d = tmp_path_factory.mktemp("tpu_inference")
    out = d / "e3_tpu"
    proc = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", str(RELEASED_E3), "--format",
                           "tpu_inference", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg, weights = load_model(TARGET)
    (d / "smollm2").mkdir()
    (d / "smollm2" / "config.json").write_text(json.dumps(hf_config_dict(cfg)))  # its ModelConfig reads only this
    tok = ChatTokenizer.load(TARGET)
    ids = first_turn_ids(tok, sample_prompts(load_mtbench(), 1, seed=7)[0])[:N_TOKENS]
    tokens = np.asarray(ids, np.int32)[None]
    src = read_eagle_source(str(out), target=TARGET)  # our loader on the exported (bf16) file
    n = tokens.shape[1]
    fwd = real_forward(src.spec, weights, jnp.asarray(tokens), jnp.arange(n)[None], return_logits=False)
    h_cat = np.asarray(fwd.taps_btc, np.float32)
    embed = np.asarray(weights["embed"]["embedding"], np.float32)
    ours = our_ttt_logits(src.spec, src.draft, embed, tokens, h_cat, 1)[0]  # [N, V_draft], step 0
    # the draft at position j reads token j + 1 and the target's state at j (EAGLE-3's pairing)
    shifted = np.concatenate([tokens[0, 1:], [0]]).astype(np.int32)
    np.savez(d / "inputs.npz", ids=shifted, h_cat=h_cat[0], embed=embed)
    proc = subprocess.run([str(py), str(HELPER), "--target", str(d / "smollm2"), "--draft", str(out), "--inputs",
                           str(d / "inputs.npz"), "--out", str(d / "theirs.npz")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, f"tpu-inference failed:\n{proc.stderr[-5000:]}"
    theirs = dict(np.load(d / "theirs.npz"))
    return {"src": src, "ours": ours, "theirs": theirs, "n": n, "config": json.loads((out / "config.json").read_text())}


def test_the_export_reaches_tpu_inference_jax_model_and_loads_exactly(run):
    src, theirs = run["src"], run["theirs"]
    assert str(theirs["model_class"]) == "EagleLlama3ForCausalLM"  # its JAX model, not the torchax fallback
    assert run["config"]["architectures"] == ["Eagle3LlamaForCausalLM"]
    draft = src.draft
    # its loader's transposes and reshapes, checked leaf by leaf against our (bf16-exact) parameters
    np.testing.assert_array_equal(theirs["p/lm_head/kernel"], np.asarray(draft["lm_head"]["kernel"], np.float32))
    np.testing.assert_array_equal(theirs["p/model/fc/kernel"], np.asarray(draft["fc"]["kernel"], np.float32))
    t = src.spec.target
    q = np.asarray(draft["q_proj"]["kernel"], np.float32).reshape(2 * t.d_model, t.n_heads, t.head_dim)
    np.testing.assert_array_equal(theirs["p/model/layers/0/self_attn/q_proj/kernel"], q)
    np.testing.assert_array_equal(theirs["p/model/layers/0/hidden_norm/scale"],
                                  np.asarray(draft["hidden_norm"]["scale"], np.float32))
    np.testing.assert_array_equal(theirs["d2t_offsets"], src.d2t - np.arange(len(src.d2t)))


def test_tpu_inference_computes_our_draft_logits(run):
    src, ours, logits, n = run["src"], run["ours"], run["theirs"]["logits"], run["n"]
    d2t = np.asarray(src.d2t)
    finite = np.isfinite(logits)
    assert finite.sum(axis=1).tolist() == [len(d2t)] * n and finite[:, d2t].all()  # the draft vocabulary, mapped
    theirs = logits[: n - 1, d2t]  # the last position reads padding
    mine = ours[: n - 1]
    # tpu-inference computes in bf16 (weights and activations), ours in f32 on the same bf16 weights: measured
    # 0.5 % of the row's largest logit at most (2026-12-06); the bound leaves 4x
    diff = np.abs(theirs - mine)
    err = diff / np.abs(mine).max(axis=1, keepdims=True)
    assert err.max() < 0.02, f"max error {err.max():.3g} of the row's largest logit"
    # the drafted token is the same wherever our top-2 margin exceeds twice the two logits' difference
    top2 = np.sort(mine, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * diff.max(axis=1)
    assert clear.mean() >= 0.8, f"only {clear.mean():.2f} of the positions have a clear top-1"
    np.testing.assert_array_equal(theirs.argmax(1)[clear], mine.argmax(1)[clear])
