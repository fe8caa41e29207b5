"""Device mesh and the one table that decides how every array is laid out on it.

Mesh axes are ``('data', 'fsdp', 'tensor')``: batch rows are split over ``data × fsdp``; parameters
are sharded ZeRO-3 style over ``fsdp`` along their model-width dimension and Megatron style over
``tensor`` along heads / MLP / vocabulary. Code never names mesh axes directly: parameters carry
*logical* axes (``'embed'``, ``'heads'``, ...) chosen by path pattern (:data:`PARAM_RULES`), and
:data:`LOGICAL_AXIS_RULES` maps logical to mesh axes. Changing a layout means editing one table.

A dimension that does not divide evenly over its mesh axes (SmolLM2 has 9 query heads; tensor=2)
is replicated instead of failing, so every preset runs on every mesh; :func:`explain` reports where
that happened.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (str), mesh axes (tuple) or None (replicated). THE table.
LOGICAL_AXIS_RULES: dict = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": None,
    "layers": None,
    "norm": None,
    "seq": None,
}

# (path regex, logical axes of the TRAILING dims). Paths are '/'-joined pytree keys; the first
# rule whose regex matches (re.search) and whose rank fits wins. Leading dims beyond the rule's
# rank (nn.scan's layer axis, optimizer-state prefixes do not add dims) are replicated, so one
# rule serves a scanned 30-layer target and an unscanned one-layer draft.
PARAM_RULES: tuple = (
    (r"(^|/)embed(ding)?(/embedding)?$", ("vocab", "embed")),
    (r"(^|/)lm_head/kernel$", ("embed", "vocab")),
    (r"(^|/)q_proj/kernel$", ("embed", "heads")),
    (r"(^|/)(k_proj|v_proj)/kernel$", ("embed", "kv_heads")),
    (r"(^|/)o_proj/kernel$", ("heads", "embed")),
    (r"(^|/)(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"(^|/)down_proj/kernel$", ("mlp", "embed")),
    (r"(^|/)(scale|bias)$", ("norm",)),
    # Embedding-MoE expert tables [n_expert, d].
    (r"(^|/)experts[^/]*$", ("experts", "embed")),
    # Soft prompts / prefix K/V [.., s, Hkv, hd].
    (r"(^|/)(soft_prompt|prefix)[^/]*/?(k|v|keys|values)?$", (None, "kv_heads", None)),
    # Any other dense kernel [in, out]: FSDP over the input width, tensor over the output.
    (r"(^|/)kernel$", ("embed", "mlp")),
)

# Logical axes whose dimension is a flattened (count × unit) product: divisibility is checked on
# the count (heads), not on the flattened size, so 9 heads × 64 never get split mid-head.
DEFAULT_AXIS_UNITS: dict = {}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
    """Mesh over ``devices`` (default: all global devices). One size may be -1 (fill the rest).

    Devices are laid out process-major (``jax.devices()`` order within a process, sorted stably by
    process index), so with several processes the outer 'data' axis spans processes — data
    parallelism, whose only cross-host traffic is the gradient reduction, goes over the slow network
    between hosts, while fsdp / tensor collectives stay inside a host — and each process feeds a
    contiguous block of batch rows (``mesh_layout`` says where each process sits).
    """
    devices = list(jax.devices() if devices is None else devices)
    devices = sorted(devices, key=lambda d: getattr(d, "process_index", 0))  # stable: keeps order within a process
    n = len(devices)
    sizes = [int(data), int(fsdp), int(tensor)]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh sizes (data, fsdp, tensor)={tuple(sizes)}: at most one may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes (data, fsdp, tensor)={tuple(sizes)} must be positive or -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ValueError(
                f"mesh sizes (data, fsdp, tensor)={tuple(sizes)}: {n} devices are not divisible by "
                f"the fixed sizes' product {known}")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(
            f"mesh sizes (data, fsdp, tensor)={tuple(sizes)} need {math.prod(sizes)} devices, "
            f"found {n}")
    dev_arr = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(dev_arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_layout(mesh: Mesh) -> dict:
    """``{"axes": {name: size}, "process_index": nested list [data][fsdp][tensor]}``: which process
    owns each mesh position (written to a run's mesh.json)."""
    procs = np.vectorize(lambda d: int(getattr(d, "process_index", 0)), otypes=[int])(mesh.devices)
    return {"axes": {k: int(v) for k, v in mesh.shape.items()}, "process_index": procs.tolist()}


def path_str(path) -> str:
    """'/'-joined pytree key path ('layers/q_proj/kernel', 'opt_state/0/mu/fc/kernel')."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def logical_axes_for(path: str, ndim: int, rules: Sequence = PARAM_RULES) -> tuple:
    """Logical axes of a leaf (one entry per dim; None = unconstrained -> replicated)."""
    for pattern, axes in rules:
        if len(axes) <= ndim and re.search(pattern, path):
            return (None,) * (ndim - len(axes)) + tuple(axes)
    return (None,) * ndim


def _mesh_axes_of(logical: Optional[str], axis_rules: Mapping) -> tuple:
    if logical is None:
        return ()
    if logical not in axis_rules:
        raise KeyError(f"logical axis {logical!r} has no entry in LOGICAL_AXIS_RULES "
                       f"(known: {sorted(axis_rules)})")
    m = axis_rules[logical]
    if m is None:
        return ()
    return (m,) if isinstance(m, str) else tuple(m)


def spec_for(shape: Sequence[int], logical: Sequence[Optional[str]], mesh: Mesh,
             axis_rules: Mapping = LOGICAL_AXIS_RULES,
             axis_units: Mapping = DEFAULT_AXIS_UNITS) -> tuple[P, list]:
    """PartitionSpec for one array, and the list of dims that fell back to replication.

    A mesh axis of size 1 is dropped (no-op); a mesh axis already used by an earlier dim is
    dropped (a mesh axis may shard one dim only); a dim whose size (divided by its unit, e.g.
    head_dim for 'heads') is not a multiple of the mesh axes' product is replicated.
    """
    used: set = set()
    entries, fallbacks = [], []
    for dim, (size, name) in enumerate(zip(shape, logical)):
        axes = tuple(a for a in _mesh_axes_of(name, axis_rules)
                     if a not in used and mesh.shape[a] > 1)
        if not axes:
            entries.append(None)
            continue
        n_shards = math.prod(mesh.shape[a] for a in axes)
        unit = int(axis_units.get(name, 1))
        count = size // unit if size % unit == 0 else size
        if count % n_shards:
            fallbacks.append((dim, name, size, axes))
            entries.append(None)
            continue
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else axes)
    return P(*entries), fallbacks


def tree_shardings(tree, mesh: Mesh, rules: Sequence = PARAM_RULES,
                   axis_rules: Mapping = LOGICAL_AXIS_RULES,
                   axis_units: Mapping = DEFAULT_AXIS_UNITS):
    """NamedSharding for every leaf of ``tree`` (arrays or ShapeDtypeStructs) by path pattern.

    Works on any tree that contains parameter-shaped leaves under their parameter paths: params,
    optimizer states (mu/nu mirror param paths), a whole TrainState. Scalars are replicated.
    """
    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        logical = logical_axes_for(path_str(path), len(shape), rules)
        spec, _ = spec_for(shape, logical, mesh, axis_rules, axis_units)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def explain(tree, mesh: Mesh, rules: Sequence = PARAM_RULES,
            axis_rules: Mapping = LOGICAL_AXIS_RULES,
            axis_units: Mapping = DEFAULT_AXIS_UNITS) -> list[dict]:
    """Per leaf: path, shape, logical axes, PartitionSpec, replication fallbacks (for logs/tests)."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        p = path_str(path)
        logical = logical_axes_for(p, len(shape), rules)
        spec, fb = spec_for(shape, logical, mesh, axis_rules, axis_units)
        rows.append({"path": p, "shape": shape, "logical": logical, "spec": spec,
                     "fallbacks": fb})
    return rows


def llama_axis_units(head_dim: int) -> dict:
    """Units for a Llama-family model: flattened head dims are checked per head."""
    return {"heads": head_dim, "kv_heads": head_dim}


# ----------------------------------------------------------------------------- batches


def batch_sharding(mesh: Mesh, ndim: int, axis_rules: Mapping = LOGICAL_AXIS_RULES) -> NamedSharding:
    """Rows over the 'batch' mesh axes, everything else replicated."""
    axes = tuple(a for a in _mesh_axes_of("batch", axis_rules) if mesh.shape[a] > 1)
    first = None if not axes else (axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh, axis_rules: Mapping = LOGICAL_AXIS_RULES) -> int:
    return math.prod(mesh.shape[a] for a in _mesh_axes_of("batch", axis_rules))


def global_batch(local_batch, mesh: Mesh):
    """Assemble per-process row blocks into global arrays sharded over the batch axes.

    Each process passes ITS rows (global rows / process_count); with one process this is simply
    the whole batch. Rows must divide evenly over data × fsdp: replicating a batch would silently
    multiply the effective batch size, so this is an error rather than a fallback.
    """
    n = batch_shards(mesh)
    procs = jax.process_count()

    def one(x):
        x = np.asarray(x)
        rows = x.shape[0] * procs
        if rows % n:
            raise ValueError(
                f"global batch of {rows} rows ({x.shape[0]} per process × {procs} processes) is not "
                f"divisible by the batch mesh axes data×fsdp = {n} (mesh {dict(mesh.shape)})")
        if compile_only:  # a topology's devices (confu_jax.topology): the batch's shape, to compile against
            return jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype, sharding=batch_sharding(mesh, x.ndim))
        return jax.make_array_from_process_local_data(
            batch_sharding(mesh, x.ndim), x, (rows,) + x.shape[1:])

    from confu_jax.topology import is_compile_only

    compile_only = is_compile_only(next(iter(mesh.devices.flat)))
    return jax.tree_util.tree_map(one, local_batch)


def put_tree(host_tree, shardings):
    """Place host (numpy) arrays that every process holds in full onto their global shardings.

    Works with several processes (each process copies only the shards its devices own), unlike a
    plain ``jax.device_put`` of host data onto non-addressable devices.
    """
    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree_util.tree_map(one, host_tree, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying shardings (the targets of AOT compilation and orbax restore)."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


# ----------------------------------------------------------------------------- activations

_ACTIVATION_MESH: list = []
_TRAIN_ROWS: list = []


@contextlib.contextmanager
def activation_mesh(mesh: Mesh, train: bool = False):
    """Make :func:`constrain` active while tracing (the step compiler and the sharded decode loop enter
    this); ``train`` (the train step) also makes :func:`constrain_train_rows` active."""
    _ACTIVATION_MESH.append(mesh)
    _TRAIN_ROWS.append(bool(train))
    try:
        yield mesh
    finally:
        _ACTIVATION_MESH.pop()
        _TRAIN_ROWS.pop()


def active_mesh() -> Optional[Mesh]:
    """The mesh :func:`activation_mesh` made active while tracing, or None."""
    return _ACTIVATION_MESH[-1] if _ACTIVATION_MESH else None


FREE = P.UNCONSTRAINED  # a dim :func:`constrain` leaves to XLA's propagation


def constrain(x, logical: Sequence[Optional[str]]):
    """Pin an activation's layout by logical axes, e.g. ``constrain(h_btd, ('batch', None, None))``
    (None: replicated; :data:`FREE`: left to XLA, e.g. a vocabulary a tensor-parallel LM head shards).

    A no-op outside :func:`activation_mesh`, so model code can call it unconditionally. Besides
    steering XLA's propagation, it sidesteps a miscompile observed with jax/jaxlib 0.10.2 on a CPU
    mesh with all three axes > 1: without a constraint, the gradient of
    ``((h @ w) * s) @ e.T`` with h batch-sharded, w ('fsdp','tensor'), e ('tensor','fsdp') came out
    wrong (67 % relative error) while the forward was right (tests/unit/test_train_step.py keeps the
    reproducer as a strict xfail so an upgrade that fixes it is noticed).
    """
    if not _ACTIVATION_MESH:
        return x
    mesh = _ACTIVATION_MESH[-1]
    logical = tuple(logical)
    spec, _ = spec_for(x.shape, tuple(None if n is FREE else n for n in logical), mesh)
    spec = P(*(FREE if n is FREE else e for n, e in zip(logical, tuple(spec) + (None,) * (len(logical) - len(spec)))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_train_rows(x):
    """Pin the batch dim of a [B, ...] activation to batch-sharded rows, the rest left to XLA — in the train
    step only (a no-op elsewhere: the decode loops keep the layouts they were measured with)."""
    if not (_TRAIN_ROWS and _TRAIN_ROWS[-1]):
        return x
    return constrain(x, ("batch",) + (FREE,) * (x.ndim - 1))
