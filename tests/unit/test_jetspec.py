"""JetSpec (``decode.jetspec``; DFlash's network with ``causal_head``: ``models.dflash.block_self_mask``,
``train.dflash_task.apply_jetspec_defaults``, ``weights.dflash_format``'s flag; its tree
``decode.tree.draft_fanout_tree``).

Checked against its reference (hao-ai-lab/JetSpec @2c7b3fa): (1) the causal head's forward — decode form
and training blocks — equals DFlash's reference module (tests/helpers/dflash_reference.py) under the mask
JetSpec's ``_build_dflash_causal_attention_mask`` builds (key j visible iff j <= the query's index in
[context ; block]); a block position's output does not move when a later block token changes; (2) the
loop's first tree is JetSpec's ``accum_logp`` over that block's per-depth log-probabilities (its heap,
tests/helpers/jetspec_reference.py); (3) sampling at T = 1 is the target's exact joint (chi-square); (4)
the published layout carries ``dflash_config.causal_head``, round-trips and decodes as in memory, and
DFlash and JetSpec refuse each other's heads. Greedy = AR for every plan shape and the training
kill-and-resume / export contract: tests/contract (the catalog entry ``jetspec``); sharded = one device is
DFlash's code path there (JetSpec's own sharded run, before SD²'s in one process, crashed jaxlib 0.10.2's
compilation-cache write: tests/contract/test_family_contract.py).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.families import parse_drafter
from confu_jax.models import dflash as D
from tests.helpers.dflash_reference import MASK, first_block, setup, torch_reference
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import generated_rows

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]
block_hidden, block_logits, draft_blocks, embed_block, sequence_context = (
    jit_static(f) for f in (D.block_hidden, D.block_logits, D.draft_blocks, D.embed_block, D.sequence_context))


def jetspec_mask(b: int, ctx_len: int, q_len: int, cached_kv_len: int = 0) -> np.ndarray:
    """JetSpec's ``_build_dflash_causal_attention_mask`` (jetspec/models/draft_head.py @2c7b3fa) as a bool
    [B, Q, C+Q]: keys [context ; block], query i at index cached + ctx_len + i sees key j iff j <= it."""
    key_positions = np.arange(cached_kv_len + ctx_len + q_len)
    query_positions = cached_kv_len + ctx_len + np.arange(q_len)
    return np.broadcast_to(key_positions[None] <= query_positions[:, None], (b, q_len, key_positions.size)).copy()


def test_causal_forward_equals_the_reference_under_jetspecs_mask():
    import torch

    spec, tp, params = setup(24, key="jetspec")
    dcfg, p = spec.draft_model, D.model_params(params.drafter_params.weights["jetspec"])
    n_taps = len(spec.taps)
    ref = torch_reference(dcfg, n_taps, D.to_reference_state_dict(p))
    rng = np.random.default_rng(5)
    b, s, bs = 2, 7, 4
    taps = (2 * rng.standard_normal((b, s, n_taps * dcfg.d_model))).astype(np.float32)
    noise = rng.standard_normal((b, bs, dcfg.d_model)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s + bs) + 3, (b, s + bs)).copy()
    with torch.no_grad():
        want = ref(torch.from_numpy(pos), torch.from_numpy(noise).double(), torch.from_numpy(taps).double(),
                   torch.from_numpy(jetspec_mask(b, s, bs))).numpy()
        bidir = ref(torch.from_numpy(pos), torch.from_numpy(noise).double(), torch.from_numpy(taps).double(),
                    torch.ones(b, bs, s + bs, dtype=torch.bool)).numpy()
    assert np.abs(want[:, :-1] - bidir[:, :-1]).max() > 1e-3  # the mask matters (the last position sees all)
    k, v = sequence_context(p, dcfg, jnp.asarray(taps), jnp.asarray(pos[:, :s]))
    got = block_hidden(p, dcfg, jnp.asarray(noise), jnp.asarray(pos[:, s:]), D.block_self_mask(b, bs, True), k, v,
                       jnp.full((b,), s))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    # causality: a later block token moves nothing before it
    noise2 = noise.copy()
    noise2[:, 2] += 1.0
    got2 = block_hidden(p, dcfg, jnp.asarray(noise2), jnp.asarray(pos[:, s:]), D.block_self_mask(b, bs, True), k, v,
                        jnp.full((b,), s))
    np.testing.assert_allclose(np.asarray(got2)[:, :2], np.asarray(got)[:, :2], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got2)[:, 2:] - np.asarray(got)[:, 2:]).max() > 1e-4
    # training blocks: each sees the context before its anchor and its own block causally
    tokens = rng.integers(0, 24, (b, s))
    anchors = np.array([[2, 5], [1, 4]])
    h = draft_blocks(p, dcfg, spec.target, tp, jnp.asarray(taps), jnp.asarray(tokens), jnp.asarray(anchors), MASK,
                     bs, None, None, True)
    emb = np.asarray(tp["embed"]["embedding"])
    for r in range(b):
        for i, a in enumerate(anchors[r]):
            blk = np.r_[tokens[r, a], np.full(bs - 1, MASK)]
            mask = jetspec_mask(1, s, bs)
            mask[:, :, a:s] = False  # context slots at or past the anchor: not yet committed
            with torch.no_grad():
                w = ref(torch.from_numpy(np.r_[np.arange(s), a + np.arange(bs)][None]),
                        torch.from_numpy(emb[blk][None]).double(), torch.from_numpy(taps[r:r + 1]).double(),
                        torch.from_numpy(mask)).numpy()
            np.testing.assert_allclose(np.asarray(h[r, i]), w[0], rtol=2e-4, atol=2e-4)


def test_the_first_tree_is_accum_logp_over_the_causal_block():
    """The loop's first proposal under ``accum_logp:9,3,3`` (budget 10 in the reference's terms): its heap over the per-depth
    log-probabilities of one causal block forward [root, M, M, M] (what its DraftHeadTreeDrafter hands
    its tree algorithm)."""
    from tests.helpers import jetspec_reference as ref

    spec, tp, params = setup(24, seed=1, key="jetspec")
    drafter = parse_drafter("jetspec", "accum_logp:9,3,3")
    prop, root, logits = first_block(spec, tp, params, drafter, [3, 9, 4, 17, 3, 9], key="jetspec", causal=True)
    toks_w, lps = ref.per_depth_topk(logits, 3)
    # the plan's N counts drafted nodes (as ddtree: / dynamic:); the reference's budget counts the root too
    want_tok, want_par, _, _ = ref.build_from_topk(root, toks_w, lps, 9 + 1)
    tree = prop.tree
    assert np.asarray(tree.valid_bt)[0].all()
    assert np.asarray(tree.tokens_bt)[0].tolist() == want_tok and np.asarray(tree.parents_bt)[0].tolist() == want_par


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["accum_logp:4,2,2"])  # sampled chains: DFlash's test, the same code path
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=3, n_layers=1, key="jetspec", d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    assert_sampling_is_lossless(spec, tp, params, parse_drafter("jetspec", plan))


@pytest.mark.slow
def test_published_layout_round_trip_and_the_two_families_refuse_each_other(tmp_path):
    from confu_jax.decode.families import decode_head
    from confu_jax.weights.dflash_format import load_dflash_dir, save_dflash_dir

    spec, tp, params = setup(6, key="jetspec")
    dcfg, p = spec.draft_model, D.model_params(params.drafter_params.weights["jetspec"])
    d, bi = str(tmp_path / "jetspec"), str(tmp_path / "dflash")
    save_dflash_dir(d, p, dcfg, taps=spec.taps, mask_token_id=MASK, block_size=4,
                    num_target_layers=spec.target.n_layers, causal_head=True)
    save_dflash_dir(bi, p, dcfg, taps=spec.taps, mask_token_id=MASK, block_size=4,
                    num_target_layers=spec.target.n_layers)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["DFlashDraftModel"] and c["dflash_config"]["causal_head"] is True
    with open(os.path.join(bi, "config.json")) as f:
        assert "causal_head" not in json.load(f)["dflash_config"]  # DFlash's layout unchanged
    imp = load_dflash_dir(d)
    assert imp.causal_head and not load_dflash_dir(bi).causal_head
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, p)
    head = decode_head("jetspec", spec.target, tp, d)
    assert head.trained and "JetSpec format" in head.source
    drafter = parse_drafter("jetspec", "accum_logp:6,2,3")
    a = loop.generate_speculative(head.target, drafter, head.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    with pytest.raises(ValueError, match="is a DFlash \\(bidirectional\\) draft; decode it with --method dflash"):
        decode_head("jetspec", spec.target, tp, bi)
    with pytest.raises(ValueError, match="is a JetSpec \\(causal_head\\) draft; decode it with --method jetspec"):
        decode_head("dflash", spec.target, tp, d)
    # the same weights drafted bidirectionally draft otherwise: the flag is not decoration
    dflash = decode_head("dflash", spec.target, tp, bi)
    c1 = loop.generate_speculative(dflash.target, parse_drafter("dflash", "accum_logp:6,2,3"), dflash.drafter_params,
                                   PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(c1, 2) == generated_rows(a, 2)  # both lossless
