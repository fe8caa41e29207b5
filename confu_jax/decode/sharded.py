"""Decoding over a device mesh: where the target, the head, the KV caches and the rows live.

The AR and speculative loops (``decode.generate``, ``decode.loop``) are the same jitted programs on
one device or on a mesh ``('data', 'fsdp', 'tensor')``; only the layout of their inputs and carry
changes, and it comes from the same table as training (``confu_jax.sharding``, docs/DESIGN.md §7):

* parameters (target, draft head, ConFu extras) by path pattern (``PARAM_RULES``): attention heads,
  MLP width and vocabulary over ``tensor`` (Megatron style, for targets that do not fit one device),
  model width over ``fsdp``; a dimension that does not divide is replicated;
* the KV caches ([L, B, Hkv, S, hd]) with their KV-head axis over ``tensor`` and rows over
  ``data × fsdp``: each device holds the K/V of the heads its q/k/v projections compute;
* every per-row array of the loop state (names ending ``_b…``, docs/DESIGN.md §3 shape letters)
  with rows over ``data × fsdp``.

The loops take ``mesh`` as a static argument; with one, they pin their carry to these layouts
(:func:`constrain_tree`) so XLA's propagation cannot pick a different one inside the while loop.
Placement of inputs is explicit (:func:`place_params`, :func:`place_target`,
:func:`place_request`); outputs come back row-sharded. Sharding changes only summation order
(partial sums over heads / MLP columns are all-reduced), so greedy output equals the single-device
output token for token unless the target has a near-tie within float rounding
(``tests/unit/test_sharded_decode.py``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from confu_jax import sharding as shd
from confu_jax.models.kv_cache import KVCache

# Shape letters (docs/DESIGN.md §3) that name a sharded logical axis in loop-state arrays.
# 'h' in a state array is always a KV head (the caches); every other letter is replicated.
STATE_LETTER_AXES: dict = {"b": "batch", "h": "kv_heads"}


def fake_host_devices(mesh_text: str) -> None:
    """Call before JAX starts its backends: ask XLA for as many host (CPU) devices as ``mesh_text``
    names, so a CPU-only machine can run or lower a sharded loop (GPU/TPU backends ignore the
    flag). An XLA_FLAGS that already sets a count wins."""
    import os

    sizes = []
    for part in (mesh_text or "").split(","):
        value = part.partition("=")[2].strip()
        if value.isdigit():
            sizes.append(int(value))
    n = math.prod(sizes) if sizes else 1
    env = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in env:
        os.environ["XLA_FLAGS"] = f"{env} --xla_force_host_platform_device_count={n}".strip()


def parse_mesh(text: str, n_devices: Optional[int] = None, devices: Optional[Sequence] = None) -> Mesh:
    """``'data=2,tensor=4'`` -> a ``('data','fsdp','tensor')`` mesh over ``devices`` (default: JAX's, or
    a topology's compile-only ones); unnamed axes are 1, one size may be -1 (the remaining devices).
    Empty text = one device (``make_mesh(1,1,1)`` on device 0)."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in sizes:
            raise ValueError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one of "
                             f"{list(sizes)} (e.g. --mesh data=2,tensor=4)")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: size {value!r} of axis {name!r} is not an integer")
    devices = list(jax.devices() if devices is None else devices)
    if n_devices is None:
        n_devices = math.prod(s for s in sizes.values()) if -1 not in sizes.values() else len(devices)
    if n_devices > len(devices):
        raise ValueError(f"--mesh {text!r} needs {n_devices} devices; {len(devices)} visible (on CPU, "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices} fakes them)")
    return shd.make_mesh(sizes["data"], sizes["fsdp"], sizes["tensor"], devices=devices[:n_devices])


def _units(cfg) -> dict:
    return shd.llama_axis_units(cfg.head_dim)


def target_shardings(target_params, cfg, mesh: Mesh):
    """NamedShardings of a target parameter tree (arrays or ShapeDtypeStructs): training's rules."""
    return shd.tree_shardings(target_params, mesh, shd.PARAM_RULES, axis_units=_units(cfg))


def params_shardings(target, dp, mesh: Mesh) -> tuple:
    """NamedShardings of the loop's ``(Target, DrafterParams)`` (target + drafter weights + ConFu
    extras + draft-vocab maps).

    The drafter's paths ('weights/lm_head/kernel', 'confu/soft_prompt_k_lphd', ...) hit the same
    PARAM_RULES as in training (rules match a path's tail); the vocab maps match no rule and are
    replicated."""
    return shd.tree_shardings((target, dp), mesh, shd.PARAM_RULES, axis_units=_units(target.config))


def place_target(target_params, cfg, mesh: Mesh):
    """The target's parameters on ``mesh`` (a no-op for leaves already laid out so)."""
    return jax.device_put(target_params, target_shardings(target_params, cfg, mesh))


def place_params(target, dp, mesh: Mesh) -> tuple:
    """The loop's ``(Target, DrafterParams)`` on ``mesh`` by :func:`params_shardings` (a no-op for
    leaves already laid out so)."""
    return jax.device_put((target, dp), params_shardings(target, dp, mesh))


def request_shardings(args: Sequence, mesh: Mesh) -> tuple:
    """Shardings of a padded request's device args (tokens_bt, lengths_b, temperature, top_p,
    eos_e, key): prompts and lengths row-sharded, the rest replicated. Rows must divide
    data × fsdp (replicating them would run every row on several devices for nothing)."""
    tokens_bt = args[0]
    b, n = tokens_bt.shape[0], shd.batch_shards(mesh)
    if b % n:
        raise ValueError(f"{b} prompt rows do not divide over the mesh's batch axes data×fsdp = {n} "
                         f"(mesh {dict(mesh.shape)}): pass a multiple of {n} prompts or use --mesh "
                         f"data=1")
    row = [shd.batch_sharding(mesh, np.ndim(a)) for a in args[:2]]
    return tuple(row + [shd.replicated(mesh) for _ in args[2:]])


def place_request(args: Sequence, mesh: Mesh) -> tuple:
    """``requests.DecodeRequest.device_args()`` placed by :func:`request_shardings`; on a mesh of
    compile-only devices (``confu_jax.topology``) their shapes with those shardings, to lower against."""
    from confu_jax.topology import is_compile_only

    shardings = request_shardings(args, mesh)
    if is_compile_only(next(iter(mesh.devices.flat))):
        return tuple(jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=s) for a, s in zip(args, shardings))
    return tuple(jax.device_put(a, s) for a, s in zip(args, shardings))


# ----------------------------------------------------------------------------- inside the loops


def _letters(name: str) -> str:
    return name.rsplit("_", 1)[-1] if "_" in name else ""


def _logical(name: str, ndim: int) -> tuple:
    """Logical axes of a state array from its name's shape letters, right-aligned to its rank (a
    per-layer cache buffer [B,Hkv,S,hd] of a field named ``k_lbhsd`` drops the leading 'l')."""
    letters = _letters(name)
    if ndim == 0 or len(letters) < ndim or not letters.isalpha():
        return (None,) * ndim
    return tuple(STATE_LETTER_AXES.get(c) for c in letters[len(letters) - ndim:])


def _field_name(path) -> str:
    """The innermost named key of a pytree path (a NamedTuple / dataclass field or a dict key); a
    per-layer cache buffer's tuple index is skipped, so it reads as its field ``k_lbhsd``."""
    for k in reversed(path):
        if isinstance(k, jax.tree_util.GetAttrKey):
            return str(k.name)
        if isinstance(k, jax.tree_util.DictKey):
            return str(k.key)
    return ""


def constrain_tree(tree):
    """Pin every array of a loop state/cache tree to its layout by its field name's shape letters
    (``length_b`` -> rows, ``k_lbhsd`` -> rows and KV heads, ``step``/``key`` -> replicated).

    A no-op outside ``sharding.activation_mesh`` (single-device decoding traces the same code)."""
    def one(path, x):
        name = _field_name(path)
        ndim = np.ndim(x)
        return shd.constrain(x, _logical(name, ndim)) if ndim else x

    return jax.tree_util.tree_map_with_path(one, tree)


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """NamedShardings of a ``KVCache`` (stacked or per-layer) by the rules of :func:`constrain_tree`."""
    def one(path, x):
        spec, _ = shd.spec_for(np.shape(x), _logical(_field_name(path), np.ndim(x)), mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, cache)


# ----------------------------------------------------------------------------- per-device bytes


def per_device_bytes(abstract_tree, shardings) -> dict:
    """Bytes each device of the shardings' mesh holds of ``abstract_tree`` (arrays or
    ShapeDtypeStructs) -> {device id: bytes}, from the shardings' index maps (exact, uneven shards
    included). The same function serves parameters and caches."""
    out: dict = {}
    for x, s in zip(jax.tree_util.tree_leaves(abstract_tree), jax.tree_util.tree_leaves(
            shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))):
        shape = tuple(np.shape(x))
        item = np.dtype(x.dtype).itemsize
        for dev, idx in s.devices_indices_map(shape).items():
            n = math.prod(len(range(*sl.indices(d))) for sl, d in zip(idx, shape)) if shape else 1
            out[dev.id] = out.get(dev.id, 0) + n * item
    return out


def bytes_report(abstract_tree, shardings) -> dict:
    """Total, sharded and replicated bytes of a tree and what each device holds: a sharded leaf
    contributes bytes / (its shard count) to each device, a replicated one its full size."""
    total = sharded = 0
    for x, s in zip(jax.tree_util.tree_leaves(abstract_tree), jax.tree_util.tree_leaves(
            shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))):
        n = math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
        total += n
        if s.shard_shape(tuple(np.shape(x))) != tuple(np.shape(x)):
            sharded += n
    per_dev = per_device_bytes(abstract_tree, shardings)
    return {"total": total, "sharded": sharded, "replicated": total - sharded,
            "per_device": per_dev, "max_per_device": max(per_dev.values()) if per_dev else 0}


def explain_fallbacks(tree, spec_or_cfg, mesh: Mesh) -> list:
    """Leaves whose dims fell back to replication on ``mesh`` (e.g. 9 heads on tensor=2)."""
    cfg = getattr(spec_or_cfg, "target", spec_or_cfg)
    return [r for r in shd.explain(tree, mesh, shd.PARAM_RULES, axis_units=_units(cfg)) if r["fallbacks"]]


# ----------------------------------------------------------------------------- shape-only lowering


def abstract_params(spec, mesh: Mesh, draft_vocab_size: Optional[int] = None) -> tuple:
    """ShapeDtypeStructs (with shardings) of the loop's ``(Target, DrafterParams)`` for a head's
    ``spec`` (a ``models.spec.ModelSpec``): target, head and vocab maps without allocating, so an 8B
    loop can be lowered on any machine (``jax.eval_shape``)."""
    import jax.numpy as jnp

    from confu_jax.decode.params import DrafterParams, Target
    from confu_jax.models.llama import param_shapes
    from confu_jax.models.params import trainable_shapes

    v, vd = spec.target.vocab_size, draft_vocab_size or spec.head.draft_vocab_size
    vocab = {"d2t": jax.ShapeDtypeStruct((vd,), jnp.int32), "t2d": jax.ShapeDtypeStruct((v,), jnp.bool_)}
    target = Target(spec.target, param_shapes(spec.target))
    dp = DrafterParams.for_head(spec.head, trainable_shapes(spec), vocab)
    return shd.with_shardings((target, dp), params_shardings(target, dp, mesh))
