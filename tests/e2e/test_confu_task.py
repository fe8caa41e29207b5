"""The ConFu training task behind ``launch.train``: config sections, self-distilled tiny data, and a
real CLI run on the tiny target that learns (eval τ) and writes the draft vocabulary with its
checkpoints."""

import csv
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from confu_jax.models.llama import Llama
from confu_jax.models.spec import model_spec_from_config
from confu_jax.train.synthetic_data import SelfDistilledStream
from confu_jax.train.target_loading import load_target
from confu_jax.train.loss import ALL_POSITIONS, objective_from_config
from tests.helpers.xla_env import EIGHT_DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(variant="confu"):
    from configs.tiny import get_config

    return get_config(variant)


def test_objective_sections_of_every_config():
    from configs.smollm2_confu import get_config

    c = get_config()
    assert c.train.task == "head"
    train, ev = objective_from_config(c), objective_from_config(c, evaluation=True)
    assert (train.k_train, train.replication, train.max_lag, train.ttt_steps) == (256, 3, 7, 7)
    assert (ev.k_train, ev.replication) == (ALL_POSITIONS, 0)
    c.draft.draft_vocab_size = 1000  # one setting read by the model and the data pipeline
    assert c.data.draft_vocab_size == 1000


def test_self_distilled_stream_is_the_targets_greedy_chain():
    config = _tiny()
    spec, params = load_target(config, model_spec_from_config(config))
    full = SelfDistilledStream(spec.target, params, global_batch=4, seq_len=16, prompt_len=3, seed=5)
    b = full.batch_at(2)
    logits = Llama(spec.target).apply({"params": params}, b["tokens"], np.arange(16)[None]).logits_btv
    np.testing.assert_array_equal(np.asarray(logits[:, 2:-1].argmax(-1)), b["tokens"][:, 3:])
    assert not b["loss_mask"][:, :3].any() and b["loss_mask"][:, 3:].all()
    # a process's rows are its slice of the same global batch; the position is the whole state
    part = SelfDistilledStream(spec.target, params, global_batch=4, seq_len=16, prompt_len=3, seed=5,
                               process_index=1, process_count=2)
    part.set_state({"position": 2, "seed": 5})
    np.testing.assert_array_equal(next(part)["tokens"], b["tokens"][2:])
    with pytest.raises(ValueError, match="synthetic.seed"):
        part.set_state({"position": 0, "seed": 6})


@pytest.mark.slow
def test_launch_train_tiny_learns_and_saves_the_draft_vocab(tmp_path):
    """``python -m launch.train --config configs/tiny.py:eagle3`` over 8 CPU devices (data-parallel)."""
    work = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS=EIGHT_DEVICES)
    cmd = [sys.executable, "-m", "launch.train", "--config", "configs/tiny.py:eagle3", "--workdir", str(work),
           "--config.train.progress_bar=False", "--config.draft.draft_vocab_size=64",
           "--config.train.eval_every=1"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(work / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    tau = [float(x["acceptance_length"]) for x in rows]
    loss = [float(x["loss"]) for x in rows]
    assert [int(x["step"]) for x in rows] == list(range(1, 41))
    assert tau[-1] > tau[0] + 0.2 and loss[-1] < loss[0], (tau, loss)
    saved = json.loads((work / "config.json").read_text())
    assert saved["data"]["draft_vocab_size"] == 64
    from confu_jax.runs.checkpoint import Checkpointer

    ckpt = Checkpointer(str(work / "checkpoints"), every=20, keep=3, async_save=False)
    assert ckpt.latest_step() == 40
    ckpt.close()
    assert jax.device_count() >= 1  # (the run itself used 8 devices in its own process)


def _run_tiny_confu(mesh_shape, n_steps=2, ttt_steps=3):
    from confu_jax import sharding as shd
    from confu_jax.train.loop import setup_run

    n = int(np.prod(mesh_shape))
    mesh = shd.make_mesh(*mesh_shape, devices=jax.devices()[:n])
    config = _tiny("confu")
    config.draft.ttt_steps = ttt_steps
    run = setup_run(config, mesh=mesh)
    it = run.task.train_iterator(0, 1)
    state, step, metrics = run.init_state(), None, []
    for _ in range(n_steps):
        batch = shd.global_batch(next(it), mesh)
        step = step or run.compile_train_step(batch)
        state, m = step(state, batch)
        metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
    return metrics, jax.device_get(state.params), state


@pytest.mark.slow
def test_confu_step_on_a_2x2x2_mesh_equals_single_device(monkeypatch):
    """The whole ConFu step (anchors, contemplate pass, TTT, AdamW) sharded over data×fsdp×tensor.

    With all three mesh axes > 1, XLA:CPU (jax 0.10.2) got the draft layer's gradient wrong by
    1-90 % until draft_ttt pinned its activations to batch-sharded rows (``shd.constrain``).
    The sharded run also attends in query chunks (remat under lax.map, as rows longer than
    ``Q_CHUNK`` do), the reference in one dense pass: chunking changes nothing either."""
    import confu_jax.models.draft_attention as da

    monkeypatch.setattr(da, "Q_CHUNK", 0)
    ref_m, ref_p, _ = _run_tiny_confu((1, 1, 1), n_steps=1, ttt_steps=2)
    monkeypatch.setattr(da, "Q_CHUNK", 7)
    got_m, got_p, live = _run_tiny_confu((2, 2, 2), n_steps=1, ttt_steps=2)
    for a, b in zip(ref_m, got_m):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=5e-5, atol=1e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_p), jax.tree_util.tree_leaves(got_p)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    soft = live.params["confu"]["soft_prompt_k_lphd"]
    assert len({s.device for s in soft.addressable_shards}) == 8


def test_lm_head_init_from_target_copies_the_draft_vocab_rows_and_final_norm():
    """draft.lm_head_init='target': the draft LM head is the target's, restricted to the draft vocab."""
    from confu_jax.models.draft import DraftHead
    from confu_jax.train.confu_task import build_task

    config = _tiny("confu")
    config.draft.lm_head_init = "target"
    task = build_task(config)
    params = jax.jit(task.init_params)(jax.random.PRNGKey(0))
    d2t = task.extra_arrays["draft_vocab_d2t"]
    _, target = load_target(config, model_spec_from_config(config))
    emb_vd = np.asarray(target["embed"]["embedding"])  # tiny ties embeddings: lm_head = embed^T
    np.testing.assert_array_equal(np.asarray(params["draft"]["lm_head"]["kernel"]), emb_vd[d2t].T)
    np.testing.assert_array_equal(np.asarray(params["draft"]["final_norm"]["scale"]),
                                  np.asarray(target["final_norm"]["scale"]))
    # the draft's logits of a target-like hidden state are the target's logits on the draft vocab
    spec = model_spec_from_config(config)
    h = np.random.default_rng(0).normal(size=(1, 3, spec.target.d_model)).astype(np.float32)
    draft_logits = DraftHead(spec).apply({"params": params["draft"]}, h, method=DraftHead.logits)
    np.testing.assert_allclose(np.asarray(draft_logits), (h @ emb_vd.T)[..., d2t], rtol=1e-5, atol=1e-5)



def test_unknown_lm_head_init_is_refused_before_any_work():
    from confu_jax.train.confu_task import build_task

    config = _tiny("eagle3")
    config.draft.lm_head_init = "zeros"
    with pytest.raises(ValueError, match="lm_head_init: expected 'random' or 'target', got 'zeros'"):
        build_task(config)


def test_pallas_attention_is_refused_in_training_and_off_gpu():
    """The tree-attention kernel has no VJP: a training config naming it fails before any work;
    the compiled kernel needs a GPU, so a spec resolved for a CPU backend refuses 'pallas'."""
    from configs.tiny import get_config
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.confu_task import build_task

    for impl in ("pallas", "pallas_interpret"):
        c = get_config("confu")
        c.model.attention_impl = impl
        with pytest.raises(ValueError, match="cannot train.*no VJP"):
            build_task(c)
    c.model.attention_impl = "pallas"
    with pytest.raises(ValueError, match="needs a CUDA GPU.*'cpu'"):
        model_spec_from_config(c, backend="cpu")
    assert model_spec_from_config(c, backend="gpu").target.attention_impl == "pallas"
    c.model.attention_impl = "flash"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        model_spec_from_config(c, backend="gpu")


def test_dense_anchors_that_leave_the_replication_window_unused_are_warned(caplog):
    from configs.tiny import get_config
    from confu_jax.train.confu_task import warn_if_windows_unused

    c = get_config("confu")
    c.data.max_length, c.confu.replication = 128, 3
    c.objective.k_train = 256  # the old quickstart setting: every position is an anchor
    with caplog.at_level("WARNING"):
        assert warn_if_windows_unused(c)
    assert "replication windows have (almost) no effect; use k_train <= 15" in caplog.text
    c.objective.k_train = 15
    assert not warn_if_windows_unused(c)
    c.confu.variant = "eagle3"  # no anchors at all
    c.objective.k_train = 256
    assert not warn_if_windows_unused(c)


def test_lag_weights_draw_lags_with_the_configured_distribution():
    import jax

    from confu_jax.train.loss import ObjectiveConfig, sample_lags

    cfg = ObjectiveConfig(max_lag=4, lag_weights=(0.7, 0.2, 0.1, 0.0))
    lags = np.asarray(sample_lags(jax.random.PRNGKey(0), (200_000,), cfg))
    freq = np.bincount(lags, minlength=5)[1:] / lags.size
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1, 0.0], atol=0.005)
    uniform = np.asarray(sample_lags(jax.random.PRNGKey(0), (1000,), ObjectiveConfig(max_lag=4)))
    assert uniform.min() == 1 and uniform.max() == 4
    with pytest.raises(ValueError, match="lag_weights must be 4"):
        ObjectiveConfig(max_lag=4, lag_weights=(1.0, 1.0))


def test_eval_lag_weights_apply_to_evaluation_only():
    # two runs trained with different lag distributions are compared on held-out tau under one
    from configs import smollm2_confu

    c = smollm2_confu.get_config()
    c.confu.max_lag = 4
    c.confu.lag_weights = (1.0, 1.0, 0.0, 0.0)
    assert objective_from_config(c).lag_weights == objective_from_config(c, evaluation=True).lag_weights == (
        1.0, 1.0, 0.0, 0.0)
    c.confu.eval_lag_weights = (0.7, 0.2, 0.1, 0.0)
    assert objective_from_config(c).lag_weights == (1.0, 1.0, 0.0, 0.0)
    assert objective_from_config(c, evaluation=True).lag_weights == (0.7, 0.2, 0.1, 0.0)
