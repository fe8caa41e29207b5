"""The trainable state of a run: everything a resume must restore, and nothing frozen.

The frozen target's parameters are deliberately NOT a field: they are passed to the step as a
separate argument, so they never reach ``jax.grad``, the optimizer (no Adam moments for 8B frozen
weights) or the checkpoint (the target is reloaded from its own files).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # trainable params
    opt_state: Any
    rng: jax.Array  # uint32 [2] raw PRNG key (raw, so checkpoints hold plain arrays)


def create_train_state(params, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """Fresh state; jit it with ``out_shardings`` to build it directly in sharded form."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jnp.asarray(rng, jnp.uint32))


def state_builder(init_params_fn, tx: optax.GradientTransformation, seed: int):
    """Zero-argument function building the initial state from ``seed``.

    ``jax.eval_shape`` of it gives the abstract state (shardings, AOT compile, restore targets);
    ``jax.jit(..., out_shardings=...)`` of it builds the state directly in sharded form, on
    every process, without ever materialising an unsharded copy.
    """
    def build():
        init_rng, state_rng = jax.random.split(jax.random.PRNGKey(seed))
        return create_train_state(init_params_fn(init_rng), tx, state_rng)

    return build


def param_count(tree) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(tree)))
