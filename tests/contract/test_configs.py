"""Configs: every file builds a ModelSpec; the paper's 3B/8B ConFu configs trace without allocation."""

import functools
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from confu_jax.models.kv_cache import KVCache
from confu_jax.models.draft_ttt import TTTFuture, draft_ttt
from confu_jax.models.llama import param_shapes
from confu_jax.models.params import param_counts, trainable_shapes
from confu_jax.models.spec import model_spec_from_config
from confu_jax.models.target import contemplate_queries, verify

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "smollm2_eagle3": ("smollm2-135m", "eagle3"),
    "smollm2_eagle31": ("smollm2-135m", "eagle3"),  # EAGLE 3.1: fc_norm + norm_output
    "smollm2_confu": ("smollm2-135m", "confu"),
    "smollm2_confu_nomoe": ("smollm2-135m", "confu_nomoe"),
    "smollm2_confu_nomoe_norep": ("smollm2-135m", "confu_nomoe_norep"),
    "llama32_3b_eagle3": ("llama-3.2-3b", "eagle3"),
    "llama32_3b_confu": ("llama-3.2-3b", "confu"),
    "llama31_8b_eagle3": ("llama-3.1-8b", "eagle3"),
    "llama31_8b_confu": ("llama-3.1-8b", "confu"),
}
# Published parameter counts of the targets (model cards / safetensors index totals).
TARGET_PARAMS = {"smollm2-135m": 134_515_008, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248}


def _load(name, *arg):
    return importlib.import_module(f"configs.{name}").get_config(*arg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_builds_spec_and_counts(name):
    preset, variant = CONFIGS[name]
    config = _load(name)
    spec = model_spec_from_config(config)
    assert (config.model.preset, spec.head.variant) == (preset, variant)
    assert config.confu.replication == (0 if variant == "confu_nomoe_norep" else 3)
    counts = param_counts(spec)
    assert counts["target"] == TARGET_PARAMS[preset]
    t, d = spec.target, spec.d_model
    hd, ffn, vd = t.head_dim, spec.draft_ffn_dim, spec.head.draft_vocab_size
    expect_draft = (3 * d * d + 2 * d * (t.n_heads + 2 * t.n_kv_heads) * hd + t.n_heads * hd * d
                    + 3 * d * ffn + d * vd + 4 * d)
    if spec.head.fc_norm:  # EAGLE 3.1: one RMSNorm scale per tapped layer before fc
        assert name == "smollm2_eagle31" and spec.head.norm_output and len(spec.taps) == 3
        expect_draft += 3 * d
    assert counts["draft"] == expect_draft
    if variant == "eagle3":
        assert counts["confu_extras"] == 0 and counts["trainable"] == expect_draft
    else:
        soft = 2 * t.n_layers * 16 * t.n_kv_heads * hd
        if variant == "confu":
            moe_con, moe_f = 3 * d * 8 + 8 + 8 * d, d * 8 + 8 + 8 * d
        else:
            moe_con = moe_f = d
        assert (counts["confu_soft_prompts"], counts["confu_moe_con"], counts["confu_moe_f"]) == (soft, moe_con, moe_f)
        assert counts["trainable"] == expect_draft + soft + moe_con + moe_f


def test_tiny_config_takes_the_variant_as_parameter():
    assert model_spec_from_config(_load("tiny", "eagle3")).head.variant == "eagle3"
    assert model_spec_from_config(_load("tiny")).head.variant == "confu"
    with pytest.raises(ValueError, match="unknown variant"):
        _load("tiny", "medusa")


@pytest.mark.parametrize("name,d,layers,kv,ffn,tied", [
    ("llama31_8b_confu", 4096, 32, 8, 14336, False),
    ("llama32_3b_confu", 3072, 28, 8, 8192, True),
])
def test_paper_configs_trace_with_expected_shapes(name, d, layers, kv, ffn, tied):
    spec = model_spec_from_config(_load(name))
    tgt = param_shapes(spec.target)
    tr = trainable_shapes(spec)
    shape = lambda x: tuple(x.shape)  # noqa: E731
    assert shape(tgt["embed"]["embedding"]) == (128256, d)
    assert shape(tgt["layers"]["q_proj"]["kernel"]) == (layers, d, d)
    assert shape(tgt["layers"]["k_proj"]["kernel"]) == (layers, d, kv * 128)
    assert ("lm_head" in tgt) == (not tied)
    c, dr = tr["confu"], tr["draft"]
    assert shape(c["soft_prompt_k_lphd"]) == shape(c["soft_prompt_v_lphd"]) == (layers, 16, kv, 128)
    assert shape(c["moe_con"]["router"]["kernel"]) == (3 * d, 8)
    assert shape(c["moe_con"]["experts_ed"]) == (8, d)
    assert shape(dr["moe_f"]["router"]["kernel"]) == (d, 8)
    assert shape(dr["fc"]["kernel"]) == (3 * d, d)
    assert shape(dr["q_proj"]["kernel"]) == (2 * d, d)
    assert shape(dr["k_proj"]["kernel"]) == shape(dr["v_proj"]["kernel"]) == (2 * d, kv * 128)
    assert shape(dr["gate_proj"]["kernel"]) == (d, ffn)
    assert shape(dr["lm_head"]["kernel"]) == (d, 32000)
    assert tgt["embed"]["embedding"].dtype == jnp.bfloat16 and dr["fc"]["kernel"].dtype == jnp.float32

    # the verification pass and the training forms trace end to end at full size, shapes only
    b, t, s, n, k = 1, 30, 256, 64, 4
    S = jax.ShapeDtypeStruct
    cache = KVCache(S((layers, b, kv, s, 128), jnp.bfloat16), S((layers, b, kv, s, 128), jnp.bfloat16),
                    S((b,), jnp.int32))
    out = jax.eval_shape(functools.partial(verify, spec), tgt, c, cache, S((b, t), jnp.int32),
                         S((b, t, t), bool), S((b, 3 * d), jnp.bfloat16))
    assert shape(out.logits_btv) == (b, t, 128256) and shape(out.future_btd) == (b, t, d)
    assert shape(out.h_cat_btc) == (b, t, 3 * d) and shape(out.k_new_lbthd) == (layers, b, t, kv, 128)
    f = jax.eval_shape(functools.partial(contemplate_queries, spec), tgt, c, cache.k_lbhsd, cache.v_lbhsd,
                       S((b, k), jnp.int32), S((b, k, 3 * d), jnp.bfloat16))
    assert shape(f) == (b, k, d)
    fut = TTTFuture(S((b, k, d), jnp.bfloat16), S((b, k), jnp.int32), S((b, n), jnp.int32))
    ttt = jax.eval_shape(lambda p, e, x, h, fu: draft_ttt(spec, p, e, x, h, 7, future=fu, return_logits=False),
                         dr, tgt["embed"]["embedding"], S((b, n), jnp.int32), S((b, n, 3 * d), jnp.bfloat16), fut)
    assert ttt.logits_rbnv is None and shape(ttt.hidden_rbnd) == (7, b, n, d)


def test_param_count_command():
    res = subprocess.run([sys.executable, "-m", "launch.param_count", "--config", "configs/tiny.py:eagle3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-2000:]
    counts = param_counts(model_spec_from_config(_load("tiny", "eagle3")))
    assert "tiny / eagle3" in res.stdout
    assert f"{counts['target']:,}" in res.stdout and f"{counts['draft']:,}" in res.stdout
