"""Flash-form training attention (``kernels.flash_attention``) against the dense definition.

Values and gradients (queries, keys, values, and through the log-sum-exp output) equal a dense
softmax over an explicit [B, T, S] mask: GQA, padding, packed rows (segment ids), rows that see
nothing, several key blocks with a ragged last one; and the draft's training attention in flash form
(shared keys + per-query keys merged by log-sum-exp) equals the dense ``draft_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.kernels.attention_reference import NEG_INF
from confu_jax.kernels.flash_attention import CausalSegments, flash_attention


def dense(q, k, v, mask_bts):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    kk = jnp.repeat(k, hq // hkv, axis=2).astype(jnp.float32)
    vv = jnp.repeat(v, hq // hkv, axis=2).astype(jnp.float32)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kk) / d ** 0.5
    vis = mask_bts[:, None]
    s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, -1, keepdims=True)
    out = jnp.einsum("bhts,bshd->bthd", p / jnp.where(l > 0, l, 1.0), vv)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), NEG_INF)
    return out, jnp.moveaxis(lse, 1, 2)


def _inputs(b=2, t=37, hq=4, hkv=2, d=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (b, t, hq, d)), jax.random.normal(ks[1], (b, t, hkv, d)),
            jax.random.normal(ks[2], (b, t, hkv, d)))


SEGMENTS = np.array([[1] * 10 + [2] * 20 + [0] * 7,  # two conversations and padding (segment 0)
                     [1] * 37])


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block_k,q_chunk", [(8, 5), (16, 16), (64, 64)])
def test_values_and_gradients_equal_dense(packed, block_k, q_chunk):
    q, k, v = _inputs()
    seg = jnp.asarray(SEGMENTS) if packed else None
    mask = CausalSegments(seg).dense(2, 37)
    w_out = jax.random.normal(jax.random.PRNGKey(5), q.shape)
    w_lse = jax.random.normal(jax.random.PRNGKey(6), q.shape[:3])

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * w_out) + jnp.sum(jnp.where(lse > NEG_INF / 2, lse, 0.0) * w_lse)
        return f

    flash = lambda q, k, v: flash_attention(q, k, v, segment_ids_bt=seg, block_k=block_k,
                                            q_chunk=q_chunk, return_lse=True)
    ref = lambda q, k, v: dense(q, k, v, mask)
    (o1, l1), (o2, l2) = flash(q, k, v), ref(q, k, v)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-5)
    g1 = jax.grad(loss(flash), argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, b_ in zip(g1, g2):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_rows_that_see_nothing_are_zero_with_zero_gradient():
    """Non-causal attention to keys of another segment only: a query whose segment has no key sees
    nothing — output 0, lse NEG_INF, and no gradient flows to or from it."""
    q, k, v = _inputs(t=12)
    seg_q = jnp.asarray([[1] * 6 + [3] * 6, [2] * 12])
    seg_k = jnp.asarray([[1] * 12, [1] * 12])
    out, lse = flash_attention(q, k, v, segment_ids_bt=seg_q, key_segment_ids_bs=seg_k, causal=False,
                               block_k=5, q_chunk=7, return_lse=True)
    assert np.all(np.asarray(out)[0, 6:] == 0) and np.all(np.asarray(out)[1] == 0)
    assert np.all(np.asarray(lse)[0, 6:] == NEG_INF) and np.all(np.asarray(lse)[0, :6] > NEG_INF / 2)
    gq = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, segment_ids_bt=seg_q, key_segment_ids_bs=seg_k,
                                                   causal=False, block_k=5)))(q)
    assert np.all(np.asarray(gq)[0, 6:] == 0) and np.all(np.isfinite(np.asarray(gq)))
    ref, _ = dense(q, k, v, (seg_q[:, :, None] == seg_k[:, None, :]))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_bf16_operands_accumulate_in_float32():
    """bf16 q/k/v (how a GPU trains): within bf16 rounding of the float32 result."""
    q, k, v = _inputs(t=64)
    mask = CausalSegments(None).dense(2, 64)
    ref, _ = dense(q, k, v, mask)
    out = flash_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), block_k=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.05)


def test_memory_is_linear_in_the_row():
    """The compiled forward+backward holds [q_chunk, block_k] scores, not [T, T]: quadrupling the row
    multiplies its temporaries by well under 16 (dense attention's factor), here close to 4."""
    def temp(t):
        q, k, v = (jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32),) * 3
        f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, block_k=128, q_chunk=128)), argnums=(0, 1, 2)))
        return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large < 5 * small, (small, large)
    assert large < 4096 * 4096 * 4 * 4 / 4, large  # far below one [H, T, T] float32 score tensor


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_draft_flash_form_equals_the_dense_draft_attention(packed):
    """A TTT step's attention: shared step-0 keys (causal within a segment) + X per-query keys (the
    future entry with its learned bias, the diagonal; some masked), values, per-query-key weights and
    gradients of every input equal ``draft_attention`` over the explicit [B, T, T] mask."""
    from confu_jax.models.draft_attention import draft_attention, draft_attention_flash

    q, k, v = _inputs(t=37, seed=3)
    ks = jax.random.split(jax.random.PRNGKey(9), 3)
    kx = jax.random.normal(ks[0], (2, 37, 3, 2, 8))
    vx = jax.random.normal(ks[1], (2, 37, 3, 2, 8))
    mx = jax.random.bernoulli(ks[2], 0.6, (2, 37, 3)).at[:, :, 1].set(True)
    bias = jnp.asarray([[0.5, 0.0, 0.0], [-1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    seg = jnp.asarray(SEGMENTS) if packed else None
    mask = CausalSegments(seg).dense(2, 37)
    w = jax.random.normal(jax.random.PRNGKey(4), q.shape)
    w2 = jax.random.normal(jax.random.PRNGKey(7), (2, 37, 4, 3))

    def run(flash):
        def f(q, k, v, kx, vx, bias):
            if flash:
                out, wx = draft_attention_flash(q, k, v, seg, kx, vx, mx, bias_hx=bias, extra_weights=True, block_k=16)
            else:
                out, wx = draft_attention(q, k, v, mask, kx, vx, mx, bias_hx=bias, extra_weights=True, q_chunk=0)
            return jnp.sum(out * w) + jnp.sum(wx * w2), (out, wx)
        return f

    (l1, (o1, x1)), g1 = jax.value_and_grad(run(True), argnums=range(6), has_aux=True)(q, k, v, kx, vx, bias)
    (l2, (o2, x2)), g2 = jax.value_and_grad(run(False), argnums=range(6), has_aux=True)(q, k, v, kx, vx, bias)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x1, x2, rtol=1e-5, atol=1e-6)
    for a, b_ in zip(g1, g2):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5)
