"""The nucleus (top-p) filter without a sort, against the sorted definition it replaces.

Reference: numpy in float64 — sort descending, keep a token iff the mass strictly above it is below
``top_p`` (the token that crosses the threshold is kept), ties at the boundary kept together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.sampling import nucleus_threshold, target_probs


def nucleus_reference(probs, top_p):
    """Kept mask per row by the sorted definition (float64)."""
    probs = np.asarray(probs, np.float64)
    keep = np.zeros(probs.shape, bool)
    for idx in np.ndindex(probs.shape[:-1]):
        p = probs[idx]
        order = np.argsort(-p, kind="stable")
        above = np.cumsum(p[order]) - p[order]
        thresh = p[order][above < top_p].min()
        keep[idx] = p >= thresh
    return keep


def _softmax64(logits):
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_nucleus_matches_sorted_definition(top_p, spread):
    logits = spread * jax.random.normal(jax.random.PRNGKey(int(top_p * 1000)), (6, 3, 2000))
    got = np.asarray(target_probs(logits, 1.0, top_p))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    keep = nucleus_reference(probs, top_p)
    np.testing.assert_array_equal(got > 0, keep)
    want = np.where(keep, probs, 0.0)
    want = want / want.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_nucleus_keeps_ties_together_and_the_crossing_token():
    # probabilities 0.4, 0.2, 0.2, 0.1, 0.1 (exact logs): at top_p 0.5 the crossing token is a 0.2,
    # and its tie is kept with it; at top_p 0.4 only the first (mass above the second 0.4 = 0.4).
    p = np.array([0.4, 0.2, 0.1, 0.2, 0.1], np.float32)
    logits = jnp.log(jnp.asarray(p))[None]
    np.testing.assert_array_equal(np.asarray(target_probs(logits, 1.0, 0.5))[0] > 0,
                                  [True, True, False, True, False])
    np.testing.assert_array_equal(np.asarray(target_probs(logits, 1.0, 0.4))[0] > 0,
                                  [True, False, False, False, False])
    np.testing.assert_array_equal(np.asarray(target_probs(logits, 1.0, 0.41))[0] > 0,
                                  [True, True, False, True, False])
    # many exact ties: all-equal logits keep everything at any top_p
    flat = jnp.zeros((2, 64))
    np.testing.assert_allclose(np.asarray(target_probs(flat, 1.0, 0.1)), 1 / 64, rtol=1e-6)


def test_threshold_is_one_of_the_probabilities():
    logits = 2.0 * jax.random.normal(jax.random.PRNGKey(3), (4, 5000))
    probs = jax.nn.softmax(logits, axis=-1)
    th = np.asarray(nucleus_threshold(probs, 0.9))
    for row, t in zip(np.asarray(probs), th[:, 0]):
        assert t in row


def test_top_p_one_and_greedy():
    logits = jax.random.normal(jax.random.PRNGKey(1), (3, 100))
    np.testing.assert_allclose(np.asarray(target_probs(logits, 0.7, 1.0)),
                               _softmax64(np.asarray(logits) / 0.7), rtol=1e-5, atol=1e-8)
    greedy = np.asarray(target_probs(logits, 0.0, 0.3))
    np.testing.assert_array_equal(greedy, np.eye(100)[np.argmax(np.asarray(logits), -1)])


def test_traced_settings_one_program():
    f = jax.jit(target_probs)
    logits = jax.random.normal(jax.random.PRNGKey(2), (2, 300))
    for t, p in [(1.0, 1.0), (1.0, 0.5), (0.0, 0.5)]:
        ref = target_probs(logits, t, p)
        np.testing.assert_allclose(np.asarray(f(logits, t, p)), np.asarray(ref), rtol=1e-6)
    assert f._cache_size() == 1
