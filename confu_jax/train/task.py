"""What the training loop needs to know about *what* it trains, as one object.

The loop (mesh, optimizer, sharded step, checkpoints, multi-host, logging) is generic; a task
supplies the model, the objective and the data. ``config.train.task`` names the function that
builds a :class:`TrainTask` from the full config (a family's name in ``train.tasks.TASKS``, or
``"package.module:function"`` for a task outside the package), so every family's objective and the
small test task plug in without touching the loop.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import ml_collections

from confu_jax import sharding as shd
from confu_jax.train.streams import DataIterator


@dataclasses.dataclass
class TrainTask:
    # rng -> trainable params (jittable; the loop jits it with the params' shardings).
    init_params: Callable[[jax.Array], Any]
    # ShapeDtypeStruct tree of the frozen target params.
    frozen_abstract: Any
    # shardings tree -> frozen params as global jax.Arrays laid out on those shardings.
    load_frozen: Callable[[Any], Any]
    # (trainable, frozen, batch, rng) -> (loss, metrics dict of scalars).
    loss_fn: Callable
    # (process_index, process_count) -> DataIterator.
    train_iterator: Callable[[int, int], DataIterator]
    # (process_index, process_count) -> list of this process's held-out batches, or None.
    eval_batches: Optional[Callable[[int, int], list]] = None
    # (trainable, frozen, batch, rng) -> metrics incl. 'acceptance_length'; default: loss_fn's.
    eval_fn: Optional[Callable] = None
    # Path-pattern -> logical-axes rules and per-axis units (confu_jax.sharding).
    param_rules: Sequence = shd.PARAM_RULES
    axis_units: dict = dataclasses.field(default_factory=dict)
    # Training rows in one pass over the data, where the data knows it (an offline feature store);
    # the loop then logs 'epoch' (rows read / rows per epoch) beside the loss. None: not known
    # (packed or streamed rows), not logged.
    rows_per_epoch: Optional[int] = None
    # Non-trainable arrays saved with every checkpoint (e.g. the draft vocabulary d2t / t2d).
    extra_arrays: dict = dataclasses.field(default_factory=dict)
    # Identity of the frozen target (``confu_jax.runs.heads.target_fingerprint``) and where it came
    # from; written to the workdir's target.json so a head is never decoded with another target.
    # A callable takes the loaded frozen tree (targets loaded straight into their shardings).
    target_fingerprint: Any = None
    target_source: str = ""
    description: str = ""


DEFAULT_GLOBAL_BATCH = 16


def data_parallel_devices(config, mesh=None) -> int:
    """Devices the batch is split over (mesh data × fsdp): ``mesh``'s, else ``config.train.mesh``'s on
    this job's devices."""
    if mesh is not None:
        return int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    m = config.train.mesh
    n = jax.device_count()
    fsdp, tensor = int(m.fsdp), int(m.tensor)
    data = int(m.data) if int(m.data) > 0 else n // max(fsdp * tensor, 1)
    if data * fsdp * tensor > n or data < 1:
        raise ValueError(f"config.train.mesh data={m.data} x fsdp={fsdp} x tensor={tensor} needs "
                         f"{max(data, 1) * fsdp * tensor} devices; this job has {n} (jax.device_count(); "
                         "--cpu_devices N on a CPU machine)")
    return max(data * fsdp, 1)


def resolve_run_config(config, mesh=None, strict: bool = True) -> ml_collections.FrozenConfigDict:
    """The run's config with what a config leaves to the run settled, as a frozen value: the target's
    architecture, dtypes and draft vocabulary from its checkpoint (``target_loading.resolve_target``)
    and ``data.global_batch_size`` 0 -> 16 rounded up to a multiple of the data-parallel devices. An
    explicit batch that does not divide over them is refused (``strict``), naming both numbers.
    ``mesh``: the run's mesh when the caller has one (else ``config.train.mesh``'s).

    Resolved once: the caller's config is not changed, and a frozen config (one this returned) comes
    back as is, so the launcher, the loop, the task and the resume check all read the same value and
    none can change it. Runs before the resume check, which compares resolved values with the saved
    config.json."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        return config
    config = copy.deepcopy(config)
    _resolve_in_place(config, mesh, strict)
    return ml_collections.FrozenConfigDict(config)


def _resolve_in_place(config, mesh, strict: bool) -> None:
    if "model" in config and "source" in config.model:
        from confu_jax.train.target_loading import resolve_target

        resolve_target(config)
    if "data" not in config or "global_batch_size" not in config.data or "train" not in config:
        return
    g = int(config.data.global_batch_size)
    if not strict and g > 0:  # settled already (by the caller, on its mesh: a topology's, say)
        return
    dp = data_parallel_devices(config, mesh)
    if g <= 0:
        with config.unlocked():
            config.data.global_batch_size = -(-DEFAULT_GLOBAL_BATCH // dp) * dp
    elif g % dp:
        raise ValueError(f"data.global_batch_size={g} does not divide over the {dp} data-parallel devices "
                         f"(mesh data x fsdp of {jax.device_count()} devices): use a multiple of {dp}, or 0 for "
                         f"the default ({-(-DEFAULT_GLOBAL_BATCH // dp) * dp})")
    g = int(config.data.global_batch_size)
    if g % jax.process_count():
        raise ValueError(f"data.global_batch_size={g} does not divide over {jax.process_count()} processes")


def task_data(config, spec, target_host):
    """(draft vocab, train_iterator, eval_batches) of a run whose data the target alone decides: shape-only
    batches for an abstract target (``model.source='abstract'``), self-distilled random prompts for
    ``'random'``, else ``config.data``'s conversations."""
    from confu_jax.train.real_data import real_data
    from confu_jax.train.synthetic_data import abstract_data, synthetic_data
    from confu_jax.train.target_loading import is_abstract

    if is_abstract(config.model.source):
        return abstract_data(config, spec)
    if config.model.source == "random":
        return synthetic_data(config, spec, target_host)
    return real_data(config, spec)


def frozen_target_task(config, *, pack_ok: bool, what: str, build, spec_fn=None,
                       init_reads_target: bool = False) -> TrainTask:
    """The task of a drafter family trained on a frozen target alone (Medusa, the MLP speculator, the
    MTP module, DFlash): the target loaded as ``config.model`` says, the data (self-distilled random prompts
    for ``source='random'``, else ``config.data``'s conversations; packed rows only when ``pack_ok``),
    held-out evaluation with the loss function's metrics, the target's fingerprint.

    ``build(spec, target_host) -> (init_params, loss_fn, description)``: the family's parameters
    (rng -> ``{'draft': ...}``), its ``loss_fn(trainable, frozen, batch, rng)`` (``frozen['target']``
    is the target) and the run's description (the data source is appended). ``spec_fn(config)``: the
    family's ``ModelSpec`` (default ``model_spec_from_config``; DFlash sizes its draft model there).
    A Hugging Face target is loaded straight into its shardings when the run starts, unless
    ``init_reads_target`` (the family initialises from the target's weights: Medusa's LM head, MTP's
    layer): then ``build`` gets the host weights. An abstract target (``model.source='abstract'``:
    shapes only, ``launch.train --compile_only``'s "does it fit?") gets shape-only batches, and a
    family that initialises from the target's weights initialises from zeros of their shapes inside the
    traced init (what the step compiles to depends on the shapes alone; nothing is allocated on a host)."""
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.train.target_loading import is_abstract, load_target, load_target_sharded, sharded_source

    synthetic = config.model.source == "random"
    abstract = is_abstract(config.model.source)
    if config.data.get("pack", False) and (synthetic or not pack_ok):
        why = "the self-distilled random data are padded rows" if pack_ok else f"{what} training reads padded rows only"
        raise ValueError(f"config.data.pack: {why} (turn data.pack off)")
    if config.model.attention_impl != "xla":
        raise ValueError(f"config.model.attention_impl={config.model.attention_impl!r} cannot train; use 'xla'")
    sharded = sharded_source(config) and not init_reads_target
    if sharded:  # a Hugging Face target: loaded straight into its shardings when the run starts
        from confu_jax.models.llama import param_shapes

        spec = (spec_fn or model_spec_from_config)(config)
        target_host = param_shapes(spec.target)
    else:
        spec, target_host = load_target(config, (spec_fn or model_spec_from_config)(config))
    _, train_iterator, eval_batches = task_data(config, spec, target_host)
    init_params, loss_fn, description = build(spec, target_host)
    if abstract and init_reads_target:
        def init_params(rng):  # noqa: F811 -- the family's init, on zeros of the target's shapes
            zeros = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), target_host)
            return build(spec, zeros)[0](rng)

    def eval_fn(trainable, frozen, batch, rng):
        return loss_fn(trainable, frozen, batch, rng)[1]

    frozen_host = {"target": target_host}
    data = "self-distilled random data" if synthetic else config.data.train_files
    return TrainTask(
        init_params=init_params,
        frozen_abstract=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), frozen_host),
        load_frozen=(lambda shardings: shd.with_shardings(frozen_host, shardings)) if abstract
        else (lambda shardings: {"target": load_target_sharded(config, spec, shardings["target"])}) if sharded
        else (lambda shardings: shd.put_tree(frozen_host, shardings)),
        loss_fn=loss_fn,
        train_iterator=train_iterator,
        eval_batches=eval_batches if int(config.objective.eval_batches) > 0 and eval_batches else None,
        eval_fn=eval_fn,
        axis_units=shd.llama_axis_units(spec.target.head_dim),
        target_fingerprint=None if abstract else (lambda frozen: target_fingerprint(frozen["target"])) if sharded
        else target_fingerprint(target_host),
        target_source=str(config.model.source),
        description=f"{description} ({data})",
    )
