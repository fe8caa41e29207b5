"""Pair a loaded target with a draft head for speculative decoding: trained, or random for checks.

A random head proposes near-uniform tokens, so τ stays near 1 — but the output must still be the
target's (losslessness does not depend on the draft), which makes it the cheapest end-to-end check
of a decoding path. Random heads use the whole target vocabulary as draft vocabulary (identity
d2t), so no token-frequency data is needed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.decode.loop import spec_params
from confu_jax.models.draft import identity_draft_vocab
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.params import init_trainable
from confu_jax.models.spec import HeadConfig, ModelSpec

# --method name -> head variants it accepts from a checkpoint (the first one for random heads)
METHOD_VARIANTS = {
    "eagle3": ("eagle3",),
    "confu": ("confu", "confu_nomoe", "confu_nomoe_norep"),
    "confu_nomoe": ("confu_nomoe", "confu_nomoe_norep"),
    "confu_nomoe_norep": ("confu_nomoe_norep",),
}


class DecodeHead(NamedTuple):
    spec: ModelSpec
    params: dict  # loop.spec_params tree: target + trainable + draft vocab
    trained: bool
    source: str  # the workdir, or 'random (seed N)'


def random_head(method: str, target_cfg: LlamaConfig, target_params: dict, seed: int = 0) -> DecodeHead:
    variant = METHOD_VARIANTS[method][0]
    head = HeadConfig(variant=variant, draft_vocab_size=target_cfg.vocab_size)
    spec = ModelSpec(target_cfg, head)
    trainable = jax.device_get(init_trainable(spec, jax.random.PRNGKey(seed)))
    vocab = identity_draft_vocab(target_cfg.vocab_size, target_cfg.vocab_size)
    return DecodeHead(spec, spec_params(target_params, trainable, vocab), False, f"random (seed {seed})")


def trained_head(method: str, workdir: str, target_cfg: LlamaConfig, target_params: dict,
                 step: Optional[int] = None) -> DecodeHead:
    """The head of a ``launch.train`` workdir on this target (shapes checked against it)."""
    from confu_jax.train.heads import load_trained_head

    h = load_trained_head(workdir, step)
    if h.spec.head.variant not in METHOD_VARIANTS[method]:
        raise ValueError(f"{workdir} holds a {h.spec.head.variant!r} head; --method {method} needs one of "
                         f"{METHOD_VARIANTS[method]}")
    trained_t = h.spec.target
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if getattr(trained_t, field) != getattr(target_cfg, field):
            raise ValueError(f"{workdir} was trained on preset {h.config.model.preset!r} with {field}="
                             f"{getattr(trained_t, field)}; the loaded target has {getattr(target_cfg, field)}")
    spec = ModelSpec(target_cfg, h.spec.head)
    vocab = {"d2t": np.asarray(h.draft_vocab["d2t"], np.int32), "t2d": np.asarray(h.draft_vocab["t2d"])}
    return DecodeHead(spec, spec_params(target_params, h.trainable, vocab), True, f"{workdir} (step {h.step})")


def decode_head(method: str, target_cfg: LlamaConfig, target_params: dict, workdir: Optional[str] = None,
                seed: int = 0) -> DecodeHead:
    if method not in METHOD_VARIANTS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {sorted(METHOD_VARIANTS)}")
    if workdir:
        return trained_head(method, workdir, target_cfg, target_params)
    return random_head(method, target_cfg, target_params, seed)
