"""DSpark drafts in speculators' ``dspark`` layout (what vLLM's ``Qwen3DSparkForCausalLM`` loads), in and out.

Read from speculators ``models/dspark/config.py`` (``DSparkSpeculatorConfig``: DFlash's speculators config —
``transformer_layer_config``, ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids``,
``mask_token_id``, ``sample_from_anchor`` — plus ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``), ``models/dspark/model_definitions.py`` (tensor
names) and ``models/dflash/core.py`` (a full-vocabulary draft saves neither ``embed_tokens`` nor ``lm_head``:
both are the verifier's).

Tensors: the DFlash backbone's (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*``: ``models.dflash``'s
reference names), ``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
``markov_head.gate_proj.{weight,bias}`` (gated) or ``markov_head.joint_proj.{weight,bias}`` (rnn),
``confidence_head.proj.{weight,bias}``. ``aux_hidden_state_layer_ids`` are hidden-state indices as speculators
and vLLM capture them (id i = the state entering layer i), this project's taps as they are.

Not read: a reduced draft vocabulary (``lm_head`` + ``d2t``) and ``sample_from_anchor`` false (DFlash's reading
of the block, which is the ``dflash`` family's).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import numpy as np

from confu_jax.models import dspark as D
from confu_jax.models.dflash import from_reference_state_dict, to_reference_state_dict
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.tensor_files import read_tensors
from confu_jax.weights.export import hf_config_dict
from confu_jax.weights.head_dirs import dtype_name, read_config_json
from confu_jax.weights.hf import config_from_dict
from confu_jax.weights.safetensors_io import save_file

KIND = "dspark"
ARCH = "DSparkSpeculator"
_HEADS = {"markov_head.markov_w1.weight": ("markov", "w1", False), "markov_head.markov_w2.weight": ("markov", "w2", True),
          "markov_head.gate_proj.weight": ("markov_gate", "kernel", True),
          "markov_head.gate_proj.bias": ("markov_gate", "bias", False),
          "markov_head.joint_proj.weight": ("markov_rnn", "kernel", True),
          "markov_head.joint_proj.bias": ("markov_rnn", "bias", False),
          "confidence_head.proj.weight": ("confidence", "kernel", True),
          "confidence_head.proj.bias": ("confidence", "bias", False)}


class ImportedDSpark(NamedTuple):
    params: dict  # models.dspark tree (numpy float32), no decode scalars
    draft: LlamaConfig
    block_size: int
    mask_token_id: int
    taps: tuple
    source: str


def is_dspark_dir(path: str) -> bool:
    c = read_config_json(path) if os.path.isdir(path) else None
    return c is not None and c.get("speculators_model_type") == KIND


def load_dspark_dir(directory: str) -> ImportedDSpark:
    """A speculators DSpark directory -> our tree (float32), every shape and setting checked."""
    directory = os.path.abspath(os.path.expanduser(directory))
    where = os.path.join(directory, "config.json")
    c = read_config_json(directory)
    if c is None or c.get("speculators_model_type") != KIND:
        raise ValueError(f"{where}: expected speculators_model_type {KIND!r} (a DSpark draft)")
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{where}: transformer_layer_config is {type(tl).__name__}; expected an object")
    plain = {k: v for k, v in tl.items() if k not in ("architectures", "layer_types")}
    # config_from_dict reads the shared Llama / Qwen3 fields; the draft is a Qwen3 layer stack (models.dflash)
    draft = config_from_dict({**plain, "model_type": "llama"}, f"{where} transformer_layer_config")
    if c.get("sample_from_anchor", True) is not True:
        raise ValueError(f"{where}: sample_from_anchor is {c.get('sample_from_anchor')!r}; DSpark's block drafts from "
                         "its anchor slot (true): a block read the DFlash way is the dflash family's")
    dv = int(c.get("draft_vocab_size") or draft.vocab_size)
    if dv != draft.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {dv} < the vocabulary {draft.vocab_size}: a reduced draft "
                         "vocabulary (lm_head + d2t) is not read yet; expected a full-vocabulary draft")
    for key in ("mask_token_id", "block_size", "aux_hidden_state_layer_ids"):
        if c.get(key) is None:
            raise ValueError(f"{where}: {key} is missing")
    kind = c.get("markov_head_type", "vanilla")
    if kind not in D.HEAD_TYPES or int(c.get("markov_rank", 0)) < 1:
        raise ValueError(f"{where}: markov_head_type {kind!r}, markov_rank {c.get('markov_rank')}; expected one of "
                         f"{D.HEAD_TYPES} with rank >= 1 (markov_rank 0 is DFlash drafting: the dflash family)")
    taps = tuple(int(i) for i in c["aux_hidden_state_layer_ids"])
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in read_tensors(directory).items()}
    sd = {k: v for k, v in sd.items() if k not in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                                   "verifier_norm.weight", "d2t", "t2d")}
    heads = {k: sd.pop(k) for k in list(sd) if k in _HEADS}
    try:
        params = dict(from_reference_state_dict(sd, draft, len(taps)))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    for name, x in heads.items():
        group, leaf, transpose = _HEADS[name]
        x = np.asarray(x, np.float32)
        params.setdefault(group, {})[leaf] = np.ascontiguousarray(x.T if transpose else x)
    want = D.init_shapes(draft, len(taps), draft.vocab_size, rank=int(c["markov_rank"]), kind=kind,
                         confidence=bool(c.get("enable_confidence_head", True)),
                         confidence_with_markov=bool(c.get("confidence_head_with_markov", True)))
    got = {g: {k: tuple(np.shape(v)) for k, v in params[g].items()} for g in D.EXTRA if g in params}
    need = {g: {k: tuple(v.shape) for k, v in want[g].items()} for g in D.EXTRA if g in want}
    if got != need:
        raise ValueError(f"{directory}: the Markov / confidence tensors {got} do not match the config's {need}")
    return ImportedDSpark(params, draft, int(c["block_size"]), int(c["mask_token_id"]), taps, directory)


def save_dspark_dir(directory: str, params: dict, draft: LlamaConfig, *, taps, mask_token_id: int, block_size: int,
                    verifier: Optional[str] = None, verifier_arch: str = "Qwen3ForCausalLM", dtype=np.float32) -> str:
    """Write ``config.json`` + ``model.safetensors`` in speculators' layout (``dtype``: float32, float16, bfloat16)."""
    sd = to_reference_state_dict(D.backbone(params))
    for name, (group, leaf, transpose) in _HEADS.items():
        if group in params:
            x = np.asarray(params[group][leaf])
            sd[name] = np.ascontiguousarray(x.T if transpose else x)
    layer = {k: v for k, v in hf_config_dict(draft).items() if k not in ("dtype",)}
    layer.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], layer_types=["full_attention"] * draft.n_layers,
                 use_sliding_window=False, sliding_window=None)
    rank = D.markov_rank(params)
    conf = params.get("confidence")
    config = {
        "architectures": [ARCH], "speculators_model_type": KIND, "speculators_version": "0.9.0",
        "dtype": dtype_name(dtype), "transformer_layer_config": layer, "draft_vocab_size": int(draft.vocab_size),
        "block_size": int(block_size), "target_hidden_size": None, "aux_hidden_state_layer_ids": [int(t) for t in taps],
        "mask_token_id": int(mask_token_id), "sliding_window_non_causal": False, "sample_from_anchor": True,
        "markov_rank": rank, "markov_head_type": D.head_type(params), "enable_confidence_head": conf is not None,
        "confidence_head_with_markov": conf is not None and np.shape(conf["kernel"])[0] == draft.d_model + rank,
        "speculators_config": {
            "algorithm": KIND,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(block_size),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [verifier_arch]}},
    }
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(np.asarray(v, dtype)) for k, v in sd.items()},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory
