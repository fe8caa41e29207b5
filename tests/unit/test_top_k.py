"""``models.top_k``: the decode trees' and DFlash2's top-k equals a stable sort's first k (values and indices,
ties to the lower index) at every rank, on tie-heavy rows with -inf entries (the masked draft vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.top_k import top_k


def _stable_sort_top_k(x, k):
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, order, -1), order


@pytest.mark.parametrize("shape,k", [((7, 50), 5), ((3, 4, 64), 8), ((2, 3, 5, 300), 16), ((2, 49152), 7)])
def test_top_k_is_the_stable_sorts_first_k(shape, k):
    rng = np.random.default_rng(sum(shape) + k)
    x = rng.integers(-3, 3, shape).astype(np.float32)  # six values: ties everywhere
    x[rng.random(shape) < 0.1] = -np.inf
    want_v, want_i = _stable_sort_top_k(x, k)
    for f in (top_k, jax.jit(top_k, static_argnums=1)):
        v, i = f(jnp.asarray(x), k)
        assert i.dtype == jnp.int32 and v.shape == i.shape == shape[:-1] + (k,)
        np.testing.assert_array_equal(np.asarray(i), want_i)
        np.testing.assert_array_equal(np.asarray(v), want_v)


def test_every_program_gets_one_two_dimensional_top_k():
    """The reshape is taken whatever the platform compiled for (``models.top_k`` says why; the compile lane checks
    what XLA:TPU and XLA:GPU make of it): the ``top_k`` primitive sees [rows, N], never the caller's rank."""
    from confu_jax.devices import compiling_for

    x = jax.ShapeDtypeStruct((2, 3, 5, 300), jnp.float32)
    for platform in ("cpu", "tpu", "gpu"):
        with compiling_for(platform):
            jaxpr = jax.make_jaxpr(lambda a: top_k(a, 4))(x)
        shapes = [tuple(e.invars[0].aval.shape) for e in jaxpr.eqns if e.primitive.name == "top_k"]
        assert shapes == [(30, 300)], (platform, shapes)
