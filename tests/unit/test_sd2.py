"""SD² training (``train.sd2_task``) on the tiny random target, and decoding with the trained run.

(1) At initialisation the steering is the identity sum with W_s = 0 and the delta is zero, so the
loss is the unsteered drafter's and does not depend on the offset δ; (2) a short run on
self-distilled data lowers the KL and moves the steering off zero; decoding with the run's
drafter (``decode_head('sd2', workdir)``) equals AR, greedy; (3) the distilled baseline trains the
drafter alone. Kill-and-resume: tests/contract/test_family_contract.py, for every family that trains.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.train.metric_writers import read_csv

def _config(**extra):
    from configs.tiny_sd2 import get_config
    from tests.helpers.train_resume import short_run_config

    return short_run_config(get_config, **extra)


@pytest.mark.slow
def test_initial_loss_is_the_unsteered_drafters():
    from confu_jax.models.llama import Llama
    from confu_jax.train.loop import setup_run
    from confu_jax.train import sd2_task

    run = setup_run(_config())
    state = run.init_state()
    batch = next(run.task.train_iterator(0, 1))
    metrics = jax.jit(run.task.eval_fn)(state.params, run.frozen, batch, jax.random.PRNGKey(0))
    k = int(run.config.sd2.max_offset)
    kls = [float(metrics[f"kl/delta{d}"]) for d in range(1, k + 1)]
    assert kls[0] > 0 and all(x == kls[0] for x in kls), kls  # W_s = 0: the offset cannot matter
    # the same KL by hand: the target's first 2 layers, no bias, against the target
    from confu_jax.models.early_exit import early_exit_config, early_exit_params
    from confu_jax.models.spec import model_spec_from_config

    tp = jax.device_get(run.frozen["target"])

    spec = model_spec_from_config(run.config)
    toks = jnp.asarray(batch["tokens"])
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    dcfg = early_exit_config(spec.target, 2)
    q = jax.nn.log_softmax(Llama(dcfg).apply({"params": early_exit_params(tp, 2)}, toks, pos).logits_btv[:, :-1], -1)
    p = jax.nn.log_softmax(Llama(spec.target).apply({"params": tp}, toks, pos).logits_btv[:, :-1], -1)
    kl = jnp.sum(jnp.exp(p) * (p - q), -1)
    mask = jnp.asarray(batch["loss_mask"][:, 1:], jnp.float32)
    np.testing.assert_allclose(kls[0], float(jnp.sum(kl * mask) / mask.sum()), rtol=1e-4)
    assert sd2_task.default_sd2_config().train_drafter


@pytest.mark.slow
def test_training_lowers_the_kl_and_the_run_decodes(tmp_path):
    from confu_jax.decode import loop
    from confu_jax.decode.families import parse_drafter
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.families import decode_head
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.draft_models import is_sd2_workdir
    from confu_jax.train.loop import train
    from confu_jax.train.target_loading import load_target

    workdir = str(tmp_path / "sd2")
    config = _config(**{"train.steps": 40, "train.eval_every": 20, "train.checkpoint.every": 20})
    result = train(config, workdir)
    assert result.step == 40
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.7 * first, (first, last)
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"] and ev[-1]["acceptance_length"] > ev[0]["acceptance_length"]
    assert is_sd2_workdir(workdir)
    # decode with the trained drafter: lossless, and steered (W_s moved off zero)
    spec, tp = load_target(config, model_spec_from_config(config))
    head = decode_head("sd2", spec.target, tp, workdir)
    assert head.trained and "SD²" in head.source
    assert np.abs(np.asarray(head.drafter_params.weights["steering"]["w_s"]["kernel"])).max() > 0
    prompts = [[5, 9, 17, 3], [40, 2, 7, 7, 1, 30]]
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=16, eos_ids=())
    sp = loop.generate_speculative(head.target, parse_drafter("sd2", "chain:3"), head.drafter_params, prompts,
                                   max_new_tokens=16, eos_ids=())
    n = np.asarray(sp.n_generated_b)
    assert [np.asarray(sp.tokens_bn)[b, :n[b]].tolist() for b in range(2)] == \
        [np.asarray(ar.tokens_bn)[b, :np.asarray(ar.n_generated_b)[b]].tolist() for b in range(2)]


@pytest.mark.slow
def test_distilled_baseline_fine_tunes_the_drafter_alone(tmp_path):
    """``config.sd2.steer=False`` (the paper's distilled baseline): no steering parameters, the same
    initial loss as SD² (W_s = 0 makes SD² start unsteered), a lower KL after training, and the run
    decodes losslessly as ``draft_model`` while ``sd2`` refuses it (it has nothing to steer with)."""
    from confu_jax.decode import loop
    from confu_jax.decode.families import parse_drafter
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.families import decode_head
    from confu_jax.models.early_exit import early_exit_params
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.loop import setup_run, train
    from confu_jax.train.target_loading import load_target

    steered, distilled = setup_run(_config()), setup_run(_config(**{"sd2.steer": False}))
    s0, d0 = steered.init_state(), distilled.init_state()
    assert "steering" not in d0.params["draft"] and set(d0.params["draft"]) == {"model_delta"}
    batch = next(distilled.task.train_iterator(0, 1))
    rng = jax.random.PRNGKey(0)
    ls, _ = jax.jit(steered.task.loss_fn)(s0.params, steered.frozen, batch, rng)
    ld, _ = jax.jit(distilled.task.loss_fn)(d0.params, distilled.frozen, batch, rng)
    np.testing.assert_allclose(float(ld), float(ls), rtol=1e-5)
    with pytest.raises(ValueError, match="trains nothing"):
        setup_run(_config(**{"sd2.steer": False, "sd2.train_drafter": False}))

    workdir = str(tmp_path / "distill")
    config = _config(**{"sd2.steer": False, "train.steps": 20, "train.eval_every": 10,
                        "train.checkpoint.every": 10})
    assert train(config, workdir).step == 20
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"]
    spec, tp = load_target(config, model_spec_from_config(config))
    with pytest.raises(ValueError, match="distilled run"):
        decode_head("sd2", spec.target, tp, workdir)
    head = decode_head("draft_model", spec.target, tp, workdir)
    assert "steering" not in head.drafter_params.weights and "model" in head.drafter_params.weights
    pretrained = early_exit_params(tp, head.spec.draft_model.n_layers)  # the drafter moved off it
    assert max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()) for a, b in zip(
        jax.tree_util.tree_leaves(head.drafter_params.weights["model"]), jax.tree_util.tree_leaves(pretrained))) > 0
    prompts = [[5, 9, 17, 3], [40, 2, 7, 7, 1, 30]]
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=16, eos_ids=())
    sp = loop.generate_speculative(head.target, parse_drafter("draft_model", "chain:3"), head.drafter_params, prompts,
                                   max_new_tokens=16, eos_ids=())
    n = np.asarray(sp.n_generated_b)
    assert [np.asarray(sp.tokens_bn)[b, :n[b]].tolist() for b in range(2)] == \
        [np.asarray(ar.tokens_bn)[b, :np.asarray(ar.n_generated_b)[b]].tolist() for b in range(2)]
