"""P-EAGLE against the reference no one here wrote: speculators' ``PEagleDraftModel`` (its forward over
COD-sampled rollouts, ``models/peagle/core.py``) and its ``peagle`` layout (``weights/peagle_format.py``).

* A random P-EAGLE head speculators builds and saves imports here (``decode_head('peagle', ...)``), and our
  one-pass draft at anchor p (``decode.peagle.parallel_logits``: the committed entries 0..p, then the
  mask slots at p+1..p+D-1) gives the logits of the reference's rollout from anchor p, depth by depth
  (its depth-0 rows and its depth-k rows of that anchor, read where its forward hands them to its loss);
  with a trained embedding copy that differs from the target's, the head keeps and reads its own.
* Our export loads back in speculators to the same logits, and re-imports here bit for bit.
* The refusals: a missing ``mask_hidden``, a mask token outside the vocabulary, an EAGLE-3 layout.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.drafter import DraftInput, PrefillView
from confu_jax.decode.families import decode_head, parse_drafter
from confu_jax.decode.peagle import parallel_logits
from confu_jax.models.spec import ModelSpec
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.peagle_format import export_peagle
from tests.helpers.model_fakes import DRAFT_VOCAB, tiny_params, tiny_spec

torch = pytest.importorskip("torch")
pytest.importorskip("speculators")

ATOL = 1e-4
DRAFT_FFN = 96
MASK = 7
DEPTH = 4


def _target():
    spec = tiny_spec("eagle3")
    tp, _ = tiny_params(spec, seed=0)
    return spec.target, tp


def _draft_vocab(v, dv, seed=0):
    rng = np.random.default_rng(seed)
    d2t = np.sort(rng.choice(v, dv, replace=False)).astype(np.int64)
    t2d = np.zeros((v,), bool)
    t2d[d2t] = True
    return d2t, t2d


def _reference(cfg, embed, d2t, t2d, taps, seed=0, own_embed=False, flags=None):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig as HFConfig

    tl = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=DRAFT_FFN,
                  num_hidden_layers=1, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)
    tl._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=len(d2t), eagle_aux_hidden_state_layer_ids=list(taps),
        mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=DEPTH)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                      architectures=["LlamaForCausalLM"])),
        **(flags or {}))
    model = PEagleDraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "mask_hidden":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        e = np.asarray(embed, np.float32)
        if own_embed:
            e = e + 0.05 * np.random.default_rng(seed).standard_normal(e.shape).astype(np.float32)
        model.embed_tokens.weight.copy_(torch.tensor(e))
    model.load_vocab_mappings(torch.tensor(t2d), torch.tensor(d2t - np.arange(len(d2t))))
    return model.eval()


def _reference_rollouts(model, input_ids, h_cat, anchors, monkeypatch):
    """speculators' forward with COD sampling fixed to: every position at depth 0, then a full rollout
    of DEPTH-1 mask slots from each anchor -> {(anchor, depth): logits [V_draft]}."""
    n = input_ids.shape[1]
    anchor_pos = [*range(n)] + [a for a in anchors for _ in range(1, DEPTH)]
    depth = [0] * n + [k for _ in anchors for k in range(1, DEPTH)]
    logits = _reference_forward(model, input_ids, h_cat, anchor_pos, depth, monkeypatch)
    return {(a, k): logits[i] for i, (a, k) in enumerate(zip(anchor_pos, depth))}


def _reference_forward(model, input_ids, h_cat, anchor_pos, depth, monkeypatch):
    """speculators' P-EAGLE forward over the COD layout (anchor_pos, depth) -> logits [S, V_draft], read
    where its forward hands them to its loss."""
    import speculators.models.peagle.core as core

    n = input_ids.shape[1]
    seen = {}

    def fixed(**kw):
        return torch.tensor(anchor_pos), torch.tensor(depth)

    def capture(logits, targets, loss_mask, anchor_pos, depth, num_depths, loss_config=None):
        seen["logits"] = logits.detach().float().numpy()[0]
        return logits.sum() * 0, {}

    monkeypatch.setattr(core, "generate_cod_sample_indices", fixed)
    monkeypatch.setattr(core, "compute_metrics", capture)
    with torch.no_grad():
        model(hidden_states=torch.tensor(h_cat), input_ids=torch.tensor(input_ids, dtype=torch.long),
              document_ids=torch.zeros((1, n), dtype=torch.long), position_ids=torch.arange(n)[None],
              verifier_last_hidden_states=torch.zeros((1, n, h_cat.shape[-1] // 3)), num_depths=max(depth) + 1)
    return seen["logits"]


def _ours(head, x, h_cat, a):
    """Our one-pass draft at anchor p = a: entries 0..a-1 committed, entry a pending (its token
    x[a+1] is the root) -> [DEPTH, V_draft]."""
    drafter = parse_drafter("peagle", f"chain:{DEPTH}")
    target, dp = head.target, head.drafter_params
    view = PrefillView(jnp.asarray(x[:, :a + 1]), jnp.array([a + 1]), jnp.asarray(x[:, a + 1]),
                       jnp.asarray(h_cat[:, :a + 1]), None, 64)
    st = drafter.init(target, dp, view)
    inp = DraftInput(jnp.asarray(x[:, a + 1]), jnp.array([a]), jnp.zeros((1,), bool), jax.random.PRNGKey(0),
                     jnp.float32(0.0), jnp.float32(1.0))
    logits, _ = parallel_logits(target, dp, st, inp, DEPTH)
    return np.asarray(logits[0])


def _compare(head, model, monkeypatch, seed=0):
    cfg = head.spec.target
    rng = np.random.default_rng(seed)
    n = 9
    x = rng.integers(0, cfg.vocab_size, (1, n + 1)).astype(np.int32)  # x[0..n]; speculators' input_ids[j] = x[j+1]
    h_cat = rng.normal(size=(1, n, 3 * cfg.d_model)).astype(np.float32)
    anchors = (2, 5)
    ref = _reference_rollouts(model, x[:, 1:], h_cat, anchors, monkeypatch)
    for a in anchors:
        ours = _ours(head, x, h_cat, a)
        for k in range(DEPTH):
            np.testing.assert_allclose(ours[k], ref[(a, k)], atol=ATOL, rtol=1e-4, err_msg=f"anchor {a} depth {k}")


@pytest.mark.parametrize("own_embed", [False, True], ids=["target-embedding", "own-embedding"])
def test_speculators_peagle_imports_to_its_rollout_logits(tmp_path, monkeypatch, own_embed):
    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    model = _reference(cfg, embed, d2t, t2d, (1, 4, 6), own_embed=own_embed, flags={"fc_norm": True})
    model.save_pretrained(str(tmp_path))
    head = decode_head("peagle", cfg, tp, str(tmp_path))
    assert head.trained and head.spec.head.variant == "peagle" and head.spec.head.mask_token_id == MASK
    assert head.spec.taps == (1, 4, 6) and head.spec.head.fc_norm
    assert ("embed_tokens" in head.drafter_params.weights) == own_embed and ("own embedding" in head.source) == own_embed
    _compare(head, model, monkeypatch)


def test_our_export_loads_in_speculators_and_back(tmp_path, monkeypatch):
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=3)
    model = _reference(cfg, embed, d2t, t2d, (2, 3, 5), seed=4)
    model.save_pretrained(str(tmp_path / "ref"))
    head = decode_head("peagle", cfg, tp, str(tmp_path / "ref"))
    from confu_jax.weights import save_hf

    save_hf(cfg, tp, str(tmp_path / "target"))  # the verifier speculators reads: a local directory, never the hub
    out = export_peagle(str(tmp_path / "ours"), head.spec, head.drafter_params.weights,
                        head.drafter_params.draft_vocab["d2t"],
                        head.drafter_params.draft_vocab["t2d"], embed=embed, depth=DEPTH, verifier=str(tmp_path / "target"))
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert (c["speculators_model_type"], c["mask_token_id"], c["speculators_config"]["algorithm"]) == (
        "peagle", MASK, "peagle")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = PEagleSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    back = PEagleDraftModel.from_pretrained(out, config=config).eval()
    np.testing.assert_array_equal(back.mask_hidden.detach().numpy().reshape(-1),
                                  head.drafter_params.weights["mask_hidden"])
    _compare(head, back, monkeypatch, seed=1)
    again = decode_head("peagle", cfg, tp, out)
    assert again.spec.head == head.spec.head
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.drafter_params.weights, head.drafter_params.weights)


def test_the_training_forward_is_the_references_cod_forward(tmp_path, monkeypatch):
    """``train.peagle_task.cod_forward`` (depth 0 at every position, then nested rollouts kept per depth
    by COD's schedule) gives speculators' forward logits over the same layout, slot for slot."""
    from confu_jax.train.peagle_task import PEagleObjective, cod_forward, rollout_slots

    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=2)
    model = _reference(cfg, embed, d2t, t2d, (1, 4, 6), seed=6)
    model.save_pretrained(str(tmp_path))
    head = decode_head("peagle", cfg, tp, str(tmp_path))
    rng = np.random.default_rng(8)
    n = 12
    tokens = rng.integers(0, cfg.vocab_size, (1, n)).astype(np.int32)
    h_cat = rng.normal(size=(1, n, 3 * cfg.d_model)).astype(np.float32)
    obj = PEagleObjective(num_depths=DEPTH, ratio=0.7, ratio_min=0.2, num_anchors=3)
    rank, depth = rollout_slots(obj, 3)
    assert obj.kept(3) == (3, 2, 2) and depth.tolist() == [1, 1, 1, 2, 2, 3, 3]  # nested: ranks 0, 1 go deepest
    anchor_k = np.array([7, 2, 9], np.int32)  # the rollouts by rank
    anchor_bm = anchor_k[rank][None]
    ours = np.asarray(cod_forward(head.spec, head.drafter_params.weights, jnp.asarray(embed), jnp.asarray(tokens),
                                  jnp.asarray(h_cat), jnp.asarray(anchor_bm), jnp.asarray(rank), jnp.asarray(depth)))[0]
    input_ids = np.concatenate([tokens[:, 1:], np.zeros((1, 1), np.int32)], 1)  # speculators' j reads x[j+1]
    ref = _reference_forward(model, input_ids, h_cat, [*range(n), *anchor_bm[0].tolist()], [0] * n + depth.tolist(),
                             monkeypatch)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=1e-4)


def test_bad_peagle_directories_are_refused(tmp_path):
    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    head = decode_head("peagle", cfg, tp, None)
    spec = ModelSpec(cfg, dataclasses.replace(head.spec.head, draft_vocab_size=DRAFT_VOCAB))
    draft = jax.tree_util.tree_map(np.asarray, dict(head.drafter_params.weights))
    draft["lm_head"] = {"kernel": draft["lm_head"]["kernel"][:, :DRAFT_VOCAB]}
    out = export_peagle(str(tmp_path / "h"), spec, draft, d2t, t2d, embed=embed)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        good = json.load(f)
    for bad, why in (({"mask_token_id": cfg.vocab_size}, "outside the vocabulary"), ({"mask_token_id": None}, "mask_token_id"),
                     ({"speculators_config": {**good["speculators_config"], "algorithm": "eagle3"}}, "algorithm")):
        with open(path, "w") as f:
            json.dump({**good, **bad}, f)
        with pytest.raises(CheckpointError, match=why):
            decode_head("peagle", cfg, tp, out)
    with open(path, "w") as f:
        json.dump({**good, "speculators_model_type": "eagle3"}, f)
    with pytest.raises(ValueError, match="peagle"):
        decode_head("peagle", cfg, tp, out)  # an EAGLE-3 layout: the head family's loader names the variant
