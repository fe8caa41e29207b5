"""Medusa-1 heads (``models.medusa``, ``decode.medusa``, ``train.medusa_task``, ``weights.medusa_format``).

(1) The forward equals a torch transcription of the reference (FasterDecoding/Medusa
``medusa/model/medusa_model.py``: ``ResBlock`` and the ``medusa_head`` ModuleList), loaded with
``load_state_dict(strict=True)`` from our export, so the key names are the reference's; the
reference initialisation (W = 0, LM heads = the target's); (2) in the loop, greedy output equals
AR token for token for every plan shape (tests/contract/test_family_contract.py) and a tree holding every token at each depth accepts its
full depth every pass (the state carries the right hidden state); sampled output passes the
chi-square test against the exact joint (a sharded run: tests/contract/test_family_contract.py); (3) the
loss equals a hand computation (CE against x[t+k+2], weights λ^k, loss mask), a short tiny run
lowers it and its workdir decodes losslessly through ``decode_head``; a killed run resumes with
identical losses; (4) FasterDecoding-format export/import round trip (safetensors and .pt).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.medusa import MedusaDrafter, parse_medusa_plan
from confu_jax.decode.plans import cartesian_paths
from confu_jax.models import medusa as med
from confu_jax.decode.families import get_method
from confu_jax.train.metric_writers import read_csv
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import generated_rows, make, own

# the heads' pieces under jit (tests/helpers/jitting.py: called eagerly, every primitive compiles on its own)
init_medusa, medusa_logits = jit_static(med.init_medusa), jit_static(med.medusa_logits)

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]


def heads_for(spec, tp, num_heads=3, num_layers=1, std=0.3, seed=0):
    """Reference-initialised heads with random (non-zero) ResBlock weights, so every term acts."""
    emb = tp["embed"]["embedding"] if spec.target.tie_embeddings else tp["lm_head"]["kernel"]
    h = init_medusa(jax.random.PRNGKey(seed), num_heads, num_layers, jnp.asarray(emb),
                    0 if spec.target.tie_embeddings else 1)
    rng = np.random.default_rng(seed + 1)
    h = jax.tree_util.tree_map(np.asarray, h)
    h["resblocks"]["kernel"] = (rng.standard_normal(h["resblocks"]["kernel"].shape) * std).astype(np.float32)
    h["lm_head"]["kernel"] = h["lm_head"]["kernel"] + (rng.standard_normal(h["lm_head"]["kernel"].shape)
                                                       * std).astype(np.float32)
    return h


def setup(vocab, num_heads=3, seed=0, **kw):
    spec, tp, _ = make("eagle3", vocab, seed=seed, **kw)
    heads = heads_for(spec, tp, num_heads, seed=seed)
    return spec, tp, own(spec, tp, {"medusa": heads})


# ----------------------------------------------------------------------------- the heads


def _torch_reference(heads):
    """The reference's module structure, transcribed (ResBlock verbatim; distinct blocks per layer)."""
    import torch
    import torch.nn as nn

    class ResBlock(nn.Module):
        def __init__(self, hidden_size):
            super().__init__()
            self.linear = nn.Linear(hidden_size, hidden_size)
            torch.nn.init.zeros_(self.linear.weight)
            self.act = nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    c = med.config_of(heads)
    medusa_head = nn.ModuleList([
        nn.Sequential(*[ResBlock(c.d_model) for _ in range(c.num_layers)],
                      nn.Linear(c.d_model, c.vocab_size, bias=False))
        for _ in range(c.num_heads)])
    sd = {k: torch.from_numpy(np.array(v)) for k, v in med.to_reference_state_dict(heads).items()}
    medusa_head.load_state_dict(sd, strict=True)  # every key of the reference module, no other
    return medusa_head


@pytest.mark.parametrize("num_layers", [1, 2])
def test_forward_equals_reference_transcription(num_layers):
    import torch

    spec, tp, _ = make("eagle3", 24)
    heads = heads_for(spec, tp, num_heads=3, num_layers=num_layers)
    heads["resblocks"]["bias"] = np.random.default_rng(5).standard_normal(heads["resblocks"]["bias"].shape).astype(
        np.float32)
    ref = _torch_reference(heads)
    h = np.random.default_rng(3).standard_normal((2, 5, spec.target.d_model)).astype(np.float32)
    ours = np.asarray(medusa_logits(heads, jnp.asarray(h)))  # [K,2,5,V]
    with torch.no_grad():
        want = np.stack([ref[k](torch.from_numpy(h)).numpy() for k in range(3)])
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
    # round trip through the reference state dict
    back = med.from_reference_state_dict(med.to_reference_state_dict(heads), 3, num_layers)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, heads)


def test_reference_initialisation():
    spec, tp, _ = make("eagle3", 24)
    emb = jnp.asarray(tp["embed"]["embedding"])
    heads = init_medusa(jax.random.PRNGKey(0), 2, 1, emb, 0)
    d = spec.target.d_model
    assert not np.any(np.asarray(heads["resblocks"]["kernel"]))  # W = 0 (reference zeros_)
    b = np.asarray(heads["resblocks"]["bias"])
    assert np.all(np.abs(b) <= 1 / np.sqrt(d)) and np.any(b)  # torch Linear's default bias init
    for k in range(2):
        np.testing.assert_array_equal(np.asarray(heads["lm_head"]["kernel"][k]), np.asarray(emb).T)
    h = np.random.default_rng(0).standard_normal((3, d)).astype(np.float32)
    want = (h + jax.nn.silu(b[0, 0])) @ np.asarray(emb).T  # x + SiLU(0·x + b), then the target's LM head
    np.testing.assert_allclose(np.asarray(medusa_logits(heads, h))[0], want, rtol=1e-5, atol=1e-5)


def test_plan_parsing():
    assert cartesian_paths((2, 1)) == ((0,), (1,), (0, 0), (1, 0))
    d = parse_drafter("medusa", "tree:2,2,1")
    assert isinstance(d, MedusaDrafter) and d.n_nodes == 1 + 2 + 4 + 4 and d.max_depth == 3
    assert d.describe() == "tree:2,2,1"
    assert parse_drafter("medusa", "chain:3").plan.k == 3
    with pytest.raises(ValueError, match="contemplates"):
        parse_medusa_plan("chain:3+c2")
    with pytest.raises(ValueError, match="k_i >= 1"):
        parse_medusa_plan("tree:2,0")
    from confu_jax.bench import budget, cli_args

    fams = cli_args.plan_families("tree:2,2")  # every model-based family drafts a Cartesian static tree; lookup does not
    assert {"medusa", "mlp_speculator", "head", "draft_model"} <= set(fams) and "lookup" not in fams
    chains, trees = budget.default_candidates("medusa")
    assert all(parse_drafter("medusa", p).max_depth <= 3 for p in chains + trees)
    spec, tp, params = setup(6, num_heads=2)
    with pytest.raises(ValueError, match="medusa_num_heads"):
        loop.generate_speculative(params.target, parse_drafter("medusa", "chain:3"), params.drafter_params, PROMPTS,
                                  max_new_tokens=4,
                                  eos_ids=())


# ----------------------------------------------------------------------------- in the loop




def test_full_tree_accepts_every_depth():
    """Vocabulary 4, tree:4,4: every token sits under every depth-1 node, so the target's two next
    tokens are always in the tree and every pass emits 3 (the last may be clipped)."""
    spec, tp, params = setup(4, num_heads=2)
    prompts = [[t % 4 for t in p] for p in PROMPTS]
    sp = loop.generate_speculative(params.target, parse_drafter("medusa", "tree:4,4"), params.drafter_params, prompts,
                                   max_new_tokens=25,
                                   eos_ids=())
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=25, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log, passes = np.asarray(sp.accept_log_bi), np.asarray(sp.n_passes_b)
    for b in range(2):
        assert np.all(log[b, : passes[b] - 1] == 3), log[b, : passes[b]]


def test_state_follows_the_last_accepted_node():
    """Heads that are exactly the target's next-token argmax two/three ahead cannot be built, but
    the hidden state must be the target's at p: with 1 head and ResBlocks W = 0, b = 0 and the
    target's LM head, head 0 at p predicts the target's argmax at p (= the root), so chain:1 drafts
    the root again; on the row's own greedy text it is accepted exactly where x[p+2] == x[p+1]."""
    spec, tp, _ = make("eagle3", 4)
    heads = init_medusa(jax.random.PRNGKey(0), 1, 1, jnp.asarray(tp["embed"]["embedding"]), 0)
    heads = jax.tree_util.tree_map(np.array, heads)
    heads["resblocks"]["bias"][:] = 0
    params = own(spec, tp, {"medusa": heads})
    prompts = [[t % 4 for t in p] for p in PROMPTS]
    sp = loop.generate_speculative(params.target, parse_drafter("medusa", "chain:1"), params.drafter_params, prompts,
                                   max_new_tokens=20,
                                   eos_ids=())
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=20, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    for b, row in enumerate(generated_rows(ar, 2)):
        # replay: a pass starting with root x_i accepts the draft (= x_i) iff x_{i+1} == x_i
        i, want = 0, []
        while i < len(row):
            n = 2 if i + 1 < len(row) and row[i + 1] == row[i] else 1
            if i + 1 >= len(row):
                break
            want.append(n)
            i += n
        got = np.asarray(sp.accept_log_bi)[b, : int(np.asarray(sp.n_passes_b)[b])].tolist()
        assert got[: len(want) - 1] == want[: len(want) - 1], (row, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2", "tree:2,2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, num_heads=2, seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    drafter = parse_drafter("medusa", plan)
    assert_sampling_is_lossless(spec, tp, params, drafter)


# ----------------------------------------------------------------------------- import / export


def test_faster_decoding_format_round_trip(tmp_path):
    import torch

    from confu_jax.decode.families import decode_head
    from confu_jax.weights.medusa_format import load_medusa_dir, save_medusa_dir

    spec, tp, params = setup(6)
    heads = params.drafter_params.weights["medusa"]
    d = str(tmp_path / "st")
    save_medusa_dir(d, heads, base_model_name_or_path="tiny")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    imp = load_medusa_dir(d)
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.heads, heads)
    # the .pt form the reference's from_pretrained reads (torch.save of the ModuleList's state dict)
    p = tmp_path / "pt"
    p.mkdir()
    torch.save(_torch_reference(heads).state_dict(), str(p / "medusa_lm_head.pt"))
    with open(p / "config.json", "w") as f:
        json.dump({"medusa_num_heads": 3, "medusa_num_layers": 1}, f)
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_medusa_dir(str(p)).heads, heads)
    # and it decodes through decode_head, losslessly and exactly as the in-memory heads
    head = decode_head("medusa", spec.target, tp, d)
    assert head.trained and "FasterDecoding" in head.source
    drafter = parse_drafter("medusa", "chain:3")
    a = loop.generate_speculative(head.target, drafter, head.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    with pytest.raises(ValueError, match="missing keys"):
        sd = med.to_reference_state_dict(heads)
        del sd["1.0.linear.bias"]
        med.from_reference_state_dict(sd, 3, 1)


# ----------------------------------------------------------------------------- training

def _config(**extra):
    from configs.tiny_medusa import get_config
    from tests.helpers.train_resume import short_run_config

    return short_run_config(get_config, **extra)


def test_loss_equals_hand_computation():
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.medusa_task import medusa_loss
    from confu_jax.train.target_loading import load_target
    from confu_jax.train.loop import setup_run

    config = _config()
    run = setup_run(config)
    batch = next(run.task.train_iterator(0, 1))
    spec, tp = load_target(config, model_spec_from_config(config))
    heads = heads_for(spec, tp, num_heads=3)
    medusa_loss = jit_static(medusa_loss)
    loss, m = medusa_loss(spec, heads, tp, batch, decay=0.8)
    toks = np.asarray(batch["tokens"])
    mask = np.asarray(batch["loss_mask"]).astype(bool)
    if "attention_mask" in batch:
        mask &= np.asarray(batch["attention_mask"]).astype(bool)
    from confu_jax.models.target import real_forward
    h = np.asarray(jit_static(real_forward)(spec, tp, jnp.asarray(toks), return_logits=False).hidden_btd)
    logits = np.asarray(medusa_logits(heads, h), np.float64)  # [K,B,N,V]
    want = 0.0
    n = toks.shape[1]
    for k in range(3):
        lp = logits[k] - np.log(np.exp(logits[k] - logits[k].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits[k].max(-1, keepdims=True)
        nll, cnt = 0.0, 0
        for b in range(toks.shape[0]):
            for t in range(n - k - 2):
                if mask[b, t + k + 2]:
                    nll -= lp[b, t, toks[b, t + k + 2]]
                    cnt += 1
        assert cnt > 0
        np.testing.assert_allclose(float(m[f"ce/head{k}"]), nll / cnt, rtol=1e-4)
        want += 0.8 ** k * nll / cnt
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    # the distillation form is a KL (>= 0) and differs from the CE
    kl, _ = medusa_loss(spec, heads, tp, batch, decay=0.8, distill=True)
    assert 0 <= float(kl) and abs(float(kl) - float(loss)) > 1e-3


@pytest.mark.slow
def test_training_lowers_the_loss_and_the_run_decodes(tmp_path):
    from confu_jax.decode.families import decode_head
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.medusa import is_medusa_workdir
    from confu_jax.train.loop import train
    from confu_jax.train.target_loading import load_target

    workdir = str(tmp_path / "medusa")
    config = _config(**{"train.steps": 40, "train.eval_every": 20, "train.checkpoint.every": 20})
    result = train(config, workdir)
    assert result.step == 40
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.85 * first, (first, last)
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"]
    assert {"acc/head0", "acc/head2", "acceptance_length"} <= set(ev[-1])
    assert is_medusa_workdir(workdir)
    spec, tp = load_target(config, model_spec_from_config(config))
    head = decode_head("medusa", spec.target, tp, workdir)
    assert head.trained and "step 40" in head.source
    # export in FasterDecoding's format (bf16) and load it back: the heads rounded to bf16, same tokens
    import ml_dtypes

    from confu_jax.runs.medusa import export_medusa_run
    from confu_jax.weights.medusa_format import load_medusa_dir

    out = str(tmp_path / "exported")
    run = export_medusa_run(workdir, out, spec.target, tp, dtype="bfloat16")
    back = load_medusa_dir(out).heads
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), run.heads)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, rounded)
    assert decode_head("medusa", spec.target, tp, out).trained
    assert not decode_head("medusa", spec.target, tp, None).trained and get_method("medusa").needs_head
    prompts = [[5, 9, 17, 3], [40, 2, 7, 7, 1, 30]]
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=16, eos_ids=())
    for plan in ("chain:3", "tree:2,2,1"):
        sp = loop.generate_speculative(head.target, parse_drafter("medusa", plan), head.drafter_params, prompts,
                                       max_new_tokens=16, eos_ids=())
        assert generated_rows(sp, 2) == generated_rows(ar, 2)
