"""The frozen target a training run trains against, from ``config.model.source``.

``'asset:<name>'``, a GGUF file or a Hugging Face directory, or ``'random'`` (random weights from
``config.synthetic.seed``: tests and smoke runs, sized by the preset).

``resolve_target`` runs first, on the config: the checkpoint's metadata (config.json / GGUF header,
no tensors) fills ``config.model.arch`` and every setting left unset for it (dtypes, the draft
vocabulary), and a named preset that disagrees with the checkpoint is refused by key. So a
checkpoint alone sizes a run (configs/eagle3.py, configs/confu.py), and the run's saved config.json
describes its target without the checkpoint. ``load_target`` then loads the weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from confu_jax.assets import strip_asset
from confu_jax.models.llama import LlamaConfig, init_params as llama_init, param_shapes
from confu_jax.models.presets import get_preset
from confu_jax.models.spec import ModelSpec

# LlamaConfig fields that change the parameter tree: a preset and a checkpoint must agree on these.
TREE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
               "tie_embeddings", "attention_bias", "qk_norm")
# What config.model.arch records: the architecture, not how it is computed (dtype, attention kernel).
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(LlamaConfig)
                    if f.name not in ("dtype", "param_dtype", "attention_impl", "flash_impl"))
DRAFT_VOCAB_SHARE, DRAFT_VOCAB_MAX, DRAFT_VOCAB_ALIGN = 4, 32000, 64


def _preset(name: str) -> LlamaConfig:
    """``get_preset`` with an unknown name as a ValueError (a one-line CLI error, not a traceback)."""
    try:
        return get_preset(name)
    except KeyError as e:
        raise ValueError(f"config.model.preset: {e.args[0]}") from None


def target_name(config) -> str:
    """What a run's log calls its target: the preset, else the checkpoint's path."""
    return str(config.model.get("preset", None) or config.model.source)


def default_draft_vocab(vocab_size: int) -> int:
    """The draft vocabulary a checkpoint gets when the config leaves it unset: a quarter of the
    target's, rounded up to a multiple of 64, at most 32000 (EAGLE-3's Llama-3 heads keep 32000 of
    128256, SpecForge's Qwen3 heads 32000 of 151936), at least min(vocab, 256) for tiny vocabularies."""
    share = math.ceil(vocab_size / DRAFT_VOCAB_SHARE / DRAFT_VOCAB_ALIGN) * DRAFT_VOCAB_ALIGN
    return int(min(vocab_size, max(min(vocab_size, 256), min(share, DRAFT_VOCAB_MAX))))


def arch_record(cfg: LlamaConfig) -> dict:
    """``config.model.arch``: the architecture fields of ``cfg`` as JSON-able values."""
    out = {}
    for name in ARCH_FIELDS:
        v = getattr(cfg, name)
        out[name] = list(v) if isinstance(v, tuple) else v
    return out


def resolve_target(config) -> None:
    """Fill ``config.model.arch`` and the unset dtypes / draft vocabulary from ``config.model.source``'s
    metadata, in place; refuse a named preset the checkpoint disagrees with. ``'random'`` sources keep
    the preset's shapes (and need one). Idempotent: a config already resolved (``model.arch`` and the
    dtypes filled) is not read again, so the several entry points of one run read the header once."""
    m = config.model
    source, preset = m.source, m.get("preset", None)
    resolved = len(m.get("arch", None) or {}) > 0 and m.get("dtype", None) is not None \
        and ("draft" not in config or config.draft.get("draft_vocab_size", None) is not None)
    if resolved and source not in ("", "random") and not is_abstract(source):
        return
    if is_abstract(source):
        _resolve_abstract(config, source, preset)
        return
    if source == "random":
        if not preset:
            raise ValueError("config.model.source='random' needs config.model.preset (random weights take a "
                             "preset's shapes)")
        _preset(preset)
        return
    if not source:
        what = f"preset {preset!r}" if preset else "this config (no preset: the checkpoint decides the architecture)"
        raise ValueError(f"config.model.source is empty for {what}: pass --config.model.source=/path/to/checkpoint "
                         "(a Hugging Face directory or a .gguf file)")
    from confu_jax.weights import read_architecture

    arch = read_architecture(strip_asset(source))
    _check_preset(source, arch, preset)
    _fill_from_arch(config, arch, arch.dtype, arch.param_dtype)


def _check_preset(source: str, arch: LlamaConfig, preset) -> None:
    """Refuse a named preset that disagrees with the checkpoint on a field of the parameter tree."""
    if not preset:
        return
    want = _preset(preset)
    for field in TREE_FIELDS:
        if getattr(want, field) != getattr(arch, field):
            raise ValueError(
                f"{source}: {field} is {getattr(arch, field)!r} in the checkpoint; preset {preset!r} expects "
                f"{getattr(want, field)!r} (for your own checkpoint use configs/eagle3.py or configs/confu.py, "
                "whose architecture comes from the checkpoint)")


def _fill_from_arch(config, arch: LlamaConfig, dtype: str, param_dtype: str) -> None:
    """Record ``arch`` as ``config.model.arch`` and fill the dtypes and draft vocabulary left unset."""
    import ml_collections

    m = config.model
    with config.unlocked():
        m.arch = ml_collections.ConfigDict(arch_record(arch))
        if m.get("dtype", None) is None:
            m.dtype = dtype
        if m.get("param_dtype", None) is None:
            m.param_dtype = param_dtype
        if "draft" in config:
            if config.draft.get("draft_vocab_size", None) is None:
                config.draft.draft_vocab_size = default_draft_vocab(arch.vocab_size)
            if config.draft.get("dtype", None) is None:
                config.draft.dtype = m.dtype


ABSTRACT = "abstract"


def is_abstract(source) -> bool:
    """``'abstract'`` (the preset's shapes) or ``'abstract:<config.json | checkpoint dir | .gguf>'``:
    a target that has shapes and dtypes but no weights — the train step compiles against it
    (``launch.train --compile_only``) so "does it fit?" is answered with nothing downloaded."""
    return isinstance(source, str) and (source == ABSTRACT or source.startswith(ABSTRACT + ":"))


def _resolve_abstract(config, source: str, preset) -> None:
    """``resolve_target`` for an abstract source: the architecture from the preset, or from the
    config.json (or GGUF header) after the colon; dtypes default to bfloat16 (what a GPU or TPU run
    trains in) where neither the config nor the file says."""
    path = source[len(ABSTRACT) + 1:] if source.startswith(ABSTRACT + ":") else ""
    if path:
        import os

        from confu_jax.weights import read_architecture

        arch = read_architecture(os.path.dirname(path) if path.endswith("config.json") else path)
        _check_preset(path, arch, preset)
    elif preset:
        arch = _preset(preset)
    else:
        raise ValueError("config.model.source='abstract' needs config.model.preset (its shapes), or name the "
                         "shapes: --config.model.source=abstract:/path/to/config.json")
    dtype = config.model.get("dtype", None) or ("bfloat16" if arch.dtype == "float32" else arch.dtype)
    _fill_from_arch(config, arch, dtype, dtype)


def sharded_source(config) -> bool:
    """Is ``config.model.source`` a Hugging Face directory, which training loads straight into the
    frozen target's shardings (``weights.load_model_sharded``) instead of through a host copy?"""
    source = config.model.source
    if source in ("", "random") or is_abstract(source):
        return False
    from confu_jax.weights import checkpoint_kind

    return checkpoint_kind(strip_asset(source)) == "hf"


def load_target_sharded(config, spec: ModelSpec, shardings):
    """The frozen target of a Hugging Face ``config.model.source`` as global arrays on ``shardings``:
    each process reads only its devices' slices (``weights.load_model_sharded``)."""
    from confu_jax.weights import load_model_sharded

    _, params = load_model_sharded(strip_asset(config.model.source), shardings, config.model.param_dtype)
    return params


def load_target(config, spec: ModelSpec) -> tuple[ModelSpec, dict]:
    """(spec with the checkpoint's LlamaConfig, host params) for ``config.model.source``."""
    source = config.model.source
    if is_abstract(source):  # shapes only: nothing is read or allocated
        return spec, param_shapes(spec.target)
    if source == "random":
        seed = int(config.synthetic.seed) if "synthetic" in config else 0
        params = jax.device_get(llama_init(spec.target, jax.random.PRNGKey(seed)))
        return spec, params
    if not source:
        raise ValueError(f"config.model.source is empty for preset {config.model.preset!r}: pass "
                         "--config.model.source=/path/to/checkpoint (GGUF file or Hugging Face directory)")
    from confu_jax.weights import load_model

    cfg, params = load_model(strip_asset(source), config.model.param_dtype)
    want = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), param_shapes(spec.target))
    got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), params)
    if want != got:
        bad = [(jax.tree_util.keystr(p), w, g) for (p, w), g in
               zip(jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple)),
                   jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, tuple))) if w != g][:5]
        against = f"preset {config.model.preset!r}" if config.model.get("preset", None) else "config.model.arch"
        raise ValueError(f"{source}: parameters do not match {against} "
                         f"(path, expected, found): {bad or 'different tree structure'}")
    target = cfg.replace(dtype=spec.target.dtype, param_dtype=spec.target.param_dtype,
                         attention_impl=spec.target.attention_impl, flash_impl=spec.target.flash_impl)
    return dataclasses.replace(spec, target=target), params  # keeps the spec's draft_model (DFlash, SD²)
