"""MLP speculators in the published format (docs/DESIGN.md §11 "MLP speculator").

Why: published MLP speculators (the ibm-fms and ibm-granite "accelerator" repositories, which vLLM
serves as ``--speculative-model``) are a Hugging Face directory written by fms-extras
``fms_extras/models/hf/modeling_mlp_speculator.py`` (``MLPSpeculatorPreTrainedModel.save_pretrained``):
``config.json`` with ``model_type: "mlp_speculator"`` and the ``MLPSpeculatorConfig`` fields
(``vocab_size``, ``emb_dim``, ``inner_dim`` — 0 means ``emb_dim`` —, ``n_predict``,
``top_k_tokens_per_head``, ``n_candidates``, ``tie_weights``, ``scale_input``; vLLM reads the same,
``vllm/transformers_utils/configs/mlp_speculator.py``), and ``model.safetensors`` (or its sharded
index, or ``pytorch_model.bin``) holding the ``MLPSpeculator`` state dict under the wrapper's
``speculator.`` prefix (vLLM's ``load_weights`` and fms's ``_rename_hf_weights_to_fms`` strip it; files
without it load too). Keys, for stage i (torch ``Linear.weight`` is [out, in])::

    speculator.emb.{i}.weight   [V, D]       speculator.proj.{i}.weight  [D, d] (i = 0) / [D, D]
    speculator.head.{i}.weight  [V, D]       speculator.ln.{i}.weight, speculator.ln.{i}.bias  [D]

A tied speculator may list only stage 0's emb / head / ln and proj.0, proj.1 (Hugging Face's
safetensors save keeps one name per shared tensor) or every stage (``state_dict()``); both read.

``load_mlp_speculator_dir`` → our stage-layout tree (``models.mlp_speculator``, float32);
``save_mlp_speculator_dir`` writes ``model.safetensors`` (every stage's keys, ``speculator.``
prefix: what ``from_pretrained``, fms and vLLM all load) + ``config.json``.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import numpy as np

from confu_jax.models.mlp_speculator import (config_of, from_reference_state_dict, make_config,
                                             reference_config_dict, to_reference_state_dict)
from confu_jax.weights.tensor_files import read_tensors
from confu_jax.weights.head_dirs import dtype_name, read_config_json
from confu_jax.weights.safetensors_io import save_file

MODEL_TYPE = "mlp_speculator"
PREFIX = "speculator."


class ImportedMLPSpeculator(NamedTuple):
    params: dict  # models.mlp_speculator stage-layout tree (numpy float32)
    config: dict  # the directory's config.json
    source: str


def is_mlp_speculator_dir(path: str) -> bool:
    """A directory whose config.json says ``model_type: "mlp_speculator"``."""
    c = read_config_json(path) if os.path.isdir(path) else None
    return c is not None and c.get("model_type") == MODEL_TYPE


def load_mlp_speculator_dir(directory: str) -> ImportedMLPSpeculator:
    """A published MLP speculator directory -> our stage-layout parameters (float32), every shape
    checked against its config.json."""
    directory = os.path.abspath(os.path.expanduser(directory))
    c = read_config_json(directory)
    if c is None or c.get("model_type") != MODEL_TYPE:
        got = None if c is None else c.get("model_type")
        raise ValueError(f"{directory}: expected a config.json with model_type {MODEL_TYPE!r} (an fms-extras / vLLM "
                         f"MLP speculator); got {'no readable config.json' if c is None else f'model_type {got!r}'}")
    missing = [k for k in ("vocab_size", "emb_dim", "n_predict") if k not in c]
    if missing:
        raise ValueError(f"{directory}/config.json: MLP speculator config lacks {missing} (has {sorted(c)})")
    cfg = make_config(int(c["n_predict"]), int(c["emb_dim"]), int(c["vocab_size"]), int(c.get("inner_dim", 0) or 0),
                      bool(c.get("tie_weights", False)), bool(c.get("scale_input", False)))
    sd = read_tensors(directory)
    try:
        params = from_reference_state_dict(sd, cfg)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return ImportedMLPSpeculator(params, c, directory)


def save_mlp_speculator_dir(directory: str, params: dict, *, tie_weights: Optional[bool] = None,
                            top_k_tokens_per_head=None, n_candidates: int = 5, dtype=np.float32) -> None:
    """Write ``model.safetensors`` + ``config.json`` of stage-layout ``params`` (``tie_weights`` None:
    detected from the weights; ``dtype``: float32, float16 or bfloat16; ``torch_dtype`` records it)."""
    torch_dtype = dtype_name(dtype)
    config_of(params)  # shapes checked before anything is written
    cfg = reference_config_dict(params, tie_weights=tie_weights, top_k_tokens_per_head=top_k_tokens_per_head,
                                n_candidates=n_candidates)
    cfg["torch_dtype"] = torch_dtype
    os.makedirs(directory, exist_ok=True)
    sd = {PREFIX + k: np.asarray(v, dtype) for k, v in to_reference_state_dict(params).items()}
    save_file(sd, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
