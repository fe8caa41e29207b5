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
    available = set(available)
    used: set = set()
    shapes = param_shapes(cfg)
    np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))

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

    params: dict = {}
    for path, kind in GLOBAL_PARAMS.items():
        if path[0] not in shapes:  # lm_head absent when embeddings are tied
            continue
        ours = shapes[path[0]][path[1]].shape
        w = get(name_of(kind, None), path, _source_shape(path, ours))
        params.setdefault(path[0], {})[path[1]] = jnp.asarray(np.asarray(_to_ours(path, w), np_dtype))

    layers: dict = {}
    for path, kind in LAYER_PARAMS.items():
        if path[1] not in shapes["layers"].get(path[0], {}):  # a Qwen-only tensor under a Llama config
            continue
        stacked_shape = shapes["layers"][path[0]][path[1]].shape
        out = np.empty(stacked_shape, np_dtype)  # every slot is written below or we raise
        for i in range(cfg.n_layers):
            w = get(name_of(kind, i), ("layers", str(i)) + path, _source_shape(path, stacked_shape[1:]))
            out[i] = _to_ours(path, w)
        layers.setdefault(path[0], {})[path[1]] = jnp.asarray(out)
    params["layers"] = layers

    extra = sorted(n for n in available - used if not ignorable(n))
    if extra:
        hint = ""
        if any(n.endswith("bias") for n in extra):
            hint = (" (bias tensors: q/k/v biases are read only for Qwen2 configs; output-projection and MLP "
                    "biases are not part of any architecture supported here)")
        raise CheckpointError(f"{source}: unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}{hint}")
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
