"""The Llama forward with the layer loop unrolled over per-layer weight buffers (CPU decode).

``Llama`` scans one ``DecoderLayer`` over weights stacked on a leading layer axis, which keeps
compile time flat in depth. On XLA:CPU every step of that scan first copies its layer's weights
out of the stack (a dynamic-slice is materialised before each dot), so a memory-bound 1-token
decode step streams the weights roughly twice: SmolLM2's decode forward measured ~75 CPU-ms
scanned vs ~40 CPU-ms with one buffer per layer. Here the stack is split once per jitted call
(``split_layers``, outside any loop) and the same ``DecoderLayer`` module runs once per layer on
its own buffer. Same parameters, same module code, same outputs as ``Llama.__call__``
(``tests/unit/test_unrolled.py``); only the schedule differs. GPU/TPU keep the scan.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from confu_jax import sharding as shd
from confu_jax.kernels import cpu_matmul
from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.llama import PACKED_LM_HEAD, DecoderLayer, Llama, LlamaConfig, LlamaOutput, check_mlp_bias, layer_context


class SplitParams(NamedTuple):
    shared: dict  # every top-level entry except 'layers' (embed, final_norm, lm_head)
    layers: tuple  # n_layers trees, each shaped like one DecoderLayer's params


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def split_layers(params: dict, cfg: LlamaConfig, pack: Optional[bool] = None) -> SplitParams:
    """Per-layer weight buffers. Inside jit the slices are materialised (optimization_barrier) so
    XLA does not fold static slices into the dots' operands, which it lowers poorly on CPU.

    ``pack`` (default: ``kernels.cpu_matmul.use_packed(cfg)`` outside a decode mesh, whose
    partitioner cannot split the handler): the projections and the LM head are laid out as
    64-column panels for the few-row CPU matmul instead (the copy the split makes anyway, in another
    layout; the tied LM head adds a packed copy of the embedding beside it)."""
    if "layers" not in params:
        raise KeyError(f"params has no 'layers' entry (top-level keys: {sorted(params)})")
    n = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
    if n != cfg.n_layers:
        raise ValueError(f"params['layers'] stacks {n} layers; cfg.n_layers is {cfg.n_layers}")
    shared = {k: v for k, v in params.items() if k != "layers"}
    layers = tuple(jax.tree_util.tree_map(lambda p, i=i: p[i], params["layers"]) for i in range(n))
    if pack is None:
        pack = shd.active_mesh() is None and cpu_matmul.use_packed(cfg)
    if pack:
        layers = tuple(_pack_modules(lp, PROJECTIONS) for lp in layers)
        head_dv = shared["embed"]["embedding"].T if cfg.tie_embeddings else shared["lm_head"]["kernel"]
        shared[PACKED_LM_HEAD] = cpu_matmul.pack(head_dv)
    return SplitParams(shared, jax.lax.optimization_barrier(layers))


def _pack_modules(tree: dict, names: Sequence[str]) -> dict:
    """``tree`` with the float32 2-D ``kernel`` of each module in ``names`` packed (``cpu_matmul.pack``)."""
    return {k: ({**v, "kernel": cpu_matmul.pack(v["kernel"])}
                if k in names and getattr(v.get("kernel"), "ndim", 0) == 2 and v["kernel"].dtype == jnp.float32
                else v) for k, v in tree.items()}


def _final(m: Llama, x_btd, return_logits: bool):
    hidden = m.final_norm(x_btd)
    return hidden, (m.logits(hidden) if return_logits else None)


def apply_unrolled(
    sp: SplitParams,
    cfg: LlamaConfig,
    tokens_bt: Optional[jax.Array],
    positions_bt: jax.Array,
    *,
    embeds_btd: Optional[jax.Array] = None,
    attend: Optional[AttendTo] = None,
    tap_layers: Sequence[int] = (),
    return_logits: bool = True,
    tap_rows: Optional[int] = None,
    mlp_bias_lbtf: Optional[jax.Array] = None,
) -> LlamaOutput:
    """``Llama(cfg).apply({'params': params}, ...)`` with ``split_layers(params)``; same arguments."""
    model = Llama(cfg)
    shared = {"params": sp.shared}
    if embeds_btd is None:
        x = model.apply(shared, tokens_bt, method=Llama.embed_tokens)
    else:
        x = embeds_btd.astype(jnp.dtype(cfg.dtype))
    ctx, tap_layers = layer_context(cfg, x.shape[:2], positions_bt, attend, tap_layers)
    if mlp_bias_lbtf is not None:
        check_mlp_bias(cfg, mlp_bias_lbtf, x.shape[:2])
    tap_shape = x.shape if tap_rows is None else (x.shape[0], int(tap_rows)) + x.shape[2:]
    carry = (x, tuple(jnp.zeros(tap_shape, x.dtype) for _ in tap_layers))
    layer = DecoderLayer(cfg)
    ks, vs = [], []
    for i, lp in enumerate(sp.layers):
        xs = {"layer": jnp.int32(i)}
        if mlp_bias_lbtf is not None:
            xs["mlp_bias"] = mlp_bias_lbtf[i]
        if attend is not None and attend.k_cache is not None:
            xs["k_cache"], xs["v_cache"] = attend.k_cache[i], attend.v_cache[i]
        if attend is not None and attend.k_prefix is not None:
            xs["k_prefix"], xs["v_prefix"] = attend.k_prefix[i], attend.v_prefix[i]
        carry, (k, v) = layer.apply({"params": lp}, carry, xs, ctx)
        ks.append(k)
        vs.append(v)
    x, taps = carry
    hidden, logits = model.apply(shared, x, return_logits, method=_final)
    taps_btc = jnp.concatenate(taps, axis=-1) if taps else None
    return LlamaOutput(logits, hidden, taps_btc, jnp.stack(ks), jnp.stack(vs))


def apply_target(params, cfg: LlamaConfig, tokens_bt, positions_bt, **kw) -> LlamaOutput:
    """The target forward on either layout: the stacked tree (``Llama``'s layer scan) or
    ``SplitParams`` (layer-unrolled). Keyword arguments as ``Llama.__call__``, plus
    ``remat_layers`` (``Llama.remat_layers``, stacked layout only)."""
    remat_layers = kw.pop("remat_layers", False)  # Llama.remat_layers; the unrolled form is never trained
    if isinstance(params, SplitParams):
        return apply_unrolled(params, cfg, tokens_bt, positions_bt, **kw)
    return Llama(cfg, remat_layers=remat_layers).apply({"params": params}, tokens_bt, positions_bt, **kw)


def shared_params(params) -> dict:
    """Embedding / final-norm / LM-head parameters of either layout."""
    return params.shared if isinstance(params, SplitParams) else params


def target_logits(params, cfg: LlamaConfig, hidden_btd) -> jax.Array:
    """The target's LM head (float32) on final-normed hidden states, either layout."""
    return Llama(cfg).apply({"params": shared_params(params)}, hidden_btd, method=Llama.logits)


_PREPARED: dict = {}  # kind -> (weakrefs to the source leaves, static key, prepared tree): the latest only


def _memo(kind: str, tree, key, make):
    """``make(tree)`` once per (source arrays, ``key``), the latest per ``kind`` kept."""
    import weakref

    leaves = jax.tree_util.tree_leaves(tree)
    hit = _PREPARED.get(kind)
    if hit is not None:
        refs, k, out = hit
        if k == key and len(refs) == len(leaves) and all(r() is x for r, x in zip(refs, leaves)):
            return out
    out = make(tree)
    try:
        _PREPARED[kind] = ([weakref.ref(x) for x in leaves], key, out)
    except TypeError:  # numpy leaves: not cached
        pass
    return out


def prepared_layers(params, cfg: LlamaConfig):
    """``split_layers(params, cfg)`` made once per target and kept (the latest target only), for the
    CPU decode entry points: the split copies every weight (and packing re-lays them, ~0.7 s for
    SmolLM2 on two cores), which done inside each decode call cost every call that much. The split
    form is handed to the jitted programs, which then skip splitting. ``SplitParams`` pass through."""
    if isinstance(params, SplitParams):
        return params
    return _memo("target", params, cfg, lambda p: jax.jit(split_layers, static_argnums=1)(p, cfg))


def prepared_dense(tree: dict, names: Sequence[str]) -> dict:
    """``tree`` with the float32 ``kernel`` of each module in ``names`` packed for the CPU few-row
    matmul (``models.llama.PackableDense`` reads either form), once per tree (the latest kept)."""
    return _memo("dense", tree, tuple(names), lambda t: jax.jit(_pack_modules, static_argnums=1)(t, tuple(names)))


def is_packed_split(params) -> bool:
    """A ``split_layers`` result laid out for the CPU few-row matmul."""
    return isinstance(params, SplitParams) and PACKED_LM_HEAD in params.shared
