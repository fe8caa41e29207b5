"""DSpark (``models/dspark.py``, ``decode/dspark.py``):

* the Markov heads (vanilla, gated, rnn) and the confidence head equal speculators' own modules
  (``models/dspark/model_definitions.py`` ``MarkovHead.block_bias`` / ``ConfidenceHead``) on the same weights;
* the drafted chain is vLLM's sequential sampling (``_sample_sequential``) transcribed: slot k's base logits
  plus the bias from the token drafted at slot k-1, the anchor slot drafting the first token;
* greedy = AR for the gated and rnn heads under every plan shape (the vanilla head's is the family contract's), and with a
  confidence-scheduled length ``chain:K@P``, whose rows verify exactly the leading drafts whose survival
  (the running product of the confidences) is >= P;
* T = 1 stays exactly lossless (chi-square against the target's exact joint) for sampled chains and DDTree's
  best-first trees (each node's children from its own Markov-biased distribution);
* one-line refusals: @P on a tree, @P without a confidence head, a source of no kind the family reads.

speculators' own ``DSparkDraftModel`` (its training forward, its saved layout) is checked against ours in
``tests/contract/test_dspark_reference.py``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.dflash import context_entries
from confu_jax.decode.drafter import DraftInput, PrefillView
from confu_jax.decode.dspark import DSparkDrafter, load_dspark, parse_dspark
from confu_jax.decode.generate import generate_ar
from confu_jax.models import dflash as DF
from confu_jax.models import dspark as D
from tests.helpers.block_drafts import FirstProposal, block_case
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.loop_fixtures import generated_rows, prompts_for, own

MASK = 3


def setup(vocab, kind="vanilla", seed=0, n_layers=2, rank=8, confidence=True, with_markov=True, **kw):
    spec, tp, p, rng = block_case(vocab, lambda key, dcfg, n_taps: D.init_dspark(
        key, dcfg, n_taps, vocab, rank=rank, kind=kind, confidence=confidence, confidence_with_markov=with_markov,
        init_std=0.3), seed, n_layers, **kw)
    p["markov"]["w1"] = (0.5 * rng.standard_normal(p["markov"]["w1"].shape)).astype(np.float32)  # a bias that acts
    return spec, tp, own(spec, tp, {"dspark": {**p, "mask_token_id": np.int32(MASK % vocab)}})


# ----------------------------------------------------------------------------- the heads, against speculators


@pytest.mark.parametrize("kind", D.HEAD_TYPES)
def test_markov_and_confidence_heads_equal_speculators_modules(kind):
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators")
    from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead

    v, r, d, n_blk, bs = 11, 4, 6, 3, 5
    rng = np.random.default_rng(1)
    ref = MarkovHead(verifier_vocab_size=v, draft_vocab_size=v, markov_rank=r, hidden_size=d, head_type=kind)
    conf = ConfidenceHead(d + r)
    with torch.no_grad():
        for prm in list(ref.parameters()) + list(conf.parameters()):
            prm.copy_(torch.tensor(0.7 * rng.standard_normal(tuple(prm.shape)), dtype=torch.float32))
    p = {"markov": {"w1": ref.markov_w1.weight.detach().numpy(), "w2": ref.markov_w2.weight.detach().numpy().T}}
    if kind == "gated":
        p["markov_gate"] = {"kernel": ref.gate_proj.weight.detach().numpy().T, "bias": ref.gate_proj.bias.detach().numpy()}
    if kind == "rnn":
        p["markov_rnn"] = {"kernel": ref.joint_proj.weight.detach().numpy().T,
                           "bias": ref.joint_proj.bias.detach().numpy()}
    p["confidence"] = {"kernel": conf.proj.weight.detach().numpy().T, "bias": conf.proj.bias.detach().numpy()}
    assert D.head_type(p) == kind
    prev = rng.integers(0, v, (n_blk, bs))
    hidden = rng.standard_normal((n_blk, bs, d)).astype(np.float32)
    with torch.no_grad():
        want = ref.block_bias(prev_token_ids=torch.tensor(prev), hidden_states=torch.tensor(hidden)).numpy()
        e_t = ref.prev_embeddings(torch.tensor(prev))
        want_conf = torch.sigmoid(conf(torch.cat([torch.tensor(hidden), e_t], -1))).numpy()
    e = D.prev_embedding(p, jnp.asarray(prev))
    state, got = None, []
    for k in range(bs):  # slot by slot, the state threaded as the decode's expand_fn threads it
        bias, state = D.markov_bias(p, e[:, k], jnp.asarray(hidden[:, k]), state)
        got.append(np.asarray(bias))
    np.testing.assert_allclose(np.stack(got, 1), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(D.confidence(p, jnp.asarray(hidden), e)), want_conf, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- drafting


@pytest.mark.slow  # > 6 s (the fast lane's rule): eager model pieces
def test_chain_is_vllms_sequential_sampling():
    """Slot 0 (the anchor) drafts from its base logits biased by the root; slot k by the draft of slot k-1."""
    spec, tp, params = setup(24, seed=2)
    p = params.drafter_params.weights["dspark"]
    first = FirstProposal(spec, tp, params, parse_dspark("chain:4"))
    # the reference loop, from the pieces: context K/V of the prompt, one block forward, then sequential argmax
    h = first.block(p, D.backbone(p), MASK, 4)
    base = np.asarray(DF.block_logits(spec.target, tp, h))[0]
    w1, w2 = np.asarray(p["markov"]["w1"]), np.asarray(p["markov"]["w2"])
    prev, want = int(first.root[0]), [int(first.root[0])]
    for slot in range(4):
        prev = int(np.argmax(base[slot] + w1[prev] @ w2))
        want.append(prev)
    assert first.chain == want


@pytest.mark.slow  # the vanilla head's greedy = AR under every plan shape is the family contract's (fast lane)
@pytest.mark.parametrize("kind", [k for k in D.HEAD_TYPES if k != "vanilla"])
def test_greedy_equals_ar_for_every_head_and_plan(kind):
    spec, tp, params = setup(6, kind=kind, seed=3)
    prompts = prompts_for(6)
    want = generated_rows(generate_ar(tp, spec.target, prompts, max_new_tokens=24, eos_ids=()), len(prompts))
    # a confidence-gated chain, a static tree and DDTree's (a Markov head reads each node's parent token: a
    # chain, a branching tree, a best-first one); the other shapes take the same path as the vanilla head's
    for text in ("chain:4@0.2", "tree:2,2,1", "ddtree:6,3"):
        out = loop.generate_speculative(params.target, parse_dspark(text), params.drafter_params, prompts,
                                        max_new_tokens=24, eos_ids=())
        assert generated_rows(out, len(prompts)) == want, (kind, text)
        assert np.asarray(out.accept_log_bi).max() > 1, (kind, text, "no draft accepted: vacuous")


@pytest.mark.slow  # > 6 s (the fast lane's rule)
def test_confidence_sets_each_rows_verification_length():
    spec, tp, params = setup(24, seed=4)
    p = params.drafter_params.weights["dspark"]
    from confu_jax.models.target import real_forward

    prompt = [5, 1, 7, 7, 2]
    toks = jnp.asarray([prompt], jnp.int32)
    out = real_forward(spec, tp, toks)
    root = jnp.argmax(out.logits_btv[:, -1], axis=-1).astype(jnp.int32)
    view = PrefillView(toks, jnp.array([len(prompt)]), root, out.taps_btc, None, 32)
    inp = DraftInput(root, jnp.array([len(prompt) - 1]), jnp.zeros((1,), bool), jax.random.PRNGKey(0),
                     jnp.float32(0.0), jnp.float32(1.0))
    full = parse_dspark("chain:5")
    prop = full.propose(params.target, params.drafter_params, full.init(params.target, params.drafter_params, view),
                        inp)
    assert int(prop.n_nodes_b[0]) == 6 and full.widths == (6,)
    # the survival by hand, from the chain's tokens and the block's states
    tokens = prop.tree.tokens_bt[:, :5]
    k, v = context_entries(params.drafter_params, p, out.taps_btc, jnp.arange(len(prompt))[None])
    blk = jnp.concatenate([root[:, None], jnp.full((1, 4), MASK, jnp.int32)], 1)
    h = DF.block_hidden(D.backbone(p), spec.draft_model, DF.embed_block(tp, blk),
                        jnp.arange(len(prompt), len(prompt) + 5)[None], jnp.ones((1, 5, 5), bool),
                        k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4), jnp.array([len(prompt)]))
    survival = np.cumprod(np.asarray(D.confidence(p, h, D.prev_embedding(p, tokens)))[0])
    for threshold in sorted({0.999, *np.round(survival, 6).tolist(), 1e-4}):
        gated = parse_dspark(f"chain:5@{threshold:.6f}")
        assert gated.widths == (1, 2, 3, 4, 5, 6)
        n = int(gated.propose(params.target, params.drafter_params, gated.init(params.target, params.drafter_params,
                                                                               view), inp).n_nodes_b[0])
        assert n == 1 + int(np.sum(np.cumprod(survival >= float(f"{threshold:.6f}")))), threshold


# The sampled chain is where this family's own q meets the acceptance rule: its q is the Markov-biased one. A DDTree tree
# drafts with a point-mass q whatever the drafter's probabilities, so its sampled rule is DFlash's, checked by
# tests/unit/test_dflash.py::test_sampling_lossless_joint[ddtree:4,2] (this family's tree shapes: greedy = AR in
# tests/contract/test_family_contract.py).
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=5, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    assert_sampling_is_lossless(spec, tp, params, parse_dspark(plan))


def test_bad_plans_and_sources_are_one_line():
    with pytest.raises(ValueError, match="cannot shorten: use chain:K@P"):
        parse_dspark("tree:2,2@0.5")
    with pytest.raises(ValueError, match="survival threshold"):
        parse_dspark("chain:3@abc")
    with pytest.raises(ValueError, match="cannot shorten"):
        parse_dspark("ddtree:8,3@0.5")
    spec, tp, params = setup(6, confidence=False)
    with pytest.raises(ValueError, match="no confidence head"):
        loop.generate_speculative(params.target, parse_dspark("chain:3@0.5"), params.drafter_params, prompts_for(6),
                                  max_new_tokens=4,
                                eos_ids=())
    with pytest.raises(ValueError, match="neither a DSpark launch.train workdir .* nor a speculators DSpark directory"):
        load_dspark(spec.target, tp, "/some/dir")
    assert isinstance(parse_dspark("chain:3"), DSparkDrafter) and parse_dspark("chain:3@0.25").describe() == "chain:3@0.25"
