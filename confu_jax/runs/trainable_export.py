"""A head as its whole trainable tree in one safetensors file: how ConFu heads travel and are released.

EAGLE-3 heads have a published layout (``weights.eagle3_formats``) that other frameworks load; a ConFu
head has more than the EAGLE-3 draft layer (soft prompts, MoE_con, MoE_f, the future token) and no
published layout. This format keeps every trainable leaf of a ``launch.train`` run, so it holds any
variant, and loads back as the run's own head (``runs.heads.load_trained_head`` reads it wherever a
workdir is accepted):

* ``model.safetensors``: every trainable leaf under its '/'-joined path (``draft/fc/kernel``), float
  leaves in ``dtype`` (bf16 for releases);
* ``draft_vocab.npz``: ``d2t`` (int32 target ids of the draft rows) and ``t2d`` (bool over the target
  vocabulary);
* ``config.json``: the run's training config (the head's architecture is read from it);
* ``target.json``: the target's weights fingerprint (``runs.heads.write_target_record``), if the run
  had one;
* ``export.json``: ``format`` (``FORMAT``), dtype, step, variant, parameter count.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from confu_jax import storage
from confu_jax.models.spec import ModelSpec

FORMAT = "confu_jax.trainable"
# what the first GPU campaign wrote (experiments.gpu_campaign's export_confu): the same files
_FORMATS = (FORMAT, "confu_jax.trainable_bf16")
EXPORT_FILE = "export.json"
FILES = ("model.safetensors", "draft_vocab.npz", "config.json")


class TrainedHead(NamedTuple):
    """A saved head as it loads (a ``launch.train`` workdir's checkpoint, a release or this export):
    ``runs.heads.load_trained_head`` returns it."""

    config: ml_collections.ConfigDict  # the training config (model / confu / draft sections)
    spec: ModelSpec  # target preset's LlamaConfig + the head; swap in the loaded target's cfg
    trainable: dict  # {'draft': ..., 'confu': ...} as in models.params.init_trainable
    draft_vocab: dict  # {'d2t': int32 [V_draft], 't2d': bool [V_target]}
    step: int


def _key(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def is_trainable_export(directory: str) -> bool:
    from confu_jax.runs.head_release import declared_format

    return declared_format(os.path.join(directory, EXPORT_FILE)) in _FORMATS


def write_trainable(head: "TrainedHead", out: str, *, dtype: str = "bfloat16", config_file: str = "",
                    target_file: str = "") -> dict:
    """Write ``head`` to ``out`` (``config_file``: the run's config.json to copy, else the head's config;
    ``target_file``: its target record, copied when given); returns ``export.json``'s content.
    ``runs.heads.export_trainable`` reads a workdir's checkpoint and calls this."""
    from confu_jax.weights.safetensors_io import save_file

    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(head.trainable):
        a = np.asarray(leaf)
        tensors[_key(path)] = a.astype(jax.numpy.dtype(dtype)) if a.dtype.kind == "f" else a
    storage.makedirs(out)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    np.savez(os.path.join(out, "draft_vocab.npz"), d2t=np.asarray(head.draft_vocab["d2t"], np.int32),
             t2d=np.asarray(head.draft_vocab["t2d"], bool))
    if config_file and storage.isfile(config_file):
        shutil.copyfile(config_file, os.path.join(out, "config.json"))
    else:  # a trainable export re-exported: its config is in memory
        with storage.open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(head.config.to_dict(), f, indent=1)
    if target_file and storage.isfile(target_file):
        shutil.copyfile(target_file, os.path.join(out, os.path.basename(target_file)))
    meta = {"format": FORMAT, "dtype": dtype, "step": int(head.step), "variant": head.spec.head.variant,
            "n_params": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(head.trainable)))}
    with storage.open(os.path.join(out, EXPORT_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_trainable_export(directory: str):
    """The head of an export as a ``TrainedHead`` (float32 leaves), its shapes checked against the
    architecture its ``config.json`` describes."""
    from confu_jax.models.params import trainable_shapes
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.weights import packed_files
    from confu_jax.weights.safetensors_io import SafetensorsFile

    missing = [f for f in FILES + (EXPORT_FILE,) if not packed_files.exists(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(f"{directory}: a trainable-tree head export needs {list(FILES + (EXPORT_FILE,))}; "
                                f"missing {missing}")
    with storage.open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = ml_collections.ConfigDict(json.load(f))
    with storage.open(os.path.join(directory, EXPORT_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    st = SafetensorsFile(packed_files.local(os.path.join(directory, "model.safetensors")))
    names = set(st.names())
    spec = model_spec_from_config(config)
    shapes = trainable_shapes(spec)
    wanted = {_key(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)}
    if wanted != names:
        raise ValueError(f"{directory}/model.safetensors: tensors {sorted(names - wanted)} are not in the head "
                         f"config.json describes, and {sorted(wanted - names)} are missing")

    def leaf(path, x):
        a = np.asarray(st.get(_key(path))).astype(x.dtype)
        if a.shape != tuple(x.shape):
            raise ValueError(f"{directory}: {_key(path)} has shape {a.shape}; the head in config.json "
                             f"wants {tuple(x.shape)}")
        return a

    trainable = jax.tree_util.tree_map_with_path(leaf, shapes)
    with storage.open(os.path.join(directory, "draft_vocab.npz"), "rb") as f, np.load(f) as z:
        vocab = {"d2t": np.asarray(z["d2t"], np.int32), "t2d": np.asarray(z["t2d"], bool)}
    if vocab["d2t"].shape != (spec.head.draft_vocab_size,) or vocab["t2d"].shape != (spec.target.vocab_size,):
        raise ValueError(f"{directory}/draft_vocab.npz: d2t {vocab['d2t'].shape} / t2d {vocab['t2d'].shape}, "
                         f"expected ({spec.head.draft_vocab_size},) / ({spec.target.vocab_size},)")
    return TrainedHead(config, spec, trainable, vocab, int(meta["step"]))
