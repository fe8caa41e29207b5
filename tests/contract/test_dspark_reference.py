"""DSpark against the reference no one here wrote: speculators' ``DSparkDraftModel`` (its forward over anchored
blocks, ``models/dspark/core.py`` on ``models/dflash/core.py``) and its ``dspark`` layout (``weights/dspark_format.py``).

* A random DSpark draft speculators builds (each Markov head type, with its confidence head) and saves imports
  here (``decode_head('dspark', ...)``), and our block forward (``models.dflash.draft_blocks`` read the DSpark way,
  then ``train.dspark_task.block_outputs``: the target's LM head plus the Markov bias from each slot's own token)
  gives its Markov-corrected logits and its confidence logits, slot for slot, at the same anchors.
* Our export (``save_dspark_dir``) loads back in speculators to the same logits, and re-imports here bit for bit.
* The refusals: a reduced draft vocabulary, a block read the DFlash way (``sample_from_anchor`` false).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.families import decode_head
from confu_jax.models import dspark as D
from confu_jax.models.dflash import draft_blocks
from confu_jax.models.target import real_forward
from confu_jax.train.dspark_task import block_outputs
from confu_jax.weights.dspark_format import save_dspark_dir
from tests.helpers.model_fakes import tiny_params, tiny_spec
from tests.helpers.speculators_models import (forward_at_anchors, layer_config, randomize, speculators_config,
                                              verifier_weights)

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")

ATOL = 1e-4
BLOCK = 4
MASK = 5
RANK = 6
TAPS = (1, 3, 5)


def _target():
    spec = tiny_spec("eagle3")
    tp, _ = tiny_params(spec, seed=0)
    return spec.target, tp


def _reference(cfg, tp, kind, seed=0, **over):
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer_config(cfg), draft_vocab_size=cfg.vocab_size, block_size=BLOCK,
        mask_token_id=MASK, aux_hidden_state_layer_ids=list(TAPS), markov_rank=RANK, markov_head_type=kind,
        speculators_config=speculators_config("dspark", BLOCK), **over)
    return verifier_weights(randomize(DSparkDraftModel(config), seed), cfg, tp)


def _reference_blocks(model, input_ids, h_cat, anchors, monkeypatch):
    """speculators' forward with its anchors fixed -> (Markov-corrected logits [N, bs, V], confidence logits
    [N, bs]), read where its forward hands them to its loss."""
    import speculators.models.dspark.core as core

    seen = {}

    def capture(logits, targets, confidence_logits, *a, **k):
        seen["logits"], seen["conf"] = logits.detach().float().numpy()[0], confidence_logits.detach().numpy()[0]
        return logits.sum() * 0, {}

    monkeypatch.setattr(core, "compute_metrics", capture)
    forward_at_anchors(model, input_ids, h_cat, anchors, monkeypatch)
    return seen["logits"].reshape(len(anchors), BLOCK, -1), seen["conf"].reshape(len(anchors), BLOCK)


def _ours(head, tp, tokens, h_cat, anchors):
    p = head.drafter_params.weights["dspark"]
    spec = head.spec
    h = draft_blocks(D.backbone(p), spec.draft_model, spec.target, tp, jnp.asarray(h_cat), jnp.asarray(tokens),
                     jnp.asarray([anchors]), MASK, BLOCK)
    prev = jnp.asarray(tokens)[0][jnp.asarray(anchors)[:, None] + jnp.arange(BLOCK)][None]
    logits, conf = block_outputs(spec, p, tp, h, prev)
    logit = lambda c: np.log(c) - np.log1p(-c)  # noqa: E731 (the confidence head's logit)
    return np.asarray(logits[0]), logit(np.asarray(conf[0], np.float64))


def _compare(head, tp, model, monkeypatch, seed=0):
    cfg = head.spec.target
    rng = np.random.default_rng(seed)
    n = 14
    tokens = rng.integers(0, cfg.vocab_size, (1, n)).astype(np.int32)
    h_cat = np.asarray(real_forward(head.spec, tp, jnp.asarray(tokens)).taps_btc)  # the target's own taps
    anchors = [2, 6, 9]
    ref_logits, ref_conf = _reference_blocks(model, tokens, h_cat, anchors, monkeypatch)
    ours, conf = _ours(head, tp, tokens, h_cat, anchors)
    np.testing.assert_allclose(ours, ref_logits, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(conf, ref_conf, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", D.HEAD_TYPES)
def test_speculators_dspark_imports_to_its_block_logits(tmp_path, monkeypatch, kind):
    cfg, tp = _target()
    model = _reference(cfg, tp, kind)
    model.save_pretrained(str(tmp_path))
    head = decode_head("dspark", cfg, tp, str(tmp_path))
    assert head.trained and head.spec.taps == TAPS and int(head.drafter_params.weights["dspark"]["block_size"]) == BLOCK
    assert D.head_type(head.drafter_params.weights["dspark"]) == kind and D.markov_rank(head.drafter_params.weights["dspark"]) == RANK
    _compare(head, tp, model, monkeypatch)


def test_our_export_loads_in_speculators_and_back(tmp_path, monkeypatch):
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    from confu_jax.weights import save_hf

    cfg, tp = _target()
    ref = _reference(cfg, tp, "gated", seed=3)
    ref.save_pretrained(str(tmp_path / "ref"))
    head = decode_head("dspark", cfg, tp, str(tmp_path / "ref"))
    p = head.drafter_params.weights["dspark"]
    save_hf(cfg, tp, str(tmp_path / "target"))  # the verifier speculators reads: a local directory
    out = save_dspark_dir(str(tmp_path / "ours"), {k: v for k, v in p.items() if k not in ("mask_token_id", "block_size")},
                          head.spec.draft_model, taps=head.spec.taps, mask_token_id=MASK, block_size=BLOCK,
                          verifier=str(tmp_path / "target"))
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert (c["speculators_model_type"], c["markov_head_type"], c["markov_rank"], c["sample_from_anchor"]) == (
        "dspark", "gated", RANK, True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = DSparkSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    back = DSparkDraftModel.from_pretrained(out, config=config).eval()
    verifier_weights(back, cfg, tp)
    _compare(head, tp, back, monkeypatch, seed=1)
    again = decode_head("dspark", cfg, tp, out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.drafter_params.weights, head.drafter_params.weights)


def test_unread_settings_are_refused(tmp_path):
    cfg, tp = _target()
    model = _reference(cfg, tp, "vanilla")
    model.save_pretrained(str(tmp_path))
    path = os.path.join(str(tmp_path), "config.json")
    with open(path) as f:
        good = json.load(f)
    for bad, why in (({"draft_vocab_size": cfg.vocab_size - 1}, "reduced draft vocabulary"),
                     ({"sample_from_anchor": False}, "sample_from_anchor"), ({"markov_rank": 0}, "markov_rank")):
        with open(path, "w") as f:
            json.dump({**good, **bad}, f)
        with pytest.raises(ValueError, match=why):
            decode_head("dspark", cfg, tp, str(tmp_path))
