"""Domino (``models/domino.py``, ``decode/domino.py``, ``weights/domino_format.py``, ``train/domino_task.py``):

* the GRU correction equals torch's own modules — ``nn.GRU(d, H, bias=False)`` over the block's token embeddings,
  ``Sequential(Linear, SiLU, Linear)`` over [h_k ; s_k] — composed as SpecForge's ``apply_logits_head`` does with
  ``shift_label`` (slots below ``pure_draft_prefix_len`` keep their base logits), the weights loaded into the torch
  modules under the names our export writes (SpecForge's ``prefix_gru.*`` / ``embed_proj.*``);
* the drafted chain is SpecForge's ``_sample_draft_tokens`` (temperature 0) transcribed: slot k drafts the token
  after the ones before it, its GRU state having read the root and every earlier draft;
* T = 1 exactly lossless (chi-square against the target's exact joint) for the sampled chain and DDTree's tree;
  greedy = AR for every plan shape is the family contract's;
* the export re-imports bit for bit; refusals in one line (``shift_label`` false, a Domino directory offered to
  ``--method dflash``, ``accum_logp``); λ_base is SpecForge's ``linear_lambda_base``.

No framework with a Domino module is installable here (SpecForge is not on PyPI): torch's GRU and Linear are the
reference for the pieces, SpecForge's composition is transcribed (its file and commit in ``models/domino.py``).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.dflash import load_dflash
from confu_jax.decode.domino import parse_domino
from confu_jax.models import dflash as DF
from confu_jax.models import domino as M
from confu_jax.train.domino_task import lambda_base
from confu_jax.weights.domino_format import load_domino_dir, save_domino_dir
from tests.helpers.block_drafts import FirstProposal, block_case
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.loop_fixtures import own

MASK = 3


def setup(vocab, seed=0, n_layers=2, hh=12, emb=8, prefix=1, **kw):
    spec, tp, p, rng = block_case(vocab, lambda key, dcfg, n_taps: M.init_domino(
        key, dcfg, n_taps, vocab, gru_hidden_dim=hh, emb_dim=emb, init_std=0.3), seed, n_layers, **kw)
    for g in M.EXTRA:  # a head that acts
        for leaf in p[g]:
            p[g][leaf] = (1.2 * rng.standard_normal(p[g][leaf].shape)).astype(np.float32)
    scalars = {"mask_token_id": np.int32(MASK % vocab), "prefix_len": np.int32(prefix)}
    return spec, tp, own(spec, tp, {"domino": {**p, **scalars}})


def _torch_head(p):
    """torch's GRU and projection holding ``p``, loaded by the names our export writes."""
    torch = pytest.importorskip("torch")
    from confu_jax.weights.domino_format import _HEAD

    d, hh = np.shape(p["gru"]["w_ih"])[0], M.gru_width(p)
    emb, v = np.shape(p["embed_proj"]["w2"])
    gru = torch.nn.GRU(d, hh, num_layers=1, batch_first=True, bias=False)
    proj = torch.nn.Sequential(torch.nn.Linear(d + hh, emb, bias=False), torch.nn.SiLU(),
                               torch.nn.Linear(emb, v, bias=False))
    named = {name: torch.tensor(np.ascontiguousarray(np.asarray(p[g][leaf]).T)) for name, (g, leaf) in _HEAD.items()}
    gru.load_state_dict({k[len("prefix_gru."):]: x for k, x in named.items() if k.startswith("prefix_gru.")})
    proj.load_state_dict({k[len("embed_proj."):]: x for k, x in named.items() if k.startswith("embed_proj.")})
    return gru, proj


def test_gru_correction_equals_torchs_modules_composed_as_specforge():
    torch = pytest.importorskip("torch")
    spec, tp, params = setup(20, seed=1)
    p = params.drafter_params.weights["domino"]
    rng = np.random.default_rng(0)
    n_blk, bs, d = 3, 5, spec.target.d_model
    base = rng.standard_normal((1, n_blk, bs, 20)).astype(np.float32)
    hidden = rng.standard_normal((1, n_blk, bs, d)).astype(np.float32)
    emb = rng.standard_normal((1, n_blk, bs, d)).astype(np.float32)
    gru, proj = _torch_head(p)
    with torch.no_grad():  # SpecForge's apply_logits_head, shift_label true, suffix_start = prefix_len = 1
        gru_out = gru(torch.tensor(emb).reshape(n_blk, bs, d))[0].reshape(1, n_blk, bs, -1)
        corr = proj(torch.cat([torch.tensor(hidden)[:, :, 1:], gru_out[:, :, 1:]], -1))
        want = torch.cat([torch.tensor(base)[:, :, :1], torch.tensor(base)[:, :, 1:] + corr], 2).numpy()
    got = M.block_logits(p, jnp.asarray(base), jnp.asarray(hidden), jnp.asarray(emb), 1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_chain_is_specforges_sample_draft_tokens():
    torch = pytest.importorskip("torch")
    spec, tp, params = setup(24, seed=2)
    p = params.drafter_params.weights["domino"]
    first = FirstProposal(spec, tp, params, parse_domino("chain:4"))
    # SpecForge's loop from the pieces: one block forward (bs = 5 slots), then token by token the GRU over the
    # block's completed ids and slot (position - 1)'s corrected logits
    h = first.block(p, M.backbone(p), MASK, 5)
    base = torch.tensor(np.asarray(DF.block_logits(spec.target, tp, h))[0])
    hs = torch.tensor(np.asarray(h)[0])
    table = torch.tensor(np.asarray(tp["embed"]["embedding"], np.float32))
    gru, proj = _torch_head(p)
    completed = [int(first.root[0]), MASK, MASK, MASK, MASK]
    with torch.no_grad():
        for position in range(1, 5):
            states = gru(table[torch.tensor(completed)][None])[0][0]
            slot = position - 1
            logits = base[slot] + (proj(torch.cat([hs[slot], states[slot]])) if slot >= 1 else 0)
            completed[position] = int(torch.argmax(logits))
    assert first.chain == completed


def test_export_reimports_bit_for_bit_and_refusals_are_one_line(tmp_path):
    spec, tp, params = setup(24, seed=3)
    p = {k: v for k, v in params.drafter_params.weights["domino"].items() if k not in M.SCALARS}
    out = str(tmp_path / "domino")
    save_domino_dir(out, p, spec.draft_model, taps=spec.taps, mask_token_id=MASK, block_size=6,
                    num_target_layers=spec.target.n_layers, prefix_len=1)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["DominoDraftModel"] and c["dflash_config"]["projector_type"] == "domino"
    imp = load_domino_dir(out)
    assert (imp.block_size, imp.mask_token_id, imp.prefix_len, imp.taps) == (6, MASK, 1, tuple(spec.taps))
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, p)
    with pytest.raises(ValueError, match="projector_type is 'domino'.*--method domino"):
        load_dflash(spec.target, tp, out)
    c["dflash_config"]["shift_label"] = False
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match="shift_label"):
        load_domino_dir(out)
    with pytest.raises(ValueError, match="accum_logp offers every parent the same top-W"):
        parse_domino("accum_logp:8,4,3")


def test_lambda_base_is_specforges_linear_decay():
    def reference(global_step, total_steps, lambda_start=1.0, decay_ratio=0.5):  # training/strategies/base.py
        decay_steps = max(1, int(total_steps * decay_ratio))
        progress = min(global_step / decay_steps, 1.0)
        return max(0.0, min(1.0, lambda_start * (1.0 - progress)))

    for step, total, start, ratio in ((0, 100, 1.0, 0.5), (25, 100, 1.0, 0.5), (60, 100, 1.0, 0.5),
                                      (7, 10, 0.8, 1.0), (3, 1, 1.0, 0.5)):
        assert float(lambda_base(step, total, start, ratio)) == pytest.approx(reference(step, total, start, ratio))


# The sampled chain is where this family's own q meets the acceptance rule: its q is the GRU-corrected one. A DDTree tree
# drafts with a point-mass q whatever the drafter's probabilities, so its sampled rule is DFlash's, checked by
# tests/unit/test_dflash.py::test_sampling_lossless_joint[ddtree:4,2] (this family's tree shapes: greedy = AR in
# tests/contract/test_family_contract.py).
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=5, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    assert_sampling_is_lossless(spec, tp, params, parse_domino(plan))
