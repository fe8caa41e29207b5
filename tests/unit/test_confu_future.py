"""ConFu's future mechanisms beyond the paper (docs/DESIGN.md §4): the auxiliary future loss
(``objective.future_aux_weight``: the contemplate's f, read by the target's frozen LM head, trained to
name x[t+2 .. t+1+m]) and f in the first draft step (``confu.future_input``). The decode loop's drafts
with ``future_input`` equal the training form in tests/unit/test_loop_draft_matches_training.py, its greedy
decode equals AR in tests/unit/test_spec_loop.py.

References: the LM head in float64 numpy, anchor by anchor (tied and untied layouts); the paper's
objective on the same parameters (the draft's gradient must not move; a zero map is the paper's head);
the linear schedule in the training log of a real run.
"""

import csv
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.kv_cache import to_cache_layout
from confu_jax.models.target import contemplate_queries, real_forward
from confu_jax.train import loss as L
from confu_jax.train import rows as R
from tests.helpers.model_fakes import tiny_objective_case

V, NB, NN = 6, 2, 24
CFG = L.ObjectiveConfig(ttt_steps=3, k_train=6, replication=1, max_lag=2, vocab_chunk=4)


def _f(spec, tp, tr, batch, plan):
    out = real_forward(spec, tp, batch["tokens"])
    b_idx = jnp.arange(NB)[:, None]
    return contemplate_queries(spec, tp, tr["confu"], to_cache_layout(out.k_new_lbthd),
                               to_cache_layout(out.v_new_lbthd), plan.anchor_bk, out.taps_btc[b_idx, plan.con_src_bk])


def _reference(f, w_vd, tokens, lm, plan, ahead):
    """Mean over valid (anchor, s) of -log softmax(f W^T)[x[t+1+s]], float64, one anchor at a time."""
    logits = np.asarray(f, np.float64) @ np.asarray(w_vd, np.float64).T
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    anchor, valid = np.asarray(plan.anchor_bk), np.asarray(plan.valid_bk)
    terms = [-logp[b, k, tokens[b, anchor[b, k] + 1 + s]] for s in range(1, ahead + 1)
             for b in range(NB) for k in range(anchor.shape[1])
             if valid[b, k] and anchor[b, k] + 1 + s < NN and lm[b, anchor[b, k] + 1 + s]]
    return float(np.mean(terms)), len(terms)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_aux_loss_is_the_lm_head_cross_entropy(tied):
    spec, tp, tr, dv, batch = tiny_objective_case("confu", 3, V, NB, NN)
    w_vd = tp["embed"]["embedding"]
    if not tied:  # the same matrix as an untied [d, V] LM head
        spec = dataclasses.replace(spec, target=spec.target.replace(tie_embeddings=False))
        tp = {**tp, "lm_head": {"kernel": jnp.asarray(w_vd).T}}
    tokens = np.asarray(batch["tokens"])
    lm = np.asarray(batch["loss_mask"]) & np.asarray(batch["attention_mask"])
    plan = L.plan_anchors(jax.random.PRNGKey(1), jnp.asarray(lm), CFG)
    f = _f(spec, tp, tr, batch, plan)
    rows = R.row_layout(batch)
    got, metrics = L.future_aux_loss(spec, tp, f, jnp.asarray(tokens), jnp.asarray(lm), rows, plan, 2, 4)
    ref, count = _reference(f, w_vd, tokens, lm, plan, 2)
    assert count > 8
    assert float(got) == pytest.approx(ref, rel=1e-5)
    assert float(metrics["future/aux_loss"]) == pytest.approx(ref, rel=1e-5)
    assert {"future/aux_ce_x2", "future/aux_ce_x3"} <= set(metrics)


def _loss_and_grads(spec, tp, tr, dv, batch, cfg):
    fn = jax.jit(jax.value_and_grad(lambda tr: L.confu_loss(spec, tr, tp, dv, batch, jax.random.PRNGKey(2), cfg),
                                    has_aux=True))
    return fn(tr)


@pytest.mark.slow
def test_aux_gradient_reaches_the_contemplate_only_and_anneals():
    """Adding w·aux leaves the draft's gradient as the paper's objective has it (aux does not read the
    draft) and moves the contemplate's (soft prompts, MoE_con); the loss grows by exactly w·aux, and by
    w/2·aux halfway through an annealing of the weight."""
    spec, tp, tr, dv, batch = tiny_objective_case("confu", 3, V, NB, NN)
    (l0, m0), g0 = _loss_and_grads(spec, tp, tr, dv, batch, CFG)
    aux_cfg = dataclasses.replace(CFG, future_aux_weight=2.0, future_aux_ahead=2)
    (l1, m1), g1 = _loss_and_grads(spec, tp, tr, dv, batch, aux_cfg)
    aux = float(m1["future/aux_loss"])
    assert aux > 0.1 and float(m1["future/aux_weight"]) == 2.0
    assert float(l1) == pytest.approx(float(l0) + 2.0 * aux, rel=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0["draft"], g1["draft"])
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(g0["confu"]),
                                                            jax.tree_util.tree_leaves(g1["confu"]))]
    assert max(moved) > 1e-3, moved
    annealed = dataclasses.replace(aux_cfg, future_aux_anneal_steps=10)
    (l2, m2), _ = _loss_and_grads(spec, tp, tr, dv, {**batch, "step": jnp.int32(5)}, annealed)
    assert float(m2["future/aux_weight"]) == pytest.approx(1.0)
    assert float(l2) == pytest.approx(float(l0) + 1.0 * aux, rel=1e-5)
    assert "future/aux_loss" not in m0  # the paper's objective computes nothing extra


@pytest.mark.slow
def test_a_run_logs_the_schedule_and_learns_to_name_the_future(tmp_path):
    """A tiny ConFu run with the loss annealed over its steps: the logged weight is the linear schedule
    at each step's optimizer step, and the held-out cross-entropy of f is lower than the same run's
    without the loss (equal seeds, data and steps)."""
    from configs.tiny import get_config
    from confu_jax.train.loop import train

    def run(name, weight):
        c = get_config("confu")
        c.train.steps, c.train.eval_every, c.train.log_every, c.train.progress_bar = 30, 30, 1, False
        c.train.checkpoint.every = 30
        c.objective.future_aux_weight, c.objective.future_aux_anneal_steps = weight, 40
        train(c, str(tmp_path / name))
        with open(tmp_path / name / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        with open(tmp_path / name / "eval.csv") as f:
            held = list(csv.DictReader(f))
        return rows, float(held[-1]["future/aux_loss"])

    rows, with_aux = run("aux", 1.0)
    for r in rows:
        assert float(r["future/aux_weight"]) == pytest.approx(1.0 - (int(r["step"]) - 1) / 40, abs=1e-6), r["step"]
    _, without = run("paper", 0.0)
    assert with_aux < without - 0.05, (with_aux, without)


@pytest.mark.slow
def test_future_input_starts_as_the_papers_head_and_gets_a_gradient():
    """A zero map (its init) gives the paper's loss exactly, yet the map's gradient is not small: the
    draft's loss reaches it through step 0's residual and queries, not through the entry's attention
    weight. A step against that gradient lowers the loss."""
    spec, tp, tr, dv, batch = tiny_objective_case("confu", 3, V, NB, NN)
    (l0, _), _ = _loss_and_grads(spec, tp, tr, dv, batch, CFG)
    spec_in = dataclasses.replace(spec, head=dataclasses.replace(spec.head, future_input=True))
    d = spec.target.d_model
    tr_in = {**tr, "draft": {**tr["draft"], "future_in": {"kernel": jnp.zeros((d, d), jnp.float32)}}}
    (l1, _), g1 = _loss_and_grads(spec_in, tp, tr_in, dv, batch, CFG)
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    grad = np.asarray(g1["draft"]["future_in"]["kernel"])
    assert grad.shape == (d, d) and np.abs(grad).max() > 1e-4
    moved = {**tr_in, "draft": {**tr_in["draft"], "future_in": {"kernel": jnp.asarray(-1e-2 * grad / np.abs(grad).max())}}}
    (l2, _), _ = _loss_and_grads(spec_in, tp, moved, dv, batch, CFG)
    assert float(l2) < float(l1)  # a step against the gradient lowers the loss: the map is trainable


@pytest.mark.slow
def test_future_taps_read_through_fc_reach_the_contemplate_path():
    """With ``future_taps`` f is the contemplate's taps [3d]: the draft reads it through its own fc (the
    future entry's hidden slot is fc(f), as every real position's is fc(h_cat)), the draft's loss
    differs from the paper head's on the same weights, its gradient reaches the soft prompts, MoE_con
    and fc through the entry, and the auxiliary loss reads the top tap through the target's final norm."""
    from confu_jax.models import draft as draft_lib
    from confu_jax.models.llama import rms_norm
    from confu_jax.models.target import future_readout

    spec, tp, tr, dv, batch = tiny_objective_case("confu", 3, V, NB, NN)
    spec_t = dataclasses.replace(spec, head=dataclasses.replace(spec.head, future_taps=True))
    cfg = dataclasses.replace(CFG, future_aux_weight=1.0, future_aux_ahead=2)
    (l0, _), _ = _loss_and_grads(spec, tp, tr, dv, batch, cfg)
    (l1, m1), g1 = _loss_and_grads(spec_t, tp, tr, dv, batch, cfg)
    assert np.isfinite(float(l1)) and abs(float(l1) - float(l0)) > 1e-4
    assert np.isfinite(float(m1["future/aux_loss"]))
    for name in ("soft_prompt_k_lphd", "soft_prompt_v_lphd"):
        assert np.abs(np.asarray(g1["confu"][name])).max() > 0, name
    assert max(np.abs(np.asarray(x)).max() for x in jax.tree_util.tree_leaves(g1["confu"]["moe_con"])) > 0
    # fc's gradient differs from the paper head's: f reaches the loss through it
    (_, _), g0 = _loss_and_grads(spec, tp, tr, dv, batch, dataclasses.replace(cfg, future_aux_weight=0.0))
    (_, _), g1n = _loss_and_grads(spec_t, tp, tr, dv, batch, dataclasses.replace(cfg, future_aux_weight=0.0))
    fc0, fc1 = (np.asarray(jax.tree_util.tree_leaves(g["draft"]["fc"])[0]) for g in (g0, g1n))
    assert np.abs(fc1 - fc0).max() > 1e-6
    # the entry's hidden slot is fc(f); the LM-head readout is the final norm of the top tap
    d = spec.target.d_model
    f = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 3 * d))
    np.testing.assert_allclose(draft_lib.future_hidden(spec_t, tr["draft"], f),
                               draft_lib.draft_features(spec_t, tr["draft"], f), rtol=1e-6)
    np.testing.assert_allclose(future_readout(spec_t, tp, f),
                               rms_norm(f[..., 2 * d:], tp["final_norm"]["scale"], spec.target.rms_eps), rtol=1e-6)
    with pytest.raises(ValueError, match="future_taps"):
        dataclasses.replace(spec.head, variant="eagle3", future_taps=True)
