"""Checkpoint tensors -> the exact parameter tree ``Llama(cfg).init`` produces.

Both loaders (GGUF, Hugging Face) reduce to: a name for each logical tensor, a function that
returns it as a numpy array in the PyTorch ``[out, in]`` orientation, and the set of names the file
holds. Assembly here is therefore shared, and so are its checks: every expected tensor present
with the shape the config implies, nothing unexplained left over, and a final comparison with
``param_shapes(cfg)`` so the tree can never drift from the model definition.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.llama import LlamaConfig, param_shapes
from confu_jax.weights.errors import CheckpointError

# Our parameter path -> logical tensor kind. Kinds are what the loaders' name maps translate.
GLOBAL_PARAMS = {
    ("embed", "embedding"): "embed",
    ("final_norm", "scale"): "final_norm",
    ("lm_head", "kernel"): "lm_head",
}
LAYER_PARAMS = {
    ("attn_norm", "scale"): "attn_norm",
    ("q_proj", "kernel"): "q",
    ("k_proj", "kernel"): "k",
    ("v_proj", "kernel"): "v",
    ("o_proj", "kernel"): "o",
    ("mlp_norm", "scale"): "mlp_norm",
    ("gate_proj", "kernel"): "gate",
    ("up_proj", "kernel"): "up",
    ("down_proj", "kernel"): "down",
    # Present only where the config has them (``param_shapes`` decides): Qwen2's q/k/v biases,
    # Qwen3's per-head q/k norms.
    ("q_proj", "bias"): "q_bias",
    ("k_proj", "bias"): "k_bias",
    ("v_proj", "bias"): "v_bias",
    ("q_norm", "scale"): "q_norm",
    ("k_norm", "scale"): "k_norm",
}

NameFn = Callable[[str, Optional[int]], str]


def _source_shape(path: tuple, ours: tuple) -> tuple:
    """Shape the checkpoint stores: Dense kernels are [in, out] here and [out, in] in the file."""
    return tuple(reversed(ours)) if path[-1] == "kernel" else tuple(ours)


def _to_ours(path: tuple, w: np.ndarray) -> np.ndarray:
    return w.T if path[-1] == "kernel" else w


def _gather_sources(cfg: LlamaConfig, source: str, name_of: NameFn, fetch: Callable[[str], np.ndarray],
                    available: Iterable[str], ignorable: Callable[[str], bool]) -> list:
    """Every parameter's checkpoint tensors, checked (present, shaped as the config implies, nothing
    unexplained left over) but not converted: [(path, [tensor] or [tensor per layer], stacked)].
    With lazy ``fetch`` results (safetensors memory maps) nothing is read yet."""
    available = set(available)
    used: set = set()
    shapes = param_shapes(cfg)

    def get(name: str, path: tuple, expected: tuple) -> np.ndarray:
        if name not in available:
            raise CheckpointError(
                f"{source}: missing tensor {name!r} (needed for parameter {'/'.join(path)}, "
                f"expected shape {expected})"
            )
        w = fetch(name)
        if tuple(w.shape) != expected:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(w.shape)}; expected {expected} "
                f"for parameter {'/'.join(path)} of {cfg_summary(cfg)}"
            )
        used.add(name)
        return w

    out = []
    for path, kind in GLOBAL_PARAMS.items():
        if path[0] not in shapes:  # lm_head absent when embeddings are tied
            continue
        ours = shapes[path[0]][path[1]].shape
        out.append((path, [get(name_of(kind, None), path, _source_shape(path, ours))], False))
    for path, kind in LAYER_PARAMS.items():
        if path[1] not in shapes["layers"].get(path[0], {}):  # a Qwen-only tensor under a Llama config
            continue
        stacked_shape = shapes["layers"][path[0]][path[1]].shape
        ws = [get(name_of(kind, i), ("layers", str(i)) + path, _source_shape(path, stacked_shape[1:]))
              for i in range(cfg.n_layers)]
        out.append((("layers",) + path, ws, True))

    extra = sorted(n for n in available - used if not ignorable(n))
    if extra:
        hint = ""
        if any(n.endswith("bias") for n in extra):
            hint = (" (bias tensors: q/k/v biases are read only for Qwen2 configs; output-projection and MLP "
                    "biases are not part of any architecture supported here)")
        raise CheckpointError(f"{source}: unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}{hint}")
    return out


def _put(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def assemble(
    cfg: LlamaConfig,
    *,
    source: str,
    name_of: NameFn,
    fetch: Callable[[str], np.ndarray],
    available: Iterable[str],
    ignorable: Callable[[str], bool] = lambda name: False,
) -> dict:
    """Build the parameter tree from a checkpoint, stacking per-layer tensors on a leading axis.

    ``source`` labels errors (the file). Tensors are cast to ``cfg.param_dtype`` one at a time, so
    peak host memory is about one copy of the model plus one tensor.
    """
    np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    params: dict = {"layers": {}}
    for path, ws, stacked in _gather_sources(cfg, source, name_of, fetch, available, ignorable):
        if stacked:
            out = np.empty((len(ws),) + _to_ours(path, ws[0]).shape, np_dtype)
            for i, w in enumerate(ws):
                out[i] = _to_ours(path, w)
            _put(params, path, jnp.asarray(out))
        else:
            _put(params, path, jnp.asarray(np.asarray(_to_ours(path, ws[0]), np_dtype)))
    check_tree(cfg, params, source)
    return params


class ReadCounter:
    """Bytes a sharded load read from the checkpoint (what each process's devices needed, each slice once)."""

    def __init__(self):
        self.bytes = 0


def assemble_sharded(
    cfg: LlamaConfig,
    shardings: dict,
    *,
    source: str,
    name_of: NameFn,
    fetch: Callable[[str], np.ndarray],
    available: Iterable[str],
    ignorable: Callable[[str], bool] = lambda name: False,
    counter: Optional[ReadCounter] = None,
) -> dict:
    """``assemble``, placed straight into ``shardings`` (a tree of NamedShardings like the params):
    each process reads only the slices its own devices hold, from lazy ``fetch`` results (memory maps),
    and builds each global array from them (``jax.make_array_from_callback``); no host copy of the
    model exists at any point. A slice several local devices share (replicated axes) is read once.
    ``counter``: add the bytes read from the checkpoint."""
    np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    shapes = param_shapes(cfg)
    params: dict = {}
    for path, ws, stacked in _gather_sources(cfg, source, name_of, fetch, available, ignorable):
        node_s, node_a = shardings, shapes
        for key in path:
            node_s, node_a = node_s[key], node_a[key]
        cache: dict = {}
        slabs: dict = {}  # this param's checkpoint rows already fetched from an object store

        def rows(w, sl):
            """``w[sl]``, rows of the checkpoint tensor's leading axis. An object store's tensor
            (``safetensors_io.RemoteTensor``) fetches whole rows, and the devices that split the other
            axis need the same ones: each distinct slab is fetched once for the param (held until
            its global array is built: at most this process's share of one stacked param)."""
            if not getattr(w, "reads_whole_rows", False):
                return w[sl]  # a memory map: a view, nothing read yet
            key = (id(w), sl.start, sl.stop, sl.step)
            if key not in slabs:
                slabs[key] = w[sl]
            return slabs[key]

        def read(w, index, path=path):
            """ours[index] of one checkpoint tensor, reading only those elements."""
            if path[-1] == "kernel" and len(index) == 2:  # ours = w.T
                part = rows(w, index[1])[:, index[0]].T
            elif path[-1] == "kernel":
                part = w[index].T
            elif index and isinstance(index[0], slice):
                part = rows(w, index[0])[(slice(None),) + tuple(index[1:])]
            else:
                part = w[index]
            if counter is not None:
                counter.bytes += part.size * w.dtype.itemsize
            return np.asarray(part, np_dtype)

        def callback(index, ws=ws, stacked=stacked, cache=cache):
            key = tuple((sl.start, sl.stop, sl.step) for sl in index)
            if key not in cache:
                if stacked:
                    cache[key] = np.stack([read(ws[i], tuple(index[1:])) for i in range(len(ws))[index[0]]])
                else:
                    cache[key] = read(ws[0], tuple(index))
            return cache[key]

        _put(params, path, jax.make_array_from_callback(tuple(node_a.shape), node_s, callback))
    check_tree(cfg, params, source)
    return params


def cfg_summary(cfg: LlamaConfig) -> str:
    return (f"config(d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, "
            f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, ffn_dim={cfg.ffn_dim}, "
            f"vocab_size={cfg.vocab_size}, attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm})")


def check_tree(cfg: LlamaConfig, params: dict, source: str = "params") -> None:
    """Raise unless ``params`` has exactly the paths, shapes and dtypes of ``param_shapes(cfg)``."""
    want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(param_shapes(cfg))}
    got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"{source}: parameter tree mismatch: missing {missing}, unexpected {extra}")
    for k, w in want.items():
        g = got[k]
        if tuple(g.shape) != tuple(w.shape) or jnp.dtype(g.dtype) != jnp.dtype(w.dtype):
            raise CheckpointError(
                f"{source}: parameter {k} is {g.dtype}{list(g.shape)}; expected {w.dtype}{list(w.shape)}"
            )
