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

import os
from typing import NamedTuple, Optional

import numpy as np

from confu_jax.models import dspark as D
from confu_jax.models.dflash import from_reference_state_dict, to_reference_state_dict
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.speculators_blocks import is_kind, read_block_dir, write_block_dir

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
    return is_kind(path, KIND)


def load_dspark_dir(directory: str) -> ImportedDSpark:
    """A speculators DSpark directory -> our tree (float32), every shape and setting checked."""
    directory = os.path.abspath(os.path.expanduser(directory))
    c, draft, taps, sd, where = read_block_dir(directory, KIND, sample_from_anchor=True, family="DSpark")
    kind = c.get("markov_head_type", "vanilla")
    if kind not in D.HEAD_TYPES or int(c.get("markov_rank", 0)) < 1:
        raise ValueError(f"{where}: markov_head_type {kind!r}, markov_rank {c.get('markov_rank')}; expected one of "
                         f"{D.HEAD_TYPES} with rank >= 1 (markov_rank 0 is DFlash drafting: the dflash family)")
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
    rank = D.markov_rank(params)
    conf = params.get("confidence")
    fields = {"markov_rank": rank, "markov_head_type": D.head_type(params), "enable_confidence_head": conf is not None,
              "confidence_head_with_markov": conf is not None and np.shape(conf["kernel"])[0] == draft.d_model + rank}
    return write_block_dir(directory, sd, draft, kind=KIND, arch=ARCH, taps=taps, mask_token_id=mask_token_id,
                           block_size=block_size, sample_from_anchor=True, fields=fields, verifier=verifier,
                           verifier_arch=verifier_arch, dtype=dtype)
