"""Every drafter family on Qwen targets: greedy speculative decoding emits exactly the AR tokens.

The targets are transformers' own tiny random ``Qwen3ForCausalLM`` (per-head q/k norms, head_dim
unlike width / heads) and ``Qwen2ForCausalLM`` (q/k/v biases), loaded through the checkpoint path a
user's model takes. Each family drafts with an untrained head (random weights propose tokens the
target often rejects, which exercises rejection as much as acceptance); the methods that build layers of the
target's shape run on both targets, the others on one (``BOTH`` / ``ONE`` say which). DFlash is also checked with
five target taps, the layout of the published Qwen3 DFlash drafters.
"""


import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.families import decode_head
from confu_jax.weights import load_model
from tests.helpers.tiny_checkpoints import hf_qwen

PROMPTS = [[5, 9, 11, 5, 9, 11, 5, 9], [17, 3, 4, 17, 3]]
N_NEW = 16
# method -> plan: every speculative method of the registry but sd2 (a draft model steered by a trained
# SD² run: draft_model covers its loop) and auto (a choice among these).
PLANS = {"eagle3": "chain:3", "confu": "dynamic:3,3,8", "confu_nomoe": "chain:3", "lookup": "lookup:3",
         "hybrid": "chain:3", "draft_model": "chain:3", "medusa": "chain:3", "mlp_speculator": "chain:3",
         "mtp": "chain:2", "dflash": "chain:3"}
# What a Qwen target changes is its own forward (Qwen3's q/k norms and head width, Qwen2's q/k/v biases), which
# every method's verification runs, and the layers a drafter builds in the target's shape: ConFu's contemplate
# (the target's own attention over soft prompts), the early-exit draft model, the MTP layer and DFlash's backbone
# run on both targets; each other method, which reads only the target's states and logits, on one of them.
BOTH = ("confu", "draft_model", "mtp", "dflash")
ONE = {"qwen3": ("eagle3", "lookup", "medusa"), "qwen2": ("confu_nomoe", "hybrid", "mlp_speculator")}
assert set(BOTH) | set(ONE["qwen3"]) | set(ONE["qwen2"]) == set(PLANS)
CASES = [(family, m) for family in ("qwen3", "qwen2") for m in sorted(BOTH + ONE[family])]


_TARGETS = {}


def _target(family, tmp_path_factory):
    """transformers' tiny random model of ``family`` through the checkpoint path, and its AR rows (once a run)."""
    if family not in _TARGETS:
        d = tmp_path_factory.mktemp(family)
        # 8 layers: EAGLE-3's taps (2, 4, 5) and DFlash's five distinct; Qwen3: 4 heads x 24 = 96 > width 64
        kw = dict(vocab=64, hidden=64, layers=8, heads=4, kv_heads=2, head_dim=24 if family == "qwen3" else 16,
                  ffn=96, max_pos=256, tie=family == "qwen2")
        hf_qwen(d, family=family, seed=4, **kw)
        cfg, tp = load_model(str(d))
        ar = generate_ar(tp, cfg, PROMPTS, max_new_tokens=N_NEW, eos_ids=())
        _TARGETS[family] = (cfg, tp, _rows(ar))
    return _TARGETS[family]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def target(request, tmp_path_factory):
    return _target(request.param, tmp_path_factory)


def _rows(res):
    toks, n = np.asarray(res.tokens_bn), np.asarray(res.n_generated_b)
    return [toks[b, :n[b]].tolist() for b in range(len(PROMPTS))]


@pytest.mark.slow
@pytest.mark.parametrize("family,method", CASES)
def test_greedy_equals_ar(family, method, tmp_path_factory):
    cfg, tp, ar = _target(family, tmp_path_factory)
    assert all(len(r) == N_NEW for r in ar)
    head = decode_head(method, cfg, tp, None, seed=1)
    assert head.spec.target.qk_norm == cfg.qk_norm and head.spec.target.attention_bias == cfg.attention_bias
    out = loop.generate_speculative(head.target, parse_drafter(method, PLANS[method]), head.drafter_params, PROMPTS,
                                    max_new_tokens=N_NEW, eos_ids=())
    assert _rows(out) == ar, method
    assert np.asarray(out.accept_log_bi).max() >= 1


@pytest.mark.slow
def test_five_tap_dflash(target):
    cfg, tp, ar = target
    from confu_jax.models import dflash as D

    head = decode_head("dflash", cfg, tp, None, seed=2)
    taps = D.default_taps(cfg.n_layers, 5)
    assert len(set(taps)) == 5
    import jax

    dp = head.drafter_params
    p = jax.device_get(D.init_dflash(jax.random.PRNGKey(3), dp.draft_model, 5, init_std=0.3))
    draft = {"dflash": {**p, "mask_token_id": dp.weights["dflash"]["mask_token_id"]}}
    dp = dp.replace(weights=draft, tap_layers=taps)
    out = loop.generate_speculative(head.target, parse_drafter("dflash", "chain:3"), dp, PROMPTS,
                                    max_new_tokens=N_NEW, eos_ids=())
    assert _rows(out) == ar
