"""The CPU few-row matmul (``kernels.cpu_matmul``): exact math against a float64 reference, rows
independent of how many are multiplied together (the AR step and the verification pass agree bit
for bit), and the packed decode layout equal to the stacked forward and to the unpacked one."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.plans import parse_plan
from confu_jax.kernels import cpu_matmul
from confu_jax.models.llama import PACKED_LM_HEAD, Llama, init_params
from confu_jax.models.presets import get_preset
from confu_jax.models.unrolled import apply_unrolled, prepared_layers, split_layers
from tests.helpers.loop_fixtures import make, prompts_for

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler: XLA's dots are used")

# [in, out]: SmolLM2's projections and a vocabulary slice, and widths that do not fill a panel
SHAPES = [(576, 1536), (1536, 576), (576, 192), (64, 100), (33, 7)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 40]


@pytest.mark.parametrize("i,o", SHAPES)
def test_packed_matmul_equals_float64_reference(i, o):
    rng = np.random.default_rng(i * 1000 + o)
    w = rng.standard_normal((i, o), dtype=np.float32)
    wp = jax.jit(cpu_matmul.pack)(w)
    assert wp.shape == (-(-o // cpu_matmul.PANEL), i, cpu_matmul.PANEL)
    f = jax.jit(cpu_matmul.packed_matmul, static_argnums=2)
    for t in ROWS:
        x = rng.standard_normal((t, i), dtype=np.float32)
        got = np.asarray(f(x, wp, o))
        ref = x.astype(np.float64) @ w.astype(np.float64)
        # float32 sums of i products: |error| <= ~i * eps * sum|x w|
        bound = 4 * i * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
        assert got.shape == (t, o)
        assert np.all(np.abs(got - ref) <= bound + 1e-30), (t, float(np.max(np.abs(got - ref) / (bound + 1e-30))))


def test_each_row_equals_the_row_alone_bit_for_bit():
    """Why the kernel exists beside XLA's dot: a T-row product's row r is the 1-row product of row r
    exactly (one FMA chain per output, whatever T), so verification logits equal AR logits."""
    rng = np.random.default_rng(0)
    for i, o in SHAPES:
        w = rng.standard_normal((i, o), dtype=np.float32)
        wp = cpu_matmul.pack(jnp.asarray(w))
        f = jax.jit(cpu_matmul.packed_matmul, static_argnums=2)
        x = rng.standard_normal((max(ROWS), i), dtype=np.float32)
        alone = np.stack([np.asarray(f(x[r:r + 1], wp, o))[0] for r in range(max(ROWS))])
        for t in ROWS:
            np.testing.assert_array_equal(np.asarray(f(x[:t], wp, o)), alone[:t], err_msg=f"{t} rows, {i}x{o}")


def test_leading_dimensions_and_refusal():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 70), dtype=np.float32)
    x = rng.standard_normal((2, 3, 16), dtype=np.float32)
    got = cpu_matmul.packed_matmul(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(w)), 70)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_matmul.packed_matmul(jnp.asarray(x[..., :8]), cpu_matmul.pack(jnp.asarray(w)), 70)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [get_preset("tiny"),
                                 get_preset("tiny-chat").replace(attention_bias=True, qk_norm=True)],
                         ids=["tied", "untied-bias-qknorm"])
def test_packed_decode_layout_equals_stacked_forward(cfg):
    """Tied and untied (with Qwen's q/k/v biases and q/k norms) targets: the packed split equals the
    stacked forward (float32 rounding) and the unpacked split."""
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    ref = Llama(cfg).apply({"params": params}, tokens, pos, tap_layers=cfg.default_taps)
    packed = jax.jit(lambda p: split_layers(p, cfg, pack=True))(params)
    plain = jax.jit(lambda p: split_layers(p, cfg, pack=False))(params)
    assert cpu_matmul.is_packed(packed.layers[0]["gate_proj"]["kernel"]) and PACKED_LM_HEAD in packed.shared
    assert not cpu_matmul.is_packed(plain.layers[0]["gate_proj"]["kernel"]) and PACKED_LM_HEAD not in plain.shared
    for sp in (packed, plain):
        got = jax.jit(lambda s: apply_unrolled(s, cfg, tokens, pos, tap_layers=cfg.default_taps))(sp)
        for name in ("logits_btv", "hidden_btd", "taps_btc"):
            np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)),
                                       atol=2e-5, rtol=2e-5, err_msg=name)


def test_prepared_layers_made_once_per_target():
    cfg = get_preset("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0))
    a = prepared_layers(params, cfg)
    assert prepared_layers(params, cfg) is a
    assert prepared_layers(a, cfg) is a
    other = jax.tree_util.tree_map(lambda x: x + 0, params)
    assert prepared_layers(other, cfg) is not a


def test_off_switch_keeps_xla_dots(monkeypatch):
    cfg = get_preset("tiny")
    assert cpu_matmul.use_packed(cfg)
    monkeypatch.setenv("CONFU_JAX_CPU_MATMUL", "off")
    cpu_matmul.available.cache_clear()
    try:
        assert not cpu_matmul.use_packed(cfg)
        sp = split_layers(init_params(cfg, jax.random.PRNGKey(0)), cfg)
        assert PACKED_LM_HEAD not in sp.shared
    finally:
        monkeypatch.delenv("CONFU_JAX_CPU_MATMUL")
        cpu_matmul.available.cache_clear()
        assert cpu_matmul.available()


def test_packing_is_a_backend_policy_the_families_register_with():
    """Which drafter weights the CPU path packs is decode.cpu_packing's table, not a method of the Drafter
    contract: the EAGLE-3 / ConFu head registers its dense projections, the hybrid its head's, every other
    family nothing."""
    from confu_jax.decode import cpu_packing, families
    from confu_jax.decode.drafter import Drafter
    from confu_jax.models.draft import DENSE_NAMES

    assert not hasattr(Drafter, "packable_draft")
    parse = {name: rec.parse for name, rec in families.FAMILIES.items()}
    assert cpu_packing.packable_draft(parse["head"]("chain:3")) == DENSE_NAMES
    assert cpu_packing.packable_draft(parse["hybrid"]("chain:3")) == DENSE_NAMES
    for name in ("medusa", "mlp_speculator", "mtp", "lookup"):
        assert cpu_packing.packable_draft(parse[name]("chain:3")) == (), name


@pytest.mark.slow
def test_loop_packs_target_and_head_and_stays_lossless():
    """The loop's CPU entry lays out the target and the EAGLE-3 head packed (once per target), and
    greedy speculative decoding through it equals AR decoding through it, token for token."""
    spec, tp, params = make("eagle3", 96)
    drafter = HeadDrafter(parse_plan("chain:3"))
    _, static = loop.prepare_spec_inputs(spec.target, drafter, prompts_for(96), max_new_tokens=12, eos_ids=())
    target, dp = loop._placed(params.target, params.drafter_params, static)
    assert cpu_matmul.is_packed(target.params.layers[0]["q_proj"]["kernel"])
    assert cpu_matmul.is_packed(dp.weights["q_proj"]["kernel"])
    assert cpu_matmul.is_packed(dp.weights["lm_head"]["kernel"])
    spec_out = loop.generate_speculative(params.target, drafter, params.drafter_params, prompts_for(96),
                                         max_new_tokens=12, eos_ids=())
    ar_out = generate_ar(tp, spec.target, prompts_for(96), max_new_tokens=12, eos_ids=())
    np.testing.assert_array_equal(np.asarray(spec_out.tokens_bn), np.asarray(ar_out.tokens_bn))


def _cxx():
    import shutil

    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler")
def test_the_library_key_follows_the_instruction_set_the_compiler_resolves(tmp_path, monkeypatch):
    """The cache key holds ``-march=native`` as the compiler resolves it (any OS / architecture), so a
    compiler that means another ISA by it (here: a wrapper that asks for baseline x86-64 / armv8-a, as
    an older host would resolve) builds another library instead of loading this host's."""
    real = _cxx()
    base = "x86-64" if os.uname().machine in ("x86_64", "AMD64") else "armv8-a"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nfor a; do shift; [ "$a" = -march=native ] && a=-march={base}; set -- "$@" "$a"; done\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    assert cpu_matmul.isa_id(real) != cpu_matmul.isa_id(str(wrapper))
    monkeypatch.setenv("CONFU_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    here = cpu_matmul._compile()
    monkeypatch.setenv("CXX", str(wrapper))
    other = cpu_matmul._compile()
    assert here != other and here.exists() and other.exists()


@pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler")
def test_a_changed_library_is_rebuilt_never_loaded(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("CONFU_JAX_KERNEL_CACHE", str(tmp_path))
    lib = cpu_matmul._compile()
    built = lib.read_bytes()
    assert lib.with_suffix(".so.sha256").read_text().strip() == hashlib.sha256(built).hexdigest()
    lib.write_bytes(built[: len(built) // 2])  # truncated, or replaced by another host's build
    assert cpu_matmul._compile() == lib and lib.read_bytes() == built
