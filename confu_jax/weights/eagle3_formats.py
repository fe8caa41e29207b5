"""EAGLE-3 draft heads in the ecosystem's on-disk formats: import (bit-exact) and export.

Why: EAGLE-3 heads trained elsewhere (the SafeAILab release, SpecForge, vLLM's ``speculators``) should
decode here and start ConFu training (the paper initialises ConFu from EAGLE-3), and heads trained
here should serve in SGLang and vLLM. The draft layer is the same computation everywhere
(docs/DESIGN.md §4 "Draft head"); the formats differ in tensor names, where the config lives, the
draft's own RoPE and norm settings, and how ``d2t`` is stored. Layout and conventions: DESIGN.md §10.

Three formats (``FORMATS``):

* ``eagle3`` -- the official SafeAILab layout, which SGLang loads and SpecForge's
  ``export --to sglang`` writes: ``config.json`` (a Llama config of the one draft layer plus
  ``draft_vocab_size``; ``architectures: ["LlamaForCausalLMEagle3"]``) and ``model.safetensors``
  (or its sharded index, or ``pytorch_model.bin``). Tensors ``midlayer.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t`` (int64 OFFSETS: ``target_id = draft_id + d2t[draft_id]``), ``t2d`` (bool
  over the target vocabulary); no embedding (the target's is used). RoPE from the draft's own
  config (``rope_theta`` 10000 when absent, whatever the target's base). Feature taps: the hidden
  states entering target layers 2, L//2, L-3, unless ``eagle_config.eagle_aux_hidden_state_layer_ids``
  lists others -- in SGLang's convention, the *output* of layer i, i.e. entering layer i+1.
* ``speculators`` -- vLLM's format (the ``speculators`` package): ``config.json`` with
  ``speculators_model_type: "eagle3"``, the layer's Llama config under ``transformer_layer_config``,
  ``speculators_config`` (algorithm, proposal methods, verifier), ``eagle_aux_hidden_state_layer_ids``
  (entering-layer ids, as vLLM captures them) and the norm-placement flags ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output`` (all implemented: ``models.spec.HeadConfig``);
  tensors ``layers.0.*`` instead of ``midlayer.*``, optionally ``embed_tokens.weight`` (must equal
  the target's), ``input_norm.weight`` (norm_before_fc), ``fc_norm.{i}.weight`` (fc_norm).
* ``tpu_inference`` -- what tpu-inference (vLLM on TPU, JAX) loads into its own JAX model: the
  official tensors and config under ``architectures: ["Eagle3LlamaForCausalLM"]`` (the name its
  model registry maps to ``EagleLlama3ForCausalLM``; the official ``LlamaForCausalLMEagle3`` falls
  back to vLLM's PyTorch model through torchax) plus ``norm_before_residual``. Its model implements
  no other norm flag, and its targets tap fixed layers (Llama: entering 2, L//2, L-3; its Qwen
  models capture nothing for EAGLE-3), so the exporter refuses heads it would run wrongly
  (``tpu_inference_refusal``).

``pytorch_model.bin`` is a pickle, and unpickling runs code: it is read only through torch's
``weights_only`` loader, which refuses any pickle that names code; a refused file raises
``CheckpointError`` saying so. Anything the draft does not implement (another architecture, more
than one layer, biases, a draft narrower than the target, unknown tensors) raises
``CheckpointError`` naming the key, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import ml_dtypes
import numpy as np

from confu_jax import storage
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.export import model_type_of
from confu_jax.weights.head_dirs import read_config_json
from confu_jax.weights.hf import SUPPORTED_MODEL_TYPES
from confu_jax.weights.hf import rope_from_config
from confu_jax.weights.safetensors_io import FLOAT_DTYPES
from confu_jax.weights.tensor_files import read_tensors, save_safetensors

FORMATS = ("eagle3", "speculators", "tpu_inference")
OFFICIAL_ARCH = "LlamaForCausalLMEagle3"
TPU_INFERENCE_ARCH = "Eagle3LlamaForCausalLM"  # tpu-inference 0.32's model registry key for its JAX EAGLE-3
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

# torch name (after the layer prefix) -> (our param path under 'draft', transpose?)
_LAYER = {
    "self_attn.q_proj.weight": ("q_proj/kernel", True),
    "self_attn.k_proj.weight": ("k_proj/kernel", True),
    "self_attn.v_proj.weight": ("v_proj/kernel", True),
    "self_attn.o_proj.weight": ("o_proj/kernel", True),
    "mlp.gate_proj.weight": ("gate_proj/kernel", True),
    "mlp.up_proj.weight": ("up_proj/kernel", True),
    "mlp.down_proj.weight": ("down_proj/kernel", True),
    "input_layernorm.weight": ("input_norm/scale", False),
    "hidden_norm.weight": ("hidden_norm/scale", False),
    "post_attention_layernorm.weight": ("post_attn_norm/scale", False),
}
_GLOBAL = {
    "fc.weight": ("fc/kernel", True),
    "norm.weight": ("final_norm/scale", False),
    "lm_head.weight": ("lm_head/kernel", True),
}
_LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0.", "tpu_inference": "midlayer."}

_STORE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}


def _name_map(fmt: str, head: HeadConfig, n_taps: int = 3) -> dict:
    """Every tensor a head of this format and head config holds -> (param path, transpose?)."""
    out = {_LAYER_PREFIX[fmt] + k: v for k, v in _LAYER.items()}
    out.update(_GLOBAL)
    if head.norm_before_fc:
        out["input_norm.weight"] = ("fc_input_norm/scale", False)
    if head.fc_norm:
        out.update({f"fc_norm.{i}.weight": (f"fc_tap_norms_{i}/scale", False) for i in range(n_taps)})
    return out


# ----------------------------------------------------------------------------- the imported head


@dataclasses.dataclass(frozen=True)
class ImportedHead:
    """An EAGLE-3 head read from disk, not yet bound to a target (``bind_to_target`` checks it)."""

    source: str
    fmt: str  # 'eagle3' | 'speculators'
    head: HeadConfig  # variant 'eagle3'; the draft's RoPE, norms, FFN width and taps
    draft: dict  # flax parameter tree of DraftHead (numpy, head.param_dtype)
    d2t: np.ndarray  # int32 [V_draft] ABSOLUTE target ids
    t2d: np.ndarray  # bool [V_target]
    arch: dict  # hidden_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size (the target's)
    stored_dtype: str  # dtype of the tensors in the file
    embed: Optional[np.ndarray] = None  # embed_tokens.weight if the file has one (must equal the target's)


def detect_format(directory: str) -> Optional[str]:
    """'speculators' | 'tpu_inference' | 'eagle3' for a directory holding such a head, else None (e.g. a
    train workdir)."""
    c = read_config_json(directory)
    if c is None:
        return None
    if "speculators_model_type" in c:
        return "speculators"
    if TPU_INFERENCE_ARCH in (c.get("architectures") or []):
        return "tpu_inference"
    if OFFICIAL_ARCH in (c.get("architectures") or []) or "draft_vocab_size" in c:
        return "eagle3"
    return None


def load_head(directory: str, param_dtype: str = "float32") -> ImportedHead:
    """Read an EAGLE-3 head in either format; tensors are converted to ``param_dtype`` exactly (f32
    holds every bf16/f16 value), transposed to flax's [in, out] kernels, d2t turned into absolute ids."""
    directory = storage.absolute(os.path.expanduser(directory))
    fmt = detect_format(directory)
    if fmt is None:
        raise CheckpointError(
            f"{directory}: not an EAGLE-3 head: expected config.json with 'speculators_model_type' "
            f"(speculators / vLLM) or architectures [{OFFICIAL_ARCH!r}] / 'draft_vocab_size' (official, "
            "SGLang, SpecForge)")
    where = os.path.join(directory, "config.json")
    c = read_config_json(directory)
    parsed = (parse_speculators_config(c, where) if fmt == "speculators"
              else _parse_official(c, where, TPU_INFERENCE_ARCH if fmt == "tpu_inference" else OFFICIAL_ARCH))
    tensors = read_tensors(directory)
    return assemble_head(directory, fmt, parsed, tensors, param_dtype)


def _need(c: dict, key: str, where: str):
    if key not in c or c[key] is None:
        raise CheckpointError(f"{where}: missing key {key!r}")
    return c[key]


def _layer_config(c: dict, where: str) -> dict:
    """The one draft layer's Llama settings; refuses what DraftHead does not implement."""
    mt = c.get("model_type", "llama")
    if mt != "llama":
        raise CheckpointError(f"{where}: model_type {mt!r}; expected 'llama' (the EAGLE-3 layer we implement "
                              "is Llama's: no q/k norms, no biases)")
    n_layers = int(c.get("num_hidden_layers", 1))
    if n_layers != 1:
        raise CheckpointError(f"{where}: num_hidden_layers is {n_layers}; expected 1 (multi-layer drafts are "
                              "not implemented)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise CheckpointError(f"{where}: {key} is true; expected false (the draft has no biases)")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act is {c['hidden_act']!r}; expected 'silu'")
    d, heads = int(_need(c, "hidden_size", where)), int(_need(c, "num_attention_heads", where))
    theta, scaling = rope_from_config(c, where)
    return {
        "hidden_size": d,
        "num_attention_heads": heads,
        "num_key_value_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": int(c.get("head_dim") or d // heads),
        "intermediate_size": int(_need(c, "intermediate_size", where)),
        "vocab_size": int(_need(c, "vocab_size", where)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
        "rms_eps": float(c.get("rms_norm_eps", 1e-6)),  # LlamaConfig's default when absent
        "dtype": c.get("torch_dtype", c.get("dtype")),
    }


def _check_target_hidden(c: dict, d: int, where: str) -> None:
    th = c.get("target_hidden_size")
    if th is not None and int(th) != d:
        raise CheckpointError(f"{where}: target_hidden_size is {th} but hidden_size is {d}; expected equal "
                              "(the draft runs at the target's width and reads its embeddings)")


def _parse_official(c: dict, where: str, arch: str = OFFICIAL_ARCH) -> dict:
    archs = c.get("architectures") or []
    if archs and arch not in archs:
        raise CheckpointError(f"{where}: architectures {archs}; expected [{arch!r}]")
    lc = _layer_config(c, where)
    _check_target_hidden(c, lc["hidden_size"], where)
    lc["draft_vocab_size"] = int(c.get("draft_vocab_size") or lc["vocab_size"])
    taps = None
    eagle_cfg = c.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    if ids is not None:  # SGLang: id i = output of layer i = the state entering layer i + 1
        taps = tuple(int(i) + 1 for i in ids)
    lc["taps"] = taps
    lc["taps_key"] = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of layer i, i.e. entering i+1)"
    lc["flags"] = {k: bool(c.get(k, False)) for k in NORM_FLAGS}
    return lc


def parse_speculators_config(c: dict, where: str) -> dict:
    kind = c.get("speculators_model_type")
    if kind != "eagle3":
        raise CheckpointError(f"{where}: speculators_model_type is {kind!r}; expected 'eagle3'")
    tl = _need(c, "transformer_layer_config", where)
    if not isinstance(tl, dict):
        raise CheckpointError(f"{where}: transformer_layer_config is {type(tl).__name__}; expected an object")
    lc = _layer_config(tl, f"{where} transformer_layer_config")
    _check_target_hidden(c, lc["hidden_size"], where)
    lc["draft_vocab_size"] = int(c.get("draft_vocab_size") or lc["vocab_size"])
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    lc["taps"] = tuple(int(i) for i in ids) if ids is not None else None
    lc["taps_key"] = "eagle_aux_hidden_state_layer_ids (entering-layer ids, as vLLM captures them)"
    lc["flags"] = {k: bool(c.get(k, False)) for k in NORM_FLAGS}
    if lc["flags"]["norm_before_fc"] and lc["flags"]["fc_norm"]:
        raise CheckpointError(f"{where}: norm_before_fc and fc_norm are both true; expected at most one")
    spec_cfg = c.get("speculators_config") or {}
    algo = spec_cfg.get("algorithm", "eagle3") if isinstance(spec_cfg, dict) else "eagle3"
    if algo != "eagle3":
        raise CheckpointError(f"{where}: speculators_config.algorithm is {algo!r}; expected 'eagle3'")
    return lc


def assemble_head(directory: str, fmt: str, lc: dict, tensors: dict, param_dtype: str) -> ImportedHead:
    flags = lc["flags"]
    head = HeadConfig(
        variant="eagle3", draft_vocab_size=lc["draft_vocab_size"], draft_ffn_dim=lc["intermediate_size"],
        tap_layers=lc["taps"], dtype=param_dtype, param_dtype=param_dtype,
        rope_theta=lc["rope_theta"], rope_scaling=lc["rope_scaling"],
        max_position_embeddings=lc["max_position_embeddings"], rms_eps=lc["rms_eps"], **flags)
    n_taps = len(lc["taps"]) if lc["taps"] is not None else 3
    names = _name_map(fmt, head, n_taps)
    pd = np.dtype(param_dtype) if param_dtype != "bfloat16" else np.dtype(ml_dtypes.bfloat16)
    draft, stored = {}, set()
    for name, (path, transpose) in names.items():
        if name not in tensors:
            raise CheckpointError(f"{directory}: tensor {name!r} missing (a {fmt} EAGLE-3 head has "
                                  f"{sorted(names)})")
        a = np.asarray(tensors[name])
        if a.dtype not in FLOAT_DTYPES.values():
            raise CheckpointError(f"{directory}: tensor {name!r} has dtype {a.dtype}; expected float32/16 or bfloat16")
        stored.add(str(a.dtype))
        a = a.T if transpose else a
        node = draft
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = np.ascontiguousarray(a.astype(pd))  # exact: f32 holds every bf16/f16 value
    embed = np.asarray(tensors["embed_tokens.weight"]) if "embed_tokens.weight" in tensors else None
    ignorable = {"d2t", "t2d", "embed_tokens.weight"}
    extra = sorted(n for n in tensors if n not in names and n not in ignorable
                   and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"{directory}: tensors {extra} are not part of the EAGLE-3 draft we implement "
                              f"(expected only {sorted(names)} + d2t, t2d, embed_tokens.weight); refusing "
                              "to drop them silently")
    d, dv, v = lc["hidden_size"], lc["draft_vocab_size"], lc["vocab_size"]
    _expect_shape(directory, "fc.weight", tensors["fc.weight"], (d, n_taps * d))
    _expect_shape(directory, "lm_head.weight", tensors["lm_head.weight"], (dv, d))
    d2t, t2d = _vocab_maps(directory, tensors, dv, v)
    arch = {k: lc[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                               "vocab_size")}
    stored_dtype = next(iter(stored)) if len(stored) == 1 else str(lc["dtype"] or "float32")
    return ImportedHead(directory, fmt, head, draft, d2t, t2d, arch, stored_dtype, embed)


def _expect_shape(directory, name, a, shape):
    if tuple(np.shape(a)) != tuple(shape):
        raise CheckpointError(f"{directory}: tensor {name!r} has shape {tuple(np.shape(a))}; the config "
                              f"implies {tuple(shape)}")


def _vocab_maps(directory: str, tensors: dict, dv: int, v: int):
    """Absolute d2t and t2d from the file's offsets (identity when the draft keeps the whole vocab)."""
    if "d2t" not in tensors and "t2d" not in tensors:
        if dv != v:
            raise CheckpointError(f"{directory}: no d2t / t2d tensors, but draft_vocab_size {dv} != vocab_size "
                                  f"{v}; expected both maps for a reduced draft vocabulary")
        return np.arange(dv, dtype=np.int32), np.ones((v,), bool)
    for k in ("d2t", "t2d"):
        if k not in tensors:
            raise CheckpointError(f"{directory}: has {'t2d' if k == 'd2t' else 'd2t'} but no {k!r}; expected both")
    off = np.asarray(tensors["d2t"])
    t2d = np.asarray(tensors["t2d"])
    if off.shape != (dv,) or not np.issubdtype(off.dtype, np.integer):
        raise CheckpointError(f"{directory}: d2t is {off.dtype} {off.shape}; expected integer offsets [{dv}]")
    if t2d.shape != (v,):
        raise CheckpointError(f"{directory}: t2d has shape {t2d.shape}; expected [{v}] (the target vocabulary)")
    absolute = off.astype(np.int64) + np.arange(dv, dtype=np.int64)  # target = draft + d2t[draft]
    if absolute.min(initial=0) < 0 or absolute.max(initial=0) >= v:
        raise CheckpointError(f"{directory}: d2t offsets give target ids in [{absolute.min()}, {absolute.max()}]; "
                              f"expected ids in [0, {v}) (d2t must hold offsets: target = draft + d2t[draft])")
    t2d = t2d.astype(bool)
    if len(np.unique(absolute)) != dv or int(t2d.sum()) != dv or not t2d[absolute].all():
        raise CheckpointError(f"{directory}: d2t (as offsets) and t2d disagree: t2d marks {int(t2d.sum())} "
                              f"tokens, d2t maps {dv} draft ids to {len(np.unique(absolute))} distinct target ids")
    return absolute.astype(np.int32), t2d


# ----------------------------------------------------------------------------- binding to a target


def bind_to_target(imp: ImportedHead, target_cfg: LlamaConfig, target_params=None):
    """(ModelSpec, trainable {'draft', 'confu': {}}, draft_vocab {'d2t', 't2d'}) of ``imp`` on this target.

    Refuses a head for another target: width, attention layout, vocabulary, feature layers, and
    (when the file has one) an embedding that differs from the target's.
    """
    a, where = imp.arch, imp.source
    pairs = (("hidden_size", target_cfg.d_model), ("num_attention_heads", target_cfg.n_heads),
             ("num_key_value_heads", target_cfg.n_kv_heads), ("head_dim", target_cfg.head_dim),
             ("vocab_size", target_cfg.vocab_size))
    for key, want in pairs:
        if a[key] != want:
            raise CheckpointError(f"{where}: the head's {key} is {a[key]}; the target has {want} (a head only "
                                  "runs on the target it was trained for)")
    taps = imp.head.tap_layers
    if taps is not None:
        if len(taps) != 3 or any(not 0 <= t < target_cfg.n_layers for t in taps):
            raise CheckpointError(
                f"{where}: feature layers {list(taps)} (hidden states entering those target layers; config key "
                f"{'eagle_config.eagle_aux_hidden_state_layer_ids' if imp.fmt == 'eagle3' else 'eagle_aux_hidden_state_layer_ids'}"
                f"); expected 3 layers in [0, {target_cfg.n_layers}) of this {target_cfg.n_layers}-layer target")
    if imp.embed is not None and target_params is not None:
        target_embed = np.asarray(target_params["embed"]["embedding"])
        if imp.embed.shape != target_embed.shape:
            raise CheckpointError(f"{where}: embed_tokens.weight has shape {imp.embed.shape}; the target's "
                                  f"embedding is {target_embed.shape}")
        mine = np.asarray(imp.embed, np.float32)
        theirs = target_embed.astype(imp.embed.dtype).astype(np.float32)  # compare at the file's precision
        if not np.array_equal(mine, theirs):
            raise CheckpointError(f"{where}: embed_tokens.weight differs from the target's embedding (max abs "
                                  f"difference {float(np.abs(mine - theirs).max()):.3g}); the draft reads the "
                                  "target's embeddings, so this head was trained for another target")
    spec = ModelSpec(target_cfg, imp.head)
    vocab = {"d2t": imp.d2t.astype(np.int32), "t2d": imp.t2d.astype(bool)}
    return spec, {"draft": imp.draft, "confu": {}}, vocab


def head_settings_diff(head: HeadConfig, spec: ModelSpec) -> list:
    """[(setting, the head's value, the spec's effective value)] for every draft setting that
    changes what the same weights compute (RoPE, norm eps, norm placement); config keys draft.<setting>."""
    rope = spec.draft_rope
    have = {"rope_theta": float(rope.rope_theta), "rope_scaling": rope.rope_scaling, "rms_eps": spec.draft_rms_eps,
            **{k: bool(getattr(spec.head, k)) for k in NORM_FLAGS}}
    want = {"rope_theta": float(head.rope_theta) if head.rope_theta is not None else float(spec.target.rope_theta),
            "rope_scaling": head.rope_scaling if head.rope_theta is not None else spec.target.rope_scaling,
            "rms_eps": float(head.rms_eps) if head.rms_eps is not None else spec.target.rms_eps,
            **{k: bool(getattr(head, k)) for k in NORM_FLAGS}}
    return [(k, want[k], have[k]) for k in want if want[k] != have[k]]


# ----------------------------------------------------------------------------- export


def eagle3_part(spec: ModelSpec, trainable: dict):
    """(spec, draft params) of the EAGLE-3 head inside any head: a ConFu head minus its future path
    (MoE_f, the future-entry bias, soft prompts, MoE_con), which serving engines cannot run: they
    have no contemplate tokens."""
    head = dataclasses.replace(spec.head, variant="eagle3", future_bias=None)
    draft = {k: v for k, v in trainable["draft"].items() if k not in ("moe_f", "future_bias")}
    return ModelSpec(spec.target, head), draft


def export_head(out_dir: str, fmt: str, spec: ModelSpec, draft_params: dict, d2t, t2d, *,
                dtype: Optional[str] = None, verifier: Optional[str] = None,
                embed: Optional[np.ndarray] = None) -> str:
    """Write an EAGLE-3 head (``spec.head.variant == 'eagle3'``; see ``eagle3_part``) in ``fmt``.

    ``d2t`` holds absolute target ids (ours), written as EAGLE-3 offsets (not written for a head over the
    whole vocabulary, whose maps are the identity: vLLM refuses them there). ``dtype`` (default: the
    params' own) is the stored float dtype. ``verifier``: the target's name or path, recorded in
    speculators' ``speculators_config.verifier`` (vLLM and speculators read the target from it).
    ``embed``: also store the target's embedding as ``embed_tokens.weight`` (speculators only).
    """
    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
    if spec.head.has_future:
        raise ValueError(f"export_head: a {spec.head.variant!r} head; export its EAGLE-3 part (eagle3_part)")
    h, t = spec.head, spec.target
    flags = {k: bool(getattr(h, k)) for k in NORM_FLAGS}
    if fmt == "eagle3" and any(flags.values()):
        raise ValueError(f"export_head: the official format has no norm-placement flags, this head sets "
                         f"{[k for k, v in flags.items() if v]}; export to 'speculators'")
    if fmt == "tpu_inference" and (why := tpu_inference_refusal(spec)):
        raise ValueError(f"export_head: {why}")
    if embed is not None and fmt != "speculators":
        raise ValueError("export_head: only the speculators format stores an embedding")
    leaves = {}
    for name, (path, transpose) in _name_map(fmt, h, len(spec.taps)).items():
        node = draft_params
        for p in path.split("/"):
            if p not in node:
                raise KeyError(f"export_head: draft params lack {path!r} (needed for {name!r})")
            node = node[p]
        a = np.asarray(node)
        leaves[name] = a.T if transpose else a
    store = _STORE_DTYPES[dtype] if dtype else np.asarray(leaves["fc.weight"]).dtype
    if store not in _STORE_DTYPES.values():
        raise ValueError(f"export_head: params are {store}; pass dtype= one of {sorted(_STORE_DTYPES)}")
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(store)) for k, v in sorted(leaves.items())}
    d2t = np.asarray(d2t, np.int64)
    if not (d2t.size == t.vocab_size and np.array_equal(d2t, np.arange(d2t.size))):
        # a head over the whole vocabulary writes no maps: vLLM builds its draft_id_to_target_id parameter only
        # when draft_vocab_size != the target's vocabulary and refuses a d2t tensor it has no parameter for
        # ("no module or parameter named 'draft_id_to_target_id'"); every reader, ours included, takes absent
        # maps as the identity
        tensors["d2t"] = d2t - np.arange(d2t.size, dtype=np.int64)  # offsets: target = draft + d2t[draft]
        tensors["t2d"] = np.asarray(t2d, bool)
    if embed is not None:
        tensors["embed_tokens.weight"] = np.ascontiguousarray(np.asarray(embed).astype(store))
    dtype_name = {v: k for k, v in _STORE_DTYPES.items()}[store]
    layer = _layer_config_out(spec, dtype_name)
    if fmt == "eagle3":
        config = {"architectures": [OFFICIAL_ARCH], **layer, "draft_vocab_size": h.draft_vocab_size}
        if spec.taps != t.default_taps:
            if min(spec.taps) < 1:
                raise ValueError(f"export_head: taps {spec.taps} include the embeddings (entering layer 0), which "
                                 "SGLang's eagle_config ids (layer outputs) cannot express; export to 'speculators'")
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in spec.taps],
                                      "use_aux_hidden_state": True}
    elif fmt == "tpu_inference":
        # its Eagle3LlamaDecoderLayer reads norm_before_residual from this config; RoPE from the draft's own
        # rope_theta (written always: its default when absent is 500000, not EAGLE-3's 10000)
        config = {"architectures": [TPU_INFERENCE_ARCH], **layer, "draft_vocab_size": h.draft_vocab_size,
                  "target_hidden_size": t.d_model, "norm_before_residual": flags["norm_before_residual"]}
    else:
        config = {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "draft_vocab_size": h.draft_vocab_size,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in spec.taps],
            **flags,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "dtype": dtype_name,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "default_proposal_method": "greedy",
                # the target's own class (a Qwen3 verifier for a Qwen3 target); the draft layer stays Llama's
                "verifier": {"name_or_path": verifier, "architectures": [SUPPORTED_MODEL_TYPES[model_type_of(t)]]},
            },
        }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def tpu_inference_refusal(spec: ModelSpec) -> Optional[str]:
    """Why tpu-inference 0.32's JAX EAGLE-3 would run this head wrongly, or None when it runs it as we do.

    Read from its code (``models/jax/llama_eagle3.py``, ``models/jax/llama3.py``, ``qwen3.py``): the
    draft layer implements ``norm_before_residual`` and nothing else of speculators' flags; the target
    model hands the draft the hidden states entering layers (2, L//2, L-3) whatever the draft's
    config says, and only its Llama model captures them for EAGLE-3."""
    h, t = spec.head, spec.target
    unsupported = [k for k in NORM_FLAGS if k != "norm_before_residual" and getattr(h, k)]
    if unsupported:
        return (f"tpu-inference's EAGLE-3 layer implements norm_before_residual only; this head sets {unsupported} "
                "(EAGLE 3.1 sets fc_norm + norm_output): serve it in vLLM or SGLang (--format speculators)")
    if model_type_of(t) != "llama":
        return (f"tpu-inference captures EAGLE-3's hidden states in its Llama model only; this head drafts for a "
                f"{model_type_of(t)} target, whose JAX model there hands the draft nothing (--format speculators "
                "serves it in vLLM)")
    if tuple(spec.taps) != tuple(t.default_taps):
        return (f"tpu-inference taps the hidden states entering layers {list(t.default_taps)} of this "
                f"{t.n_layers}-layer target whatever the head's config says; this head was trained on "
                f"{list(spec.taps)} (--format speculators serves its own taps in vLLM)")
    return None


def _layer_config_out(spec: ModelSpec, dtype_name: str) -> dict:
    """The draft layer's Llama config, in both transformers forms (4.x rope_theta / rope_scaling,
    5.x rope_parameters), as SpecForge's exporter writes it for older and newer serving stacks."""
    t, h, rope = spec.target, spec.head, spec.draft_rope
    theta = float(rope.rope_theta)
    if rope.rope_scaling is None:
        params, scaling = {"rope_type": "default", "rope_theta": theta}, None
    else:
        f, low, high, ctx = rope.rope_scaling
        scaling = {"rope_type": "llama3", "factor": float(f), "low_freq_factor": float(low),
                   "high_freq_factor": float(high), "original_max_position_embeddings": int(ctx)}
        params = {**scaling, "rope_theta": theta}
    return {
        "model_type": "llama",
        "hidden_size": t.d_model,
        "intermediate_size": spec.draft_ffn_dim,
        "num_attention_heads": t.n_heads,
        "num_key_value_heads": t.n_kv_heads,
        "head_dim": t.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": spec.draft_rms_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": params,
        "max_position_embeddings": int(h.max_position_embeddings or t.max_position_embeddings),
        "vocab_size": t.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }
