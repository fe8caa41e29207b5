"""DFlash2 against the reference no one here wrote: speculators' ``DFlash2DraftModel`` (its training forward over
anchored blocks, ``models/dflash2/core.py`` on ``models/dflash/core.py``) and its ``dflash2`` layout
(``weights/dflash2_format.py``).

* A random DFlash2 draft speculators builds and saves imports here (``decode_head('dflash2', ...)``), and our block
  forward (``models.dflash.draft_blocks`` with the convolutions, the target's LM head) gives its unary logits, and
  our selector (``models.dflash2``) its candidate scores for the same candidates and predecessors, slot for slot,
  at the same anchors.
* Our export (``save_dflash2_dir``) loads back in speculators to the same logits, and re-imports here bit for bit.
* The refusals: a reduced draft vocabulary, a block read the DSpark way (``sample_from_anchor`` true), sliding-window
  draft layers.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.families import decode_head
from confu_jax.models import dflash2 as D2
from confu_jax.models.dflash import block_logits, draft_blocks
from confu_jax.models.target import real_forward
from confu_jax.weights.dflash2_format import save_dflash2_dir
from tests.helpers.model_fakes import tiny_params, tiny_spec
from tests.helpers.speculators_models import (forward_at_anchors, layer_config, randomize, speculators_config,
                                              verifier_weights)

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")

ATOL = 1e-4
BLOCK = 4
MASK = 5
RANK = 6
TOP_K = 5
TAPS = (1, 3, 5)


def _target():
    spec = tiny_spec("eagle3")
    tp, _ = tiny_params(spec, seed=0)
    return spec.target, tp


def _reference(cfg, tp, seed=0):
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config(cfg), draft_vocab_size=cfg.vocab_size, block_size=BLOCK,
        mask_token_id=MASK, aux_hidden_state_layer_ids=list(TAPS), conv_kernel_size=2, conv_group_size=8,
        selector_rank=RANK, selector_top_k=TOP_K, speculators_config=speculators_config("dflash2", BLOCK - 1))
    return verifier_weights(randomize(DFlash2DraftModel(config), seed), cfg, tp)


def _reference_blocks(model, input_ids, h_cat, anchors, monkeypatch):
    """speculators' forward with its anchors fixed -> (unary logits [N, bs, V], candidate ids and scores
    [N, bs, K]), read where its forward hands them to its loss."""
    import speculators.models.dflash2.core as core

    seen = {}

    def capture(*, unary_logits, training_candidate_ids, candidate_logits, **k):
        seen["unary"] = unary_logits.detach().float().numpy()[0]
        seen["cand"] = training_candidate_ids.numpy()[0]
        seen["scores"] = candidate_logits.detach().float().numpy()[0]
        return unary_logits.sum() * 0, {}

    monkeypatch.setattr(core, "compute_metrics", capture)
    forward_at_anchors(model, input_ids, h_cat, anchors, monkeypatch)
    shape = (len(anchors), BLOCK)
    return (seen["unary"].reshape(shape + (-1,)), seen["cand"].reshape(shape + (-1,)),
            seen["scores"].reshape(shape + (-1,)))


def _ours(head, tp, tokens, h_cat, anchors, cand):
    p = head.drafter_params.weights["dflash2"]
    spec = head.spec
    h = draft_blocks(D2.backbone(p), spec.draft_model, spec.target, tp, jnp.asarray(h_cat), jnp.asarray(tokens),
                     jnp.asarray([anchors]), MASK, BLOCK)[0]  # [N,bs,d]
    unary = block_logits(spec.target, tp, h)
    prev = jnp.asarray(tokens)[0][jnp.asarray(anchors)[:, None] + jnp.arange(BLOCK) - 1]  # slot k: x[a+k-1]
    cand = jnp.asarray(cand)
    ctx = D2.selector_context(p, D2.project(p, h), prev)
    return np.asarray(unary), np.asarray(D2.candidate_scores(p, jnp.take_along_axis(unary, cand, -1), cand, ctx))


def _compare(head, tp, model, monkeypatch, seed=0):
    cfg = head.spec.target
    rng = np.random.default_rng(seed)
    n = 14
    tokens = rng.integers(0, cfg.vocab_size, (1, n)).astype(np.int32)
    h_cat = np.asarray(real_forward(head.spec, tp, jnp.asarray(tokens)).taps_btc)  # the target's own taps
    anchors = [2, 6, 9]
    ref_unary, ref_cand, ref_scores = _reference_blocks(model, tokens, h_cat, anchors, monkeypatch)
    unary, scores = _ours(head, tp, tokens, h_cat, anchors, ref_cand)
    np.testing.assert_allclose(unary, ref_unary, atol=ATOL, rtol=1e-4)
    # slot 0 (the anchor) drafts nothing: its predecessor differs by convention and it carries no loss
    np.testing.assert_allclose(scores[:, 1:], ref_scores[:, 1:], atol=ATOL, rtol=1e-4)
    cand, _ = D2.top_candidates(jnp.asarray(unary), TOP_K)
    unchanged = ref_cand[..., :-1]  # the last rank may hold the injected target
    np.testing.assert_array_equal(np.asarray(cand)[..., :-1], unchanged)


def test_speculators_dflash2_imports_to_its_block_logits(tmp_path, monkeypatch):
    cfg, tp = _target()
    model = _reference(cfg, tp)
    model.save_pretrained(str(tmp_path))
    head = decode_head("dflash2", cfg, tp, str(tmp_path))
    p = head.drafter_params.weights["dflash2"]
    assert head.trained and head.spec.taps == TAPS and int(p["block_size"]) == BLOCK
    assert D2.top_k(p) == TOP_K and D2.selector_rank(p) == RANK and D2.conv(p) == (2, 8)
    _compare(head, tp, model, monkeypatch)


def test_our_export_loads_in_speculators_and_back(tmp_path, monkeypatch):
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    from confu_jax.weights import save_hf

    cfg, tp = _target()
    ref = _reference(cfg, tp, seed=3)
    ref.save_pretrained(str(tmp_path / "ref"))
    head = decode_head("dflash2", cfg, tp, str(tmp_path / "ref"))
    p = head.drafter_params.weights["dflash2"]
    save_hf(cfg, tp, str(tmp_path / "target"))  # the verifier speculators reads: a local directory
    out = save_dflash2_dir(str(tmp_path / "ours"), D2.backbone(p) | {"selector": p["selector"]},
                           head.spec.draft_model, taps=head.spec.taps, mask_token_id=MASK, block_size=BLOCK,
                           top_k=TOP_K, verifier=str(tmp_path / "target"))
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert (c["speculators_model_type"], c["selector_top_k"], c["selector_rank"], c["conv_group_size"],
            c["sample_from_anchor"]) == ("dflash2", TOP_K, RANK, 8, False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = DFlash2SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    back = DFlash2DraftModel.from_pretrained(out, config=config).eval()
    verifier_weights(back, cfg, tp)
    _compare(head, tp, back, monkeypatch, seed=1)
    again = decode_head("dflash2", cfg, tp, out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.drafter_params.weights, head.drafter_params.weights)


def test_unread_settings_are_refused(tmp_path):
    cfg, tp = _target()
    _reference(cfg, tp).save_pretrained(str(tmp_path))
    path = os.path.join(str(tmp_path), "config.json")
    with open(path) as f:
        good = json.load(f)
    sliding = {**good["transformer_layer_config"], "layer_types": ["sliding_attention", "full_attention"]}
    for bad, why in (({"draft_vocab_size": cfg.vocab_size - 1}, "reduced draft vocabulary"),
                     ({"sample_from_anchor": True}, "sample_from_anchor"),
                     ({"transformer_layer_config": sliding}, "sliding-window"),
                     ({"conv_group_size": 7}, "conv_group_size")):
        with open(path, "w") as f:
            json.dump({**good, **bad}, f)
        with pytest.raises(ValueError, match=why):
            decode_head("dflash2", cfg, tp, str(tmp_path))
