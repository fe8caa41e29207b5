"""The blockwise XLA attention (the default 'xla' path) against the concatenating reference.

``masked_attention_reference`` is the definition; ``masked_attention_blockwise`` computes the same
softmax block by block (cache / prefix / block merged by their maxima, native-dtype operands,
query chunks for long blocks). Cases are the kernel tests' (cache/prefix/block combinations,
ragged and per-query lengths, GQA, bf16, rows that see nothing), plus chunked prefill and
gradients (training differentiates this path).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.kernels.attention_reference import AttendTo, masked_attention_reference
from confu_jax.kernels.blockwise_attention import masked_attention_blockwise
from tests.helpers.attention_cases import CASES, make_inputs

_FAST = {"xla_backend_optimization_level": 0}
_ref = jax.jit(lambda a: masked_attention_reference(*a), compiler_options=_FAST)
_blk = jax.jit(lambda a, q_chunk: masked_attention_blockwise(*a, q_chunk=q_chunk), static_argnums=1,
               compiler_options=_FAST)


def _tol(dtype):
    # bf16: the reference upcasts operands before its dots; blockwise keeps them bf16 (f32 accumulate)
    return dict(atol=2e-2, rtol=2e-2) if dtype == "bfloat16" else dict(atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_blockwise_matches_reference(case):
    args = make_inputs(case)
    out = _blk(args, 512)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(_ref(args), np.float32), **_tol(case.dtype))


@pytest.mark.parametrize("q_chunk", [2, 4, 7])
def test_chunked_queries_equal_unchunked(q_chunk):
    """Query chunks (prefill of a long block): the same output, T not a multiple of the chunk."""
    case = [c for c in CASES if c.name == "gqa3_tree_per_query_lengths"][0]
    args = make_inputs(case)
    np.testing.assert_allclose(np.asarray(_blk(args, q_chunk)), np.asarray(_blk(args, 512)), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(_blk(args, q_chunk)), np.asarray(_ref(args)), atol=2e-6, rtol=2e-5)


def test_causal_prefill_chunked_equals_reference():
    """A 64-token causal prefill with no cache, chunks of 16: [16, 64] block scores at a time."""
    rng = np.random.default_rng(1)
    b, t, hq, hkv, d = 2, 64, 6, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d), np.float32)) for h in (hq, hkv, hkv))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    args = (q, k, v, AttendTo(mask=mask))
    np.testing.assert_allclose(np.asarray(_blk(args, 16)), np.asarray(_ref(args)), atol=2e-6, rtol=2e-5)


def test_rows_that_see_nothing_are_zero():
    c = dataclasses.replace(CASES[0], lens=(0, 9))
    q, kb, vb, to = make_inputs(c)
    out = np.asarray(_blk((q, kb, vb, dataclasses.replace(to, mask=to.mask.at[0, 2].set(False))), 512))
    np.testing.assert_array_equal(out[0, 2], 0.0)
    assert np.isfinite(out).all() and np.abs(out[0, 3]).max() > 0


@pytest.mark.slow
def test_gradients_match_reference():
    """Training differentiates this path: d/d(q, block K/V, prefix K/V) equal the reference's."""
    args = make_inputs(CASES[0])
    w = jax.random.normal(jax.random.PRNGKey(0), args[0].shape)

    to = args[3]

    def loss(fn, q, kb, vb, kp, vp):
        return jnp.sum(fn(q, kb, vb, dataclasses.replace(to, k_prefix=kp, v_prefix=vp)) * w)

    diff = (0, 1, 2, 3, 4)
    g_ref = jax.grad(lambda *x: loss(masked_attention_reference, *x), diff)(*args[:3], to.k_prefix, to.v_prefix)
    g_blk = jax.grad(lambda *x: loss(masked_attention_blockwise, *x), diff)(*args[:3], to.k_prefix, to.v_prefix)
    for a, b in zip(g_ref, g_blk):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_no_concatenated_scores_in_the_decode_program():
    """The compiled T=1 decode attention over a 1024-slot cache builds no [.., S + P + T] tensor:
    the cache's scores stay [.., 1024] and nothing is concatenated."""
    b, hq, hkv, d, s, p = 1, 6, 2, 16, 1024, 3
    rng = np.random.default_rng(0)
    n = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32))  # noqa: E731
    args = (n(b, 1, hq, d), n(b, 1, hkv, d), n(b, 1, hkv, d),
            AttendTo(mask=jnp.ones((b, 1, 1), bool), k_cache=n(b, hkv, s, d), v_cache=n(b, hkv, s, d),
                     cache_len=jnp.full((b,), 700, jnp.int32), k_prefix=n(p, hkv, d), v_prefix=n(p, hkv, d),
                     prefix_visible=jnp.ones((b, 1), bool)))
    hlo = jax.jit(masked_attention_blockwise).lower(*args).compile().as_text()
    assert " concatenate(" not in hlo
    assert f"{s + p + 1}]" not in hlo and f"{s + p + 1}," not in hlo
