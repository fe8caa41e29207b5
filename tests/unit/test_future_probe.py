"""What ConFu's future entry is worth to its draft (``no_future/...``) and what its f predicts by
itself (``future/f_top1_x{s}``), reported by held-out evaluation; and evaluating a head without
training (``loop.evaluate_only``, ``launch.train --eval_only``).

References: the same draft weights under the EAGLE-3 objective (which has no future entry) for the
``no_future`` metrics; the contemplate pass and the target's LM head in float64 numpy, anchor by
anchor, for the f probe; training's own eval.csv at the same checkpoint for ``evaluate_only``.
"""

import csv
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.kv_cache import to_cache_layout
from confu_jax.models.target import contemplate_queries, real_forward
from confu_jax.train import loss as L
from tests.helpers.model_fakes import tiny_objective_case

V, NB, NN, STEPS = 6, 2, 24, 3  # a tiny vocabulary: top-1 hits are common, not vacuous
CFG = L.ObjectiveConfig(ttt_steps=STEPS, k_train=L.ALL_POSITIONS, replication=0, max_lag=2, vocab_chunk=4,
                        future_probe=True)


def _setup(variant, seed=3):
    return tiny_objective_case(variant, seed, V, NB, NN)


def _metrics(spec, tp, tr, dv, batch, cfg=CFG, key=0):
    _, m = jax.jit(lambda tr, batch: L.confu_loss(spec, tr, tp, dv, batch, jax.random.PRNGKey(key), cfg))(tr, batch)
    return {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.mark.slow
def test_no_future_metrics_equal_the_eagle3_objective_on_the_same_draft_weights():
    spec, tp, tr, dv, batch = _setup("confu")
    confu = _metrics(spec, tp, tr, dv, batch)
    e3_spec = dataclasses.replace(spec, head=dataclasses.replace(spec.head, variant="eagle3"))
    assert not e3_spec.head.has_future
    eagle3 = _metrics(e3_spec, tp, {"draft": tr["draft"]}, dv, batch)
    keys = [f"cond_acc/step{r}" for r in range(STEPS)] + [f"decode_tau/chain{d}" for d in range(1, STEPS + 1)]
    for k in keys:
        assert confu[f"no_future/{k}"] == pytest.approx(eagle3[k], abs=1e-6), k
    # a random head with a future entry drafts differently with it than without (not a vacuous case)
    assert any(abs(confu[k] - confu[f"no_future/{k}"]) > 1e-3 for k in keys)
    weights = [confu[f"future/attn_weight/step{r}"] for r in range(STEPS)]
    assert all(0.01 < w < 0.99 for w in weights), weights  # the entry is one key of several
    assert not any(k.startswith(("no_future/", "future/")) for k in eagle3)


def _metrics_with_future_bias(spec, tp, tr, dv, batch, value):
    """The same head with a future-entry bias (``HeadConfig.future_bias``) of ``value`` on every query head."""
    spec = dataclasses.replace(spec, head=dataclasses.replace(spec.head, future_bias=float(value)))
    bias = jnp.full((spec.target.n_heads,), value, jnp.float32)
    return _metrics(spec, tp, {**tr, "draft": {**tr["draft"], "future_bias": bias}}, dv, batch)


@pytest.mark.slow
def test_future_attention_weight_and_the_future_bias():
    """``future/attn_weight/step{r}`` is the share of attention the draft gives its future entry: a
    future-entry bias of -60 drives it to 0 and the head then drafts exactly as without the entry
    (its no_future metrics, which differ from the plain head's: see the test above); +60 drives it to 1."""
    spec, tp, tr, dv, batch = _setup("confu")
    starved = _metrics_with_future_bias(spec, tp, tr, dv, batch, -60.0)
    keys = [f"cond_acc/step{r}" for r in range(STEPS)] + [f"decode_tau/chain{d}" for d in range(1, STEPS + 1)]
    assert all(starved[f"future/attn_weight/step{r}"] < 1e-6 for r in range(STEPS))
    for k in keys:
        assert starved[k] == pytest.approx(starved[f"no_future/{k}"], abs=1e-6), k
    flooded = _metrics_with_future_bias(spec, tp, tr, dv, batch, 60.0)
    assert all(flooded[f"future/attn_weight/step{r}"] > 1 - 1e-6 for r in range(STEPS))


def _f_probe_reference(spec, tp, tr, batch, key):
    """f of every anchor from the contemplate pass, read by the target's LM head in float64, compared
    with x[t+s] where x[t+s] is an answer token: one anchor at a time."""
    tokens, lm = np.asarray(batch["tokens"]), np.asarray(batch["loss_mask"]) & np.asarray(batch["attention_mask"])
    plan = L.plan_anchors(jax.random.PRNGKey(key), jnp.asarray(lm), CFG)
    out = real_forward(spec, tp, batch["tokens"])
    b_idx = jnp.arange(NB)[:, None]
    f = contemplate_queries(spec, tp, tr["confu"], to_cache_layout(out.k_new_lbthd), to_cache_layout(out.v_new_lbthd),
                            plan.anchor_bk, out.taps_btc[b_idx, plan.con_src_bk])
    logits = np.asarray(f, np.float64) @ np.asarray(tp["embed"]["embedding"], np.float64).T  # tied LM head
    top1 = logits.argmax(-1)
    anchor, valid = np.asarray(plan.anchor_bk), np.asarray(plan.valid_bk)
    shares = {}
    for s in L.FUTURE_PROBE_AHEAD:
        hits = [top1[row, k] == tokens[row, anchor[row, k] + s] for row in range(NB) for k in range(anchor.shape[1])
                if valid[row, k] and anchor[row, k] + s < NN and lm[row, anchor[row, k] + s]]
        shares[s] = (float(np.mean(hits)) if hits else 0.0, len(hits))
    return shares


@pytest.mark.slow
@pytest.mark.parametrize("key", [1])  # key 0: the other tests' anchors
def test_f_probe_is_the_targets_lm_head_on_each_contemplate(key):
    spec, tp, tr, dv, batch = _setup("confu")
    assert spec.target.tie_embeddings
    got = _metrics(spec, tp, tr, dv, batch, key=key)
    ref = _f_probe_reference(spec, tp, tr, batch, key)
    for s, (share, count) in ref.items():
        assert count > 5 and got[f"future/f_top1_x{s}"] == pytest.approx(share, abs=1e-6), s
    assert 0 < max(share for share, _ in ref.values()) < 1  # not vacuous


def test_training_form_and_eagle3_skip_the_probe():
    spec, tp, tr, dv, batch = _setup("confu")
    train_cfg = dataclasses.replace(CFG, k_train=4, replication=1, future_probe=False)
    assert not any(k.startswith(("no_future/", "future/")) for k in _metrics(spec, tp, tr, dv, batch, train_cfg))
    from configs.smollm2_confu import get_config

    c = get_config()
    assert L.objective_from_config(c, evaluation=True).future_probe
    assert not L.objective_from_config(c).future_probe


# ----------------------------------------------------------------------------- evaluate_only


def _tiny_config(**over):
    from configs.tiny import get_config

    c = get_config("confu")
    c.train.steps, c.train.eval_every, c.train.checkpoint.every, c.train.progress_bar = 3, 3, 3, False
    c.draft.ttt_steps = 3
    for k, v in over.items():
        node, *path = k.split(".")
        target = c[node]
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = v
    return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from confu_jax.train.loop import train

    workdir = str(tmp_path_factory.mktemp("confu_tiny"))
    result = train(_tiny_config(), workdir)
    assert result.step == 3 and result.last_eval
    return workdir, result.last_eval


def _eval_csv_last(workdir):
    with open(os.path.join(workdir, "eval.csv")) as f:
        return {k: float(v) for k, v in list(csv.DictReader(f))[-1].items() if v != ""}


@pytest.mark.slow
def test_evaluate_only_equals_trainings_last_evaluation(trained, tmp_path):
    from confu_jax.train.loop import EVAL_ONLY_FILE, evaluate_only

    workdir, last_eval = trained
    assert "no_future/decode_tau/chain3" in last_eval and "future/f_top1_x2" in last_eval
    on_disk = _eval_csv_last(workdir)
    # the trained workdir itself (its latest checkpoint) ...
    again = evaluate_only(_tiny_config(), workdir)
    assert again["step"] == 3 and os.path.exists(os.path.join(workdir, EVAL_ONLY_FILE))
    # ... and a fresh workdir that starts from it (what a release or an export goes through)
    source = os.path.join(workdir, "checkpoints")
    fresh = evaluate_only(_tiny_config(**{"train.checkpoint.init_from": source}), str(tmp_path / "fresh"))
    assert fresh["step"] == 0 and fresh["source"] == source
    for k, v in last_eval.items():
        assert again["eval"][k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
        assert fresh["eval"][k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
        assert on_disk[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k


def test_evaluate_only_needs_a_head(tmp_path):
    from confu_jax.train.loop import evaluate_only

    with pytest.raises(ValueError, match="no checkpoint and train.checkpoint.init_from is empty"):
        evaluate_only(_tiny_config(), str(tmp_path / "empty"))
