"""Draft models for decoding and SD² training: where they come from, and whether they fit the target.

Shared by ``decode`` (``decode.loaded``: the drafter a method decodes with) and ``train``
(``train.sd2_task``: the pretrained drafter SD² fine-tunes), which do not import each other
(docs/DESIGN.md §2). A **draft source** is

* ``self:N`` — the early-exit self-drafter (``models.early_exit``): the target's first N layers and
  its final norm / LM head, weights read from the target (no file, no hub);
* an asset name, a GGUF file or a Hugging Face directory (``weights.load_model``) holding a Llama
  that shares the target's tokenizer — checked here (``check_tokenizers``: vocabulary size, then
  the token string of every id) and refused with ``TokenizerMismatchError`` otherwise.

A trained SD² run (``launch.train`` with ``configs/*_sd2.py``) stores the steering parameters and
the drafter's fine-tuning as a **delta** on the pretrained drafter (``load_sd2_run``: weights =
pretrained + delta), so its checkpoints never copy the pretrained weights and training starts from
zeros.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.early_exit import early_exit_config, early_exit_params, parse_self_source
from confu_jax.models.llama import LlamaConfig, param_shapes


class TokenizerMismatchError(ValueError):
    """The draft model's tokenizer is not the target's: its token ids would mean other text."""


def tokenizer_fingerprint(tok) -> str:
    """SHA-256 of a ``ChatTokenizer``'s vocabulary (every token string with its id, added tokens
    included): equal iff the ids mean the same strings."""
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
                          .encode()).hexdigest()


def check_tokenizers(target_tok, draft_tok, *, target_name: str = "the target",
                     draft_name: str = "the draft model") -> None:
    """Refuse a draft model whose tokenizer differs from the target's (vocabulary size, then the
    token strings by id); raises ``TokenizerMismatchError`` naming the first differences."""
    vt, vd = target_tok.vocab_size, draft_tok.vocab_size
    if vt != vd:
        raise TokenizerMismatchError(
            f"{draft_name} does not share {target_name}'s tokenizer: vocabulary of {vd} tokens, the target's has "
            f"{vt}. A draft model must use the target's tokenizer (its token ids are what the target verifies)")
    if tokenizer_fingerprint(target_tok) == tokenizer_fingerprint(draft_tok):
        return
    t_ids = {i: s for s, i in target_tok.tokenizer.get_vocab(with_added_tokens=True).items()}
    d_ids = {i: s for s, i in draft_tok.tokenizer.get_vocab(with_added_tokens=True).items()}
    diff = [(i, t_ids.get(i), d_ids.get(i)) for i in sorted(set(t_ids) | set(d_ids)) if t_ids.get(i) != d_ids.get(i)]
    shown = ", ".join(f"id {i}: target {a!r} vs draft {b!r}" for i, a, b in diff[:3])
    raise TokenizerMismatchError(
        f"{draft_name} does not share {target_name}'s tokenizer: same size ({vt}) but {len(diff)} token ids map to "
        f"other strings ({shown}{', ...' if len(diff) > 3 else ''}). A draft model must use the target's tokenizer")


class DraftSource(NamedTuple):
    cfg: LlamaConfig  # the draft model's architecture (compute dtype and attention as the target's)
    params: Optional[dict]  # its weights; None for the early-exit self-drafter (read from the target)
    source: str  # what it was loaded from, for logs and reports


def load_drafter(source: str, target_cfg: LlamaConfig, *, target_tokenizer=None,
                 target_source: str = "the loaded target") -> DraftSource:
    """The pretrained draft model of ``source`` (module docstring) for this target.

    An external model's tokenizer is checked against ``target_tokenizer`` (a ``ChatTokenizer``;
    default: loaded from ``target_source``). Its compute dtype and attention implementation follow
    the target's."""
    n = parse_self_source(source, target_cfg)
    if n is not None:
        return DraftSource(early_exit_config(target_cfg, n), None,
                       f"self:{n} (the target's first {n} of {target_cfg.n_layers} layers + its final norm and LM head)")
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    if target_tokenizer is None:
        try:
            target_tokenizer = ChatTokenizer.load(target_source)
        except Exception as e:  # noqa: BLE001 - say what is needed instead of a loader's error
            raise ValueError(f"draft model {source!r}: its tokenizer must be checked against the target's, but "
                             f"the target's tokenizer could not be loaded from {target_source!r} ({e}); pass "
                             "target_tokenizer") from e
    check_tokenizers(target_tokenizer, ChatTokenizer.load(source), target_name=f"the target ({target_source})",
                     draft_name=f"draft model {source!r}")
    cfg, params = load_model(source, target_cfg.param_dtype)
    cfg = cfg.replace(dtype=target_cfg.dtype, attention_impl=target_cfg.attention_impl,
                      flash_impl=target_cfg.flash_impl)
    return DraftSource(cfg, params, source)


def drafter_weights(d: DraftSource, target_params) -> dict:
    """The drafter's weights as a stacked Llama tree (the early exit's sliced from the target)."""
    return early_exit_params(target_params, d.cfg.n_layers) if d.params is None else d.params


# ----------------------------------------------------------------------------- trained SD² runs


def is_sd2_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has an ``sd2`` section (a trained SD² drafter)."""
    cfg = os.path.join(path, "config.json")
    if not (os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(cfg)):
        return False
    with open(cfg) as f:
        return "sd2" in json.load(f)


def sd2_trainable_shapes(drafter_cfg: LlamaConfig, target_cfg: LlamaConfig, n_taps: int,
                         train_drafter: bool, steer: bool = True) -> dict:
    """ShapeDtypeStructs of an SD² run's trainable tree: ``{'draft': {'steering': ... (unless the run
    is the distilled baseline, ``steer`` False), 'model_delta': the drafter's parameter tree (only
    when the drafter is fine-tuned)}}``."""
    from confu_jax.models.steering import steering_shapes

    draft = {"steering": steering_shapes(target_cfg.d_model, n_taps, drafter_cfg)} if steer else {}
    if train_drafter:
        draft["model_delta"] = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), param_shapes(drafter_cfg))
    return {"draft": draft}


class SD2Run(NamedTuple):
    drafter: DraftSource  # cfg + the fine-tuned weights (pretrained + delta)
    steering: Optional[dict]  # {'w_hml', 'w_s'}; None for the distilled baseline (config.sd2.steer False)
    step: int
    config: object  # the training config


def load_sd2_run(workdir: str, target_cfg: LlamaConfig, target_params, *, target_tokenizer=None,
                 target_source: str = "the loaded target", step: Optional[int] = None) -> SD2Run:
    """A trained SD² drafter: its pretrained drafter (``config.sd2.drafter``) + the checkpoint's
    delta, and the steering parameters (None for a distilled run, ``config.sd2.steer`` False); the
    target is checked against the run's ``target.json``."""
    from confu_jax.runs.checkpoint import restore_params
    from confu_jax.runs.heads import check_run_fingerprint, read_config

    workdir = os.path.abspath(os.path.expanduser(workdir))
    config = read_config(workdir)
    if "sd2" not in config:
        raise ValueError(f"{workdir}/config.json has no 'sd2' section: not an SD² run")
    check_run_fingerprint(workdir, target_params, target_source,
                          "an SD² drafter is steered by its own target's hidden states")
    base = load_drafter(str(config.sd2.drafter), target_cfg, target_tokenizer=target_tokenizer,
                        target_source=target_source)
    train_drafter = bool(config.sd2.train_drafter)
    steer = bool(config.sd2.get("steer", True))
    params, step = restore_params(os.path.join(workdir, "checkpoints"),
                                  sd2_trainable_shapes(base.cfg, target_cfg, 3, train_drafter, steer), step)
    trained = params["draft"]
    weights = jax.device_get(drafter_weights(base, target_params))
    if train_drafter:
        weights = jax.tree_util.tree_map(lambda w, d: (np.asarray(w, np.float32) + d).astype(np.asarray(w).dtype),
                                         weights, trained["model_delta"])
    drafter = DraftSource(base.cfg, weights, f"{workdir} (step {step}; drafter {base.source})")
    return SD2Run(drafter, trained.get("steering"), step, config)
