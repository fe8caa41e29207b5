"""The sharded training step: pure function, jitted with explicit shardings, compiled ahead of time.

The objective is injected: ``loss_fn(trainable, frozen, batch, rng) -> (loss, metrics)`` where
``metrics`` is a dict of scalars (convention: ``loss/step{s}``, ``acc/step{s}`` per TTT step).
The step differentiates with respect to ``trainable`` only; ``frozen`` (the target) is an input
that is never donated, never updated and never seen by the optimizer.

Like MaxText's ``jit_train_step``, the step is lowered and compiled once for the abstract shapes
and shardings of (state, frozen, batch), so a shape or sharding drift between steps is an
immediate error rather than a silent recompilation.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from confu_jax.sharding import activation_mesh
from confu_jax.train.state import TrainState

LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, dict]]
EvalFn = Callable[[Any, Any, Any, jax.Array], dict]


def train_step_fn(loss_fn: LossFn, tx: optax.GradientTransformation,
                  schedule: Optional[optax.Schedule] = None):
    """The pure step ``(state, frozen, batch) -> (state, metrics)``."""

    def train_step(state: TrainState, frozen, batch):
        rng, step_rng = jax.random.split(state.rng)
        if isinstance(batch, dict):  # the optimizer step, for objectives with a schedule of their own
            batch = dict(batch, step=state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, frozen, batch, step_rng)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(grads)  # before clipping
        metrics["update_norm"] = optax.tree.norm(updates)
        if isinstance(batch, dict) and "attention_mask" in batch:  # non-padding positions (real tokens/s)
            metrics["tokens/real"] = jnp.sum(batch["attention_mask"].astype(jnp.float32))
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return train_step


def eval_step_fn(eval_fn: EvalFn):
    """``(state, frozen, batch) -> metrics`` with a fixed key (evaluation is deterministic)."""

    def eval_step(state: TrainState, frozen, batch):
        return eval_fn(state.params, frozen, batch, jax.random.PRNGKey(0))

    return eval_step


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


class CompiledStep:
    """A step compiled for fixed shardings; call as ``step(state, batch)``.

    Holds the frozen params (already placed on the mesh) so callers see the issue's
    ``train_step(state, batch) -> (state, metrics)``; ``lowered``/``compiled`` are exposed for
    inspection (HLO, cost analysis, memory analysis).
    """

    def __init__(self, jitted, lowered, compiled, frozen, fn=None, abstract_args=(), mesh=None):
        self.jitted = jitted
        self.lowered = lowered
        self.compiled = compiled
        self.frozen = frozen
        self._fn, self._abstract_args, self._mesh = fn, abstract_args, mesh

    def matmul_flops(self) -> float:
        """Matrix-product FLOPs of one step over all devices (``train.throughput.matmul_flops``: scans
        multiplied out, which XLA's cost analysis does not do); traced again, not run."""
        from confu_jax.train.throughput import matmul_flops

        with activation_mesh(self._mesh, train=True):
            return matmul_flops(self._fn, *self._abstract_args)

    def __call__(self, state, batch):
        return self.compiled(state, self.frozen, batch)

    def memory_report(self) -> Optional[dict]:
        """Bytes one device holds while the step runs, from XLA's buffer assignment: ``arguments``
        (state + frozen + batch shards), ``outputs``, ``temp`` (activations, gradients, scratch),
        ``aliased`` (outputs written into donated arguments) and ``peak_estimate`` = arguments +
        outputs − aliased + temp. None where the backend reports nothing. On GPU, XLA
        rematerialises further when the peak exceeds the device, so a CPU compile overestimates
        a GPU's need rather than underestimating it."""
        m = self.compiled.memory_analysis()
        if m is None:
            return None
        r = dict(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
                 temp=int(m.temp_size_in_bytes), aliased=int(m.alias_size_in_bytes))
        r["peak_estimate"] = r["arguments"] + r["outputs"] - r["aliased"] + r["temp"]
        return r


def _compile(fn, mesh: Mesh, state, state_shardings, frozen, frozen_shardings, batch,
             out_state: bool, donate: bool) -> CompiledStep:
    batch_shardings = jax.tree_util.tree_map(lambda x: x.sharding, batch)
    metrics_sharding = NamedSharding(mesh, P())  # prefix: every metric replicated
    out_shardings = (state_shardings, metrics_sharding) if out_state else metrics_sharding
    jitted = jax.jit(
        fn,
        in_shardings=(state_shardings, frozen_shardings, batch_shardings),
        out_shardings=out_shardings,
        donate_argnums=(0,) if donate else (),
    )
    args = (_abstract(state, state_shardings), _abstract(frozen, frozen_shardings), _abstract(batch, batch_shardings))
    with activation_mesh(mesh, train=True):  # confu_jax.sharding.constrain() is live while tracing
        lowered = jitted.lower(*args)
    return CompiledStep(jitted, lowered, lowered.compile(), frozen, fn, args, mesh)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh, *,
                    state, state_shardings, frozen, frozen_shardings, batch,
                    schedule: Optional[optax.Schedule] = None, donate: bool = True) -> CompiledStep:
    """Compile the train step for ``state``/``frozen``/``batch`` (arrays or ShapeDtypeStructs).

    ``batch`` leaves must carry their shardings (``confu_jax.sharding.global_batch`` output or
    ShapeDtypeStructs with ``sharding``). The state is donated: its buffers are reused for the
    new state, so the caller must not touch the old state after a call.
    """
    return _compile(train_step_fn(loss_fn, tx, schedule), mesh, state, state_shardings,
                    frozen, frozen_shardings, batch, out_state=True, donate=donate)


def make_eval_step(eval_fn: EvalFn, mesh: Mesh, *, state, state_shardings, frozen,
                   frozen_shardings, batch) -> CompiledStep:
    return _compile(eval_step_fn(eval_fn), mesh, state, state_shardings, frozen,
                    frozen_shardings, batch, out_state=False, donate=False)
