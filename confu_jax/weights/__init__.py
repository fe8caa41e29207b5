"""Real weights: ``load_model(source)`` for GGUF files, Hugging Face directories and named assets."""

from __future__ import annotations

import jax
from typing import Optional

from confu_jax import storage
from confu_jax.assets import resolve_model_path
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.export import save_hf
from confu_jax.weights.gguf import load_gguf
from confu_jax.weights.hf import load_hf


def load_model(source: str, dtype: Optional[str] = None):
    """``(LlamaConfig, params)`` from an asset name (e.g. ``'smollm2-135m-instruct'``), a ``.gguf``
    file, or a Hugging Face directory (``config.json`` + ``model.safetensors`` or its sharded index).

    ``dtype`` ('float32' | 'bfloat16' | 'float16') sets both the parameter and compute dtype of the
    returned config; default: float32 for GGUF (its tensors are dequantised), the checkpoint's own
    float dtype for Hugging Face directories.
    """
    kind, path = _checkpoint(source)
    return load_hf(path, dtype) if kind == "hf" else load_gguf(path, dtype)


def load_model_sharded(source: str, shardings: dict, dtype: Optional[str] = None, counter=None):
    """``load_model`` placed straight into ``shardings`` (NamedShardings shaped like the params).

    Hugging Face directories: each process reads only the slices its devices hold from the
    memory-mapped safetensors, and no host copy of the model is made (an 8B target is not a 16 GB
    copy per process before it is sharded). GGUF files are dequantised on the host tensor by tensor
    (``load_model``) and then placed: their quantised blocks do not slice along our layout.
    ``counter`` (``weights.tree.ReadCounter``): bytes read from the checkpoint, Hugging Face only."""
    kind, path = _checkpoint(source)
    if kind == "hf":
        from confu_jax.weights.hf import load_hf_sharded

        return load_hf_sharded(path, shardings, dtype, counter)
    from confu_jax import sharding as shd

    cfg, params = load_gguf(path, dtype)
    return cfg, shd.put_tree(jax.device_get(params), shardings)


def read_architecture(source: str, dtype: Optional[str] = None):
    """The ``LlamaConfig`` of ``source`` (what ``load_model`` would return) from its metadata alone:
    ``config.json`` (+ ``generation_config.json``) of a Hugging Face directory or a GGUF header; no
    tensor is read. What a training config is sized from before the weights are loaded."""
    kind, path = _checkpoint(source)
    if kind == "hf":
        from confu_jax.weights.hf import read_config

        return read_config(path, dtype)
    from confu_jax.weights.gguf import GGUFFile, read_config

    return read_config(GGUFFile(path), dtype)


def checkpoint_kind(source: str) -> str:
    """'hf' (a Hugging Face directory) or 'gguf' (a .gguf file) for an asset name or path."""
    return _checkpoint(source)[0]


def _checkpoint(source: str) -> tuple:
    """('hf' | 'gguf', path) of an asset name, a Hugging Face directory or a .gguf file."""
    path = resolve_model_path(source)
    if storage.isdir(path):
        return "hf", path
    if path.endswith(".gguf") and storage.is_remote(path):
        raise CheckpointError(f"model source {source!r}: GGUF files are read through a memory map, which an "
                              "object store does not offer; copy it to a local disk (Hugging Face safetensors "
                              "directories load from gs:// directly)")
    if path.endswith(".gguf"):
        return "gguf", path
    raise CheckpointError(
        f"model source {source!r} resolved to {path!r}, which is neither a .gguf file nor a directory "
        "with config.json + model.safetensors"
    )


__all__ = ["load_model", "read_architecture", "save_hf", "load_gguf", "load_hf", "CheckpointError"]
