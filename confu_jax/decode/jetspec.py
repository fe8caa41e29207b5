"""JetSpec as a ``Drafter``: DFlash's block draft with a causal head, and JetSpec's one-pass tree
(docs/DESIGN.md §11 "JetSpec"; reference: hao-ai-lab/JetSpec at commit 2c7b3fa0 — its head
``jetspec/models/draft_head.py``, its drafter ``jetspec/draft_head_adapter.py`` ``DraftHeadTreeDrafter``,
its default tree ``jetspec/tree/baselines/accum_logp.py``; paper arXiv 2606.18394).

Why it is its own family: the head is DFlash's network (the same tensors, the published
``DFlashDraftModel`` layout) with ``dflash_config.causal_head``: inside the block [x[p+1], M, ..., M]
position k attends the context and block positions 0..k only (``_build_dflash_causal_attention_mask``),
where DFlash's attends the whole block. A causal head's weights drafted bidirectionally (or the reverse)
give other distributions, so the two never load each other's heads.

Drafting, as the reference's ``DraftHeadTreeDrafter.propose_logits``: **one** head forward over the
block gives every depth's distribution (the root and masks: no drafted token enters it); its tree is
``accum_logp:N,W[,D]`` (``decode.plans.FanoutTree``, ``decode.tree.draft_fanout_tree``): from the root,
expand the unexpanded node of best cumulative log-probability with all W children (the next depth's
top-W), until N nodes — the reference's default algorithm, node for node (``tests/unit/test_block_tree.py``).
The target verifies the tree in one pass; its tokens are a deterministic function of the block, so the
greedy rule at T = 0 and the sequential-residual rule at T > 0 keep it lossless (as DFlash's trees).
Chains, ``tree:``, ``dynamic:`` and ``ddtree:`` plans run as DFlash's.

Not built (the reference does not ship them either): ``path_conditional_refresh`` (planned there, "needs
a vLLM draft-side tree-attention hook") and the profile-guided / routed tree shapes.
"""

from __future__ import annotations

import dataclasses
import functools

from confu_jax.decode.dflash import DFlashDrafter, block_depth, load_dflash, parse_dflash_plan
from confu_jax.decode.family import DEFAULT_CARTESIAN_TREES, DrafterFamily, Method, own_weights_loader
from confu_jax.runs import dflash as runs_dflash


@dataclasses.dataclass(frozen=True)
class JetSpecDrafter(DFlashDrafter):
    """A JetSpec head drafting the trees of ``plan`` from one causal block forward (module docstring)."""

    what = "a JetSpec draft"
    params_key = "jetspec"
    causal = True


# JetSpec's own tree first: budget auto's tree candidates (block drafts of a trained head are <= 15 deep)
JETSPEC_TREES = ("accum_logp:8,4,3", "accum_logp:16,4,4", "accum_logp:30,6,6") + DEFAULT_CARTESIAN_TREES + (
    "ddtree:8,3",)

FAMILIES = (DrafterFamily(
    "jetspec", lambda text: JetSpecDrafter(parse_dflash_plan(text)),
    own_weights_loader(functools.partial(load_dflash, causal=True)),
    methods=(Method("jetspec", (), "JetSpec: DFlash's block draft with a causal head, its tree (accum_logp) drafted "
                    "in one forward (trained with configs/*_jetspec.py, or a JetSpec directory)", own_weights=True),),
    trees=JETSPEC_TREES, max_depth=functools.partial(block_depth, key="jetspec"),
    export_formats=(runs_dflash.EXPORT_FORMAT_JETSPEC,)),)
