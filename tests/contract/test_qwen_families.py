"""Every drafter family on Qwen targets: greedy speculative decoding emits exactly the AR tokens.

The targets are transformers' own tiny random ``Qwen3ForCausalLM`` (per-head q/k norms, head_dim
unlike width / heads) and ``Qwen2ForCausalLM`` (q/k/v biases), loaded through the checkpoint path a
user's model takes. Each family drafts with an untrained head (random weights propose tokens the
target often rejects, which exercises rejection as much as acceptance). DFlash is also checked with
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


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def target(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    # 8 layers: EAGLE-3's taps (2, 4, 5) and DFlash's five distinct; Qwen3: 4 heads x 24 = 96 > width 64
    kw = dict(vocab=64, hidden=64, layers=8, heads=4, kv_heads=2, head_dim=24 if request.param == "qwen3" else 16,
              ffn=96, max_pos=256, tie=request.param == "qwen2")
    hf_qwen(d, family=request.param, seed=4, **kw)
    cfg, tp = load_model(str(d))
    ar = generate_ar(tp, cfg, PROMPTS, max_new_tokens=N_NEW, eos_ids=())
    return cfg, tp, _rows(ar)


def _rows(res):
    toks, n = np.asarray(res.tokens_bn), np.asarray(res.n_generated_b)
    return [toks[b, :n[b]].tolist() for b in range(len(PROMPTS))]


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(PLANS))
def test_greedy_equals_ar(target, method):
    cfg, tp, ar = target
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
