"""P-EAGLE heads in speculators' ``peagle`` layout (what vLLM's ``eagle3`` proposer serves with parallel
drafting), in and out.

Read from speculators ``models/peagle/config.py`` (``PEagleSpeculatorConfig``: EAGLE-3's config plus
``mask_token_id``, ``speculators_model_type: "peagle"``, architectures ``["PEagleSpeculator"]``,
``speculators_config.algorithm: "peagle"``) and ``models/peagle/core.py`` (``PEagleDraftModel``: the
EAGLE-3 draft's tensors plus ``mask_hidden`` [1, 1, n_taps·d]). Everything EAGLE-3 has is read and written
by ``weights.eagle3_formats`` (the speculators layout); this module adds what P-EAGLE adds.

P-EAGLE trains the draft's copy of the embedding (``embed_requires_grad``): a head whose
``embed_tokens.weight`` differs from the target's keeps its own (``draft['embed_tokens']``, which the
head's blocks then read, ``decode.drafting.head_block``); one equal to the target's reads the target's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from confu_jax import storage
from confu_jax.models.spec import ModelSpec
from confu_jax.weights.eagle3_formats import ImportedHead, assemble_head, export_head, parse_speculators_config
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.tensor_files import read_tensors, save_safetensors
from confu_jax.weights.head_dirs import read_config_json

KIND = "peagle"
ARCH = "PEagleSpeculator"


def is_peagle_dir(directory: str) -> bool:
    c = read_config_json(directory)
    return c is not None and c.get("speculators_model_type") == KIND


def load_peagle_dir(directory: str, param_dtype: str = "float32") -> ImportedHead:
    """A P-EAGLE head from speculators' layout: EAGLE-3's part through ``eagle3_formats``, then
    ``mask_token_id`` and ``mask_hidden`` (head variant 'peagle'). ``embed`` keeps the file's embedding."""
    directory = storage.absolute(os.path.expanduser(directory))
    where = os.path.join(directory, "config.json")
    c = read_config_json(directory)
    if c is None or c.get("speculators_model_type") != KIND:
        raise CheckpointError(f"{where}: expected speculators_model_type {KIND!r} (a P-EAGLE head); got "
                              f"{None if c is None else c.get('speculators_model_type')!r}")
    mask = c.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise CheckpointError(f"{where}: mask_token_id is {mask!r}; expected the token id the parallel slots read")
    sc = c.get("speculators_config") if isinstance(c.get("speculators_config"), dict) else {}
    algo = sc.get("algorithm", KIND)
    if algo != KIND:
        raise CheckpointError(f"{where}: speculators_config.algorithm is {algo!r}; expected {KIND!r}")
    as_eagle3 = {**c, "speculators_model_type": "eagle3", "speculators_config": {**sc, "algorithm": "eagle3"}}
    lc = parse_speculators_config(as_eagle3, where)
    tensors = dict(read_tensors(directory))
    if "mask_hidden" not in tensors:
        raise CheckpointError(f"{directory}: tensor 'mask_hidden' missing (a P-EAGLE head's parallel slots read it)")
    mask_hidden = np.asarray(tensors.pop("mask_hidden"), np.float32).reshape(-1)
    imp = assemble_head(directory, "speculators", lc, tensors, param_dtype)
    n_taps = len(lc["taps"]) if lc["taps"] is not None else 3
    if mask_hidden.size != n_taps * lc["hidden_size"]:
        raise CheckpointError(f"{directory}: mask_hidden has {mask_hidden.size} values; expected {n_taps} taps x "
                              f"{lc['hidden_size']} = {n_taps * lc['hidden_size']}")
    if mask >= lc["vocab_size"]:
        raise CheckpointError(f"{where}: mask_token_id {mask} outside the vocabulary of {lc['vocab_size']}")
    pd = np.asarray(imp.draft["fc"]["kernel"]).dtype  # the head's param dtype
    head = dataclasses.replace(imp.head, variant="peagle", mask_token_id=mask)
    return dataclasses.replace(imp, fmt=KIND, head=head, draft={**imp.draft, "mask_hidden": mask_hidden.astype(pd)})


def own_embedding(imp: ImportedHead, target_embed: np.ndarray) -> Optional[np.ndarray]:
    """The head's embedding where it differs from the target's (P-EAGLE trains its copy), else None."""
    if imp.embed is None:
        return None
    if imp.embed.shape != target_embed.shape:
        raise CheckpointError(f"{imp.source}: embed_tokens.weight has shape {imp.embed.shape}; the target's "
                              f"embedding is {target_embed.shape}")
    same = np.array_equal(np.asarray(imp.embed, np.float32),
                          target_embed.astype(imp.embed.dtype).astype(np.float32))
    return None if same else np.asarray(imp.embed, np.float32)


def export_peagle(out_dir: str, spec: ModelSpec, draft_params: dict, d2t, t2d, *, embed: np.ndarray,
                  dtype: Optional[str] = None, verifier: Optional[str] = None, depth: int = 8) -> str:
    """Write a P-EAGLE head (variant 'peagle') in speculators' layout: the EAGLE-3 layout with
    ``embed`` (the draft's own embedding, else the target's) as ``embed_tokens.weight``, then
    ``mask_hidden`` and the P-EAGLE config keys; ``depth``: the proposal's speculative tokens."""
    if spec.head is None or not spec.head.parallel:
        raise ValueError(f"export_peagle: a P-EAGLE head (variant 'peagle'); got "
                         f"{spec.head.variant if spec.head else 'no head'!r}")
    e3 = ModelSpec(spec.target, dataclasses.replace(spec.head, variant="eagle3", mask_token_id=None))
    core = {k: v for k, v in draft_params.items() if k not in ("mask_hidden", "embed_tokens")}
    export_head(out_dir, "speculators", e3, core, d2t, t2d, dtype=dtype, verifier=verifier, embed=embed)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = read_tensors(out_dir)
    store = np.asarray(tensors["fc.weight"]).dtype
    tensors = {**tensors, "mask_hidden": np.asarray(draft_params["mask_hidden"]).astype(store).reshape(1, 1, -1)}
    save_safetensors(tensors, path)
    with storage.open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=[ARCH], speculators_model_type=KIND, mask_token_id=int(spec.head.mask_token_id),
                  embed_requires_grad=True)
    sc = config["speculators_config"]
    sc["algorithm"] = KIND
    sc["proposal_methods"][0]["speculative_tokens"] = int(depth)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
