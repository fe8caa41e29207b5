"""Medusa heads in the published FasterDecoding/Medusa format (docs/DESIGN.md §11 "Medusa").

Why: published Medusa heads (e.g. the FasterDecoding Hugging Face repos) are a directory with the
``medusa_head`` ModuleList's state dict — ``medusa_lm_head.safetensors`` (written by
``medusa/train/train_legacy.py``) or ``medusa_lm_head.pt`` (read by ``medusa/model/medusa_model.py``
``MedusaModelABC.from_pretrained``) — and a ``config.json`` with ``medusa_num_heads`` /
``medusa_num_layers`` (``MedusaConfig``). Keys, for head k and ResBlock i < L::

    {k}.{i}.linear.weight  [d, d]  (torch Linear: [out, in])
    {k}.{i}.linear.bias    [d]
    {k}.{L}.weight         [V, d]  (the head's LM head, no bias)

``load_medusa_dir`` → our parameter tree (``models.medusa``; kernels transposed to [in, out]);
``save_medusa_dir`` writes the safetensors form back (float32, or the dtype given). ``.pt`` files are
read with ``torch.load(weights_only=True)`` only (no pickled code runs).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from confu_jax.models.medusa import config_of, from_reference_state_dict, to_reference_state_dict
from confu_jax.weights.safetensors_io import SafetensorsFile, save_file

SAFETENSORS = "medusa_lm_head.safetensors"
PT = "medusa_lm_head.pt"


class ImportedMedusa(NamedTuple):
    heads: dict  # models.medusa parameter tree (numpy)
    config: dict  # the directory's config.json
    source: str


def is_medusa_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in (SAFETENSORS, PT))


def _read_state_dict(directory: str) -> dict:
    st = os.path.join(directory, SAFETENSORS)
    if os.path.isfile(st):
        f = SafetensorsFile(st)
        return {name: np.asarray(f.get(name), np.float32) for name in f.names()}
    pt = os.path.join(directory, PT)
    if os.path.isfile(pt):
        import torch

        sd = torch.load(pt, map_location="cpu", weights_only=True)
        return {k: v.detach().to(torch.float32).numpy() for k, v in sd.items()}
    raise FileNotFoundError(f"{directory}: no {SAFETENSORS} or {PT} (a FasterDecoding Medusa head directory)")


def load_medusa_dir(directory: str) -> ImportedMedusa:
    """A FasterDecoding Medusa head directory -> our parameters (float32)."""
    cfg_path = os.path.join(directory, "config.json")
    sd = _read_state_dict(directory)
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    else:
        cfg = {}
    sd = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in sd.items()}
    # the heads the file holds: the reference's own from_pretrained overrides the uploaded
    # config's medusa_num_heads (published configs disagree with their files), so the file decides
    n_heads = 1 + max(int(k.split(".")[0]) for k in sd)
    n_layers = cfg.get("medusa_num_layers")
    if n_layers is None:  # the largest module index of head 0 is its LM head
        n_layers = max(int(k.split(".")[1]) for k in sd if k.split(".")[0] == "0")
    return ImportedMedusa(from_reference_state_dict(sd, n_heads, int(n_layers)), cfg, directory)


def save_medusa_dir(directory: str, heads: dict, *, base_model_name_or_path: str = "", dtype=np.float32) -> None:
    """Write ``medusa_lm_head.safetensors`` + ``config.json`` (the reference's layout)."""
    os.makedirs(directory, exist_ok=True)
    c = config_of(heads)
    sd = {k: np.asarray(v, dtype) for k, v in to_reference_state_dict(heads).items()}
    save_file(sd, os.path.join(directory, SAFETENSORS))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                   "base_model_name_or_path": base_model_name_or_path, "hidden_size": c.d_model,
                   "vocab_size": c.vocab_size}, f, indent=2)
