"""``train.dflash_task.over_anchor_chunks``: DFlash2's and Domino's losses computed a chunk of anchors at a
time (``<family>.anchor_chunk``, what bounds their [anchors × slots × vocabulary] terms at an 8B vocabulary)
give the loss, every metric and every gradient of the whole-block computation, on the same parameters, batch and
anchors — in chunks that divide the anchors and in a size that does not (3 of 8: chunks of 2)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from confu_jax.train.loop import setup_run
from tests.helpers.train_resume import short_run_config


def _loss_and_grads(get_config, family: str, chunk: int):
    config = short_run_config(get_config, **{f"{family}.anchor_chunk": chunk})
    run = setup_run(config)
    trainable = run.task.init_params(jax.random.PRNGKey(0))
    batch = next(run.task.train_iterator(0, 1))
    rng = jax.random.PRNGKey(5)

    def f(t, batch):
        return run.task.loss_fn(t, run.frozen, batch, rng)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(trainable, batch)
    return config[family].num_anchors, float(loss), jax.device_get(metrics), jax.device_get(grads)


@pytest.mark.slow  # > 6 s (two loss-and-gradient compiles)
@pytest.mark.parametrize("family", ["dflash2", "domino"])
def test_chunked_anchors_give_the_whole_blocks_loss_and_gradients(family):
    from importlib import import_module

    get_config = import_module(f"configs.tiny_{family}").get_config
    n, loss, metrics, grads = _loss_and_grads(get_config, family, 0)
    assert n == 8, n  # the tiny config's anchors (its own anchor_chunk: 4)
    moved = [float(np.abs(g).max()) for g in jax.tree_util.tree_leaves(grads)]
    assert np.isfinite(loss) and max(moved) > 0
    for chunk in (2, 3):  # 4 chunks of 2; 3 divides no 8: the largest divisor below it, 2
        _, loss_c, metrics_c, grads_c = _loss_and_grads(get_config, family, chunk)
        assert loss_c == pytest.approx(loss, rel=1e-5, abs=1e-6), chunk
        assert metrics_c.keys() == metrics.keys()
        for key in metrics:
            np.testing.assert_allclose(metrics_c[key], metrics[key], rtol=1e-5, atol=1e-6, err_msg=f"{chunk} {key}")
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads_c, grads)
