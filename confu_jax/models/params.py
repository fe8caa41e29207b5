"""The trainable tree and parameter accounting for a ModelSpec.

Trainable parameters live in one tree ``{'draft': draft_params, 'confu': confu_params}`` (what the
optimizer sees); the frozen target parameters and the draft vocabulary maps are separate trees.
"""

from __future__ import annotations

import jax
import numpy as np

from confu_jax.models.draft import init_draft_params
from confu_jax.models.llama import param_shapes
from confu_jax.models.spec import ModelSpec
from confu_jax.models.target import init_confu_params


def init_trainable(spec: ModelSpec, rng: jax.Array) -> dict:
    """``{'draft': ..., 'confu': ...}`` (``confu`` is ``{}`` for eagle3)."""
    d_rng, c_rng = jax.random.split(rng)
    return {"draft": init_draft_params(spec, d_rng), "confu": init_confu_params(spec, c_rng)}


def trainable_shapes(spec: ModelSpec) -> dict:
    """Shape/dtype tree of ``init_trainable`` without allocating."""
    return jax.eval_shape(lambda r: init_trainable(spec, r), jax.random.PRNGKey(0))


def _count(tree) -> int:
    return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree)))


def param_counts(spec: ModelSpec) -> dict:
    """Parameter counts by group, from shapes only (works for 8B configs on a laptop).

    ``draft`` counts the EAGLE-3 layer (fc, attention, MLP, norms, lm_head; the embedding is the
    target's); ``confu_extras`` counts what ConFu adds: soft prompts, MoE_con and MoE_f.
    """
    tr = trainable_shapes(spec)
    draft = dict(tr["draft"])
    moe_f = draft.pop("moe_f", {})
    confu = tr["confu"]
    soft = {k: v for k, v in confu.items() if k.startswith("soft_prompt")}
    return {
        "target": _count(param_shapes(spec.target)),
        "draft": _count(draft),
        "confu_soft_prompts": _count(soft),
        "confu_moe_con": _count(confu.get("moe_con", {})),
        "confu_moe_f": _count(moe_f),
        "confu_extras": _count(confu) + _count(moe_f),
        "trainable": _count(tr),
    }
