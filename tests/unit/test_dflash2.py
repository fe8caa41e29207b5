"""DFlash2 (``models/dflash2.py``, ``decode/dflash2.py``, the convolutions in ``models/dflash.block_hidden``):

* the grouped dynamic convolution, a layer's two convolutions around a sublayer, the candidate selector's scores
  and its training candidates equal speculators' own modules (``models/dflash2/model_definitions.py``,
  ``metrics.py``) on the same weights;
* initialised (identity convolutions) the backbone is DFlash's, to the bit;
* the drafted chain is vLLM's selector walk (``_score_edges`` + ``_selector_walk_kernel`` at T = 0) transcribed:
  slot k's unary top-K rescored under the token drafted at slot k−1 (the root for slot 1);
* greedy = AR for every plan shape is the family contract's (its untrained draft's convolutions and selector moved
  by noise, so both act); T = 1 exactly lossless (chi-square against the target's exact joint) for the sampled chain
  and DDTree's best-first tree;
* one-line refusals: ``accum_logp`` plans, a source of no kind the family reads.

speculators' ``DFlash2DraftModel`` (its training forward, its saved layout) is checked against ours in
``tests/contract/test_dflash2_reference.py``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.dflash2 import load_dflash2, parse_dflash2
from confu_jax.models import dflash as DF
from confu_jax.models import dflash2 as D2
from tests.helpers.block_drafts import FirstProposal, block_case
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.loop_fixtures import make, own

MASK = 3


def setup(vocab, seed=0, n_layers=2, rank=8, top_k=4, group=16, **kw):
    spec, tp, p, rng = block_case(vocab, lambda key, dcfg, n_taps: D2.init_dflash2(
        key, dcfg, n_taps, vocab, group_size=group, rank=rank, init_std=0.3), seed, n_layers, **kw)
    for side in DF.CONV_NAMES:  # convolutions that act (their init is the identity)
        for leaf in ("base_kernel", "kernel_projection"):
            x = p["layers"][side][leaf]
            p["layers"][side][leaf] = (x + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
    for leaf in p["selector"]:  # a selector that reorders
        p["selector"][leaf] = (1.5 * rng.standard_normal(p["selector"][leaf].shape)).astype(np.float32)
    scalars = {"mask_token_id": np.int32(MASK % vocab), "top_k": np.arange(min(top_k, vocab), dtype=np.int32)}
    return spec, tp, own(spec, tp, {"dflash2": {**p, **scalars}})


# ----------------------------------------------------------------------------- the pieces, against speculators


def test_convolutions_and_selector_equal_speculators_modules():
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators")
    from speculators.models.dflash2.metrics import selector_training_candidates
    from speculators.models.dflash2.model_definitions import CandidateSelector, GroupedDynamicCausalConv

    rng = np.random.default_rng(0)
    d, k, g, bs, n_blk, v, r, top = 16, 3, 4, 5, 3, 13, 6, 4
    conv = GroupedDynamicCausalConv(d, block_size=bs, kernel_size=k, group_size=g)
    sel = CandidateSelector(vocab_size=v, hidden_size=d, rank=r, top_k=top)
    with torch.no_grad():
        for prm in list(conv.parameters()) + list(sel.parameters()):
            prm.copy_(torch.tensor(0.7 * rng.standard_normal(tuple(prm.shape)), dtype=torch.float32))
    cp = {"base_kernel": conv.base_kernel.detach().numpy(), "kernel_projection": conv.kernel_projection.weight.detach().numpy().T}
    x = rng.standard_normal((1, n_blk * bs, d)).astype(np.float32)
    inner = lambda t: np.tanh(t) * 1.3  # noqa: E731  (a sublayer between the two convolutions)
    with torch.no_grad():
        prepared, out_kernel = conv.prepare(torch.tensor(x))
        want_in = prepared.numpy()
        want_out = conv.finish(torch.tensor(inner(want_in)), out_kernel).numpy()
    d_in, d_out = DF._conv_kernels(cp, jnp.asarray(x), jnp.float32)
    got_in = DF.grouped_dynamic_conv(jnp.asarray(x), d_in, jnp.asarray(cp["base_kernel"][0]), bs)
    got_out = DF.grouped_dynamic_conv(jnp.asarray(inner(np.asarray(got_in))), d_out, jnp.asarray(cp["base_kernel"][1]), bs)
    np.testing.assert_allclose(np.asarray(got_in), want_in, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=1e-5, atol=1e-5)

    p = {"selector": {"predecessor_codebook": sel.predecessor_codebook.detach().numpy(),
                      "successor_codebook": sel.successor_codebook.detach().numpy(),
                      "hidden_projection": sel.hidden_projection.weight.detach().numpy().T}}
    h = rng.standard_normal((2, 7, d)).astype(np.float32)
    unary = rng.standard_normal((2, 7, v)).astype(np.float32)
    prev = rng.integers(0, v, (2, 7))
    target = rng.integers(0, v, (2, 7))
    with torch.no_grad():
        cand_t = torch.tensor(unary).topk(top, dim=-1).indices
        train_t, rank_t, contains_t = selector_training_candidates(cand_t, torch.tensor(target))
        want = sel.score_candidates(torch.tensor(unary), torch.tensor(h), torch.tensor(prev), train_t).numpy()
    cand, cand_unary = D2.top_candidates(jnp.asarray(unary), top)
    np.testing.assert_array_equal(np.asarray(cand), cand_t.numpy())
    train, rank, contains = D2.training_candidates(cand, jnp.asarray(target))
    np.testing.assert_array_equal(np.asarray(train), train_t.numpy())
    np.testing.assert_array_equal(np.asarray(rank), rank_t.numpy())
    np.testing.assert_array_equal(np.asarray(contains), contains_t.numpy())
    ctx = D2.selector_context(p, D2.project(p, jnp.asarray(h)), jnp.asarray(prev))
    got = D2.candidate_scores(p, jnp.take_along_axis(jnp.asarray(unary), train, -1), train, ctx)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_initialised_backbone_is_dflashs():
    spec, tp, _ = make("eagle3", 24, seed=1)
    dcfg = DF.draft_config(spec.target, 2)
    p2 = D2.init_dflash2(jax.random.PRNGKey(0), dcfg, len(spec.taps), 24, group_size=16, rank=4)
    plain = {k: v for k, v in D2.backbone(p2).items() if k != "layers"}
    plain["layers"] = {k: v for k, v in p2["layers"].items() if k not in DF.CONV_NAMES}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 5, dcfg.d_model)), jnp.float32)
    ctx = jnp.asarray(rng.standard_normal((1, 7, len(spec.taps) * dcfg.d_model)), jnp.float32)
    k, v = DF.sequence_context(plain, dcfg, ctx)
    args = (dcfg, x, jnp.arange(7, 12)[None], jnp.ones((1, 5, 5), bool), k, v, jnp.array([[7] * 5]))
    np.testing.assert_array_equal(np.asarray(DF.block_hidden(D2.backbone(p2), *args)),
                                  np.asarray(DF.block_hidden(plain, *args)))


# ----------------------------------------------------------------------------- drafting


def test_chain_is_vllms_selector_walk():
    """Slot 1 rescored under the root, slot k under slot k−1's draft: each slot's best-scored candidate."""
    spec, tp, params = setup(24, seed=2)
    p = params.drafter_params.weights["dflash2"]
    first = FirstProposal(spec, tp, params, parse_dflash2("chain:4"))
    # vLLM's walk from the pieces: context K/V, one block forward, unary top-K, edges, argmax along the walk
    h = first.block(p, D2.backbone(p), MASK, 5)
    hs = np.asarray(h)[0, 1:]
    unary = np.asarray(DF.block_logits(spec.target, tp, h))[0, 1:]
    pc, sc, wh = (np.asarray(p["selector"][n_], np.float64) for n_ in
                  ("predecessor_codebook", "successor_codebook", "hidden_projection"))
    top = 4
    prev, want = int(first.root[0]), [int(first.root[0])]
    for slot in range(4):
        cand = np.argsort(-unary[slot])[:top]
        scores = unary[slot][cand] + ((pc[prev] * (hs[slot] @ wh)) * sc[cand]).sum(-1)
        prev = int(cand[np.argmax(scores)])
        want.append(prev)
    assert first.chain == want


# The sampled chain is where this family's own q meets the acceptance rule: its q is the selector's (softmax over its K scores, -inf elsewhere). A DDTree tree
# drafts with a point-mass q whatever the drafter's probabilities, so its sampled rule is DFlash's, checked by
# tests/unit/test_dflash.py::test_sampling_lossless_joint[ddtree:4,2] (this family's tree shapes: greedy = AR in
# tests/contract/test_family_contract.py).
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=5, n_layers=1, top_k=3, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    assert_sampling_is_lossless(spec, tp, params, parse_dflash2(plan))


def test_bad_plans_and_sources_are_one_line():
    with pytest.raises(ValueError, match="accum_logp offers every parent the same top-W"):
        parse_dflash2("accum_logp:8,4,3")
    spec, tp, _ = setup(6)
    with pytest.raises(ValueError, match="neither a DFlash2 launch.train workdir .* nor a speculators DFlash2 directory"):
        load_dflash2(spec.target, tp, "/some/dir")
