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


def test_only_a_cpu_program_is_flattened():
    """The 2-D reshape is XLA:CPU's workaround: compiled for a TPU or a GPU, a rank-4 top-k stays one rank-4 TopK
    (XLA:TPU held the flattened copy: DFlash2's 8B step on v5e-8 needed 1.8 GiB a chip more), decided by the
    platform compiled for (``devices.compiling_for``), not the host's."""
    from confu_jax.devices import compiling_for

    x = jax.ShapeDtypeStruct((2, 3, 5, 300), jnp.float32)
    for platform, want in (("cpu", [(30, 300)]), ("tpu", [(2, 3, 5, 300)]), ("gpu", [(2, 3, 5, 300)])):
        with compiling_for(platform):
            jaxpr = jax.make_jaxpr(lambda a: top_k(a, 4))(x)
        shapes = [tuple(e.invars[0].aval.shape) for e in jaxpr.eqns if e.primitive.name == "top_k"]
        assert shapes == want, (platform, shapes)
