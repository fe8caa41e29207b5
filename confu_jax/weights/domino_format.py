"""Domino drafts in SpecForge's published layout (``DominoDraftModel``), in and out.

Read from SpecForge @a6b6b023 ``specforge/modeling/draft/domino.py`` (the module names: ``prefix_gru`` an
``nn.GRU(hidden_size, gru_hidden_dim, bias=False)``, ``embed_proj`` ``Sequential(Linear(d + H, emb_dim),
SiLU, Linear(emb_dim, vocab))``), its DFlash base ``specforge/modeling/draft/dflash.py`` (older checkpoints keep
the head under ``logit_head.``: read either way) and ``configs/qwen3-8b-domino.json``: z-lab's DFlash layout
(``weights.dflash_format``) with architectures ``["DominoDraftModel"]`` and ``dflash_config`` {``projector_type:
"domino"``, ``emb_dim``, ``gru_hidden_dim``, ``pure_draft_prefix_len``, ``shift_label``}.

Tensors beyond DFlash's: ``prefix_gru.weight_ih_l0`` [3H, d], ``prefix_gru.weight_hh_l0`` [3H, H] (gates r, z, n),
``embed_proj.0.weight`` [e, d+H], ``embed_proj.2.weight`` [V, e].

Not read: ``shift_label: false`` (the block read the DFlash way: not the published drafters' reading).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from confu_jax.models import domino as M
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.dflash_format import load_dflash_dir, save_dflash_dir
from confu_jax.weights.head_dirs import read_config_json

ARCHITECTURE = "DominoDraftModel"
PROJECTOR = "domino"
_HEAD = {"prefix_gru.weight_ih_l0": ("gru", "w_ih"), "prefix_gru.weight_hh_l0": ("gru", "w_hh"),
         "embed_proj.0.weight": ("embed_proj", "w1"), "embed_proj.2.weight": ("embed_proj", "w2")}


class ImportedDomino(NamedTuple):
    params: dict  # models.domino tree (numpy float32), no decode scalars
    draft: LlamaConfig
    block_size: int
    mask_token_id: int
    prefix_len: int
    taps: tuple
    source: str


def is_domino_dir(path: str) -> bool:
    c = read_config_json(path) if os.path.isdir(path) else None
    return c is not None and (ARCHITECTURE in (c.get("architectures") or [])
                              or (c.get("dflash_config") or {}).get("projector_type") == PROJECTOR)


def load_domino_dir(directory: str) -> ImportedDomino:
    """A SpecForge Domino directory -> our tree (float32), every shape and setting checked."""
    directory = os.path.abspath(os.path.expanduser(directory))
    imp = load_dflash_dir(directory, projector=PROJECTOR, head_prefixes=("prefix_gru.", "embed_proj."))
    dc = imp.dflash_config
    if dc.get("shift_label") is not True:
        raise ValueError(f"{directory}: dflash_config.shift_label is {dc.get('shift_label')!r}; Domino's published "
                         "drafters read the block with shift_label true (each slot drafts the next token), the only "
                         "reading built here")
    missing = sorted(set(_HEAD) - set(imp.head))
    extra = sorted(set(imp.head) - set(_HEAD))
    if missing or extra:
        raise ValueError(f"{directory}: Domino head tensors missing {missing}, unexpected {extra}")
    params = dict(imp.params)
    for name, (group, leaf) in _HEAD.items():
        params.setdefault(group, {})[leaf] = np.ascontiguousarray(np.asarray(imp.head[name], np.float32).T)
    want = M.init_shapes(imp.draft, len(imp.taps), imp.draft.vocab_size, gru_hidden_dim=int(dc["gru_hidden_dim"]),
                         emb_dim=int(dc["emb_dim"]))
    got = {g: {k: tuple(np.shape(v)) for k, v in params[g].items()} for g in M.EXTRA}
    need = {g: {k: tuple(v.shape) for k, v in want[g].items()} for g in M.EXTRA}
    if got != need:
        raise ValueError(f"{directory}: the GRU / projection tensors {got} do not match the config's {need}")
    return ImportedDomino(params, imp.draft, imp.block_size, imp.mask_token_id,
                          int(dc.get("pure_draft_prefix_len", 0)), imp.taps, directory)


def save_domino_dir(directory: str, params: dict, draft: LlamaConfig, *, taps, mask_token_id: int, block_size: int,
                    num_target_layers: int, prefix_len: int, dtype=np.float32) -> None:
    """Write ``model.safetensors`` + ``config.json`` in SpecForge's layout (``dtype``: float32, float16, bfloat16)."""
    head = {name: np.ascontiguousarray(np.asarray(params[group][leaf]).T) for name, (group, leaf) in _HEAD.items()}
    config = {"projector_type": PROJECTOR, "pure_draft_prefix_len": int(prefix_len), "shift_label": True,
              "emb_dim": int(np.shape(params["embed_proj"]["w1"])[1]), "gru_hidden_dim": M.gru_width(params)}
    save_dflash_dir(directory, M.backbone(params), draft, taps=taps, mask_token_id=mask_token_id,
                    block_size=block_size, num_target_layers=num_target_layers, dtype=dtype, head=head,
                    dflash_config=config, architecture=ARCHITECTURE)
