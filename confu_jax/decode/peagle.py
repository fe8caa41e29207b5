"""P-EAGLE as a ``Drafter``: EAGLE-3's head drafting every depth in one pass (arXiv 2602.01469).

Reference: speculators ``models/peagle/core.py`` (``PEagleDraftModel.forward``) and ``attention.py``
(``create_peagle_mask_mod``), the layout vLLM's ``eagle3`` proposer serves with ``parallel_drafting``.

Why it is its own family: an EAGLE-3 head drafts depth by depth, each step reading the previous step's
draft state; P-EAGLE's head drafts D tokens in **one** forward. In this project's terms (p = the last
accepted position, x[p+1] = the bonus / root; draft entry j = (token x[j+1], g[j] = fc(h_cat[j])) at
position j, as EAGLE-3's, ``decode.drafting``):

* slot 0 is EAGLE-3's ingestion: the pending entries p-n+1..p run as one causal block against the
  draft cache and are committed; the anchor p's logits draft depth 1 (x[p+2]);
* slots k = 1..D-1 are (the mask token's embedding, fc(``mask_hidden``)) at positions p+k — the
  reference's depth-k rows of one rollout, whose input ids are ``mask_token_id`` and whose hidden states
  are the learned ``mask_hidden`` [3d] through the same norms and fc — attending the committed cache
  (entries 0..p: the reference's depth-0 rows with anchor <= its own) and the slots before them
  (same rollout, depth <= their own); slot k's logits draft depth k+1.

No slot sees a drafted token, so like DFlash's block every node at depth d gets slot d-1's
distribution whatever its parent: the plan grows from the block's per-depth distributions
(``PlanDrafter.draft_positional``): ``chain:K`` (each slot's argmax), ``sampled_chain:K`` (each
drawn from its own softmax after the target's temperature / top-p; Leviathan's rule with exactly
that q), ``tree:k1,...,kD`` (Cartesian per-slot top-k), ``dynamic:D,K,N`` and DDTree's
``ddtree:N[,D]``. ``update`` is EAGLE-3's: the accepted path's tokens and h_cat refill the ingestion
buffer. The mask token's embedding is the target's (this project's heads read the target's frozen
embeddings; the reference trains the draft's copy, ``embed_requires_grad``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from confu_jax.decode.drafter import DraftInput, Proposal
from confu_jax.decode.drafting import HeadDraftState, HeadDrafter, head_block, ingest_entries, load_head_weights
from confu_jax.decode.family import DEFAULT_CHAINS, DrafterFamily, Method, source_path
from confu_jax.decode.loaded import LoadedDrafter, check_release, head_weights
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.decode.params import DrafterParams, Target
from confu_jax.models import draft as draft_lib
from confu_jax.runs import peagle as runs_peagle

PEAGLE_FORMS = ("chain:K, sampled_chain:K, dynamic:D,K,N, tree:k1,...,kD (top-k_i of slot i, Cartesian) or "
                "ddtree:N[,D] (DDTree: the N best nodes over the slots' top-k, at most D deep) or accum_logp:N,W[,D] "
                "(JetSpec's tree: the best node's W children at a time, N nodes)")


def parse_peagle_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N``, ``tree:k1,...,kD`` or ``ddtree:N[,D]``."""
    return parse_plan(text, what="P-EAGLE", forms=PEAGLE_FORMS, block=True)


def parallel_logits(target: Target, dp: DrafterParams, hs: HeadDraftState, inp: DraftInput, depth: int):
    """One P-EAGLE pass -> (draft logits of depths 1..``depth`` [B,D,V_d], the draft cache with the
    ingestion buffer committed)."""
    head = dp.head
    if head is None or not head.parallel:
        raise ValueError(f"a P-EAGLE drafter needs a parallel-drafting head (variant 'peagle'); got "
                         f"{head.variant if head else 'no head'!r}: decode it with --method eagle3 / confu")
    spec = dp.spec(target.config)
    block = head_block(target, dp)
    g_bad = draft_lib.draft_features(spec, dp.weights, hs.ingest_h_cat_bac)
    logits0, _, cache = ingest_entries(block, hs.ingest_tokens_ba, g_bad, hs.ingest_count_b, inp.done_b,
                                       hs.draft_cache)
    if depth == 1:
        return logits0, cache
    b, m = inp.root_b.shape[0], depth - 1
    g_mask = draft_lib.draft_features(spec, dp.weights, dp.weights["mask_hidden"][None, None])  # [1,1,d]
    pos = inp.anchor_b[:, None] + jnp.arange(1, depth, dtype=jnp.int32)[None]  # slot k at p+k
    out = block(jnp.full((b, m), head.mask_token_id, jnp.int32), jnp.broadcast_to(g_mask, (b, m, g_mask.shape[-1])),
                pos, cache=cache)  # causal among the slots (draft_block's default), the whole cache
    return jnp.concatenate([logits0, out.logits_btv], axis=1), cache


@dataclasses.dataclass(frozen=True)
class PEagleDrafter(HeadDrafter):
    """A P-EAGLE head drafting the trees of ``plan`` from one pass (module docstring)."""

    what = "a P-EAGLE head"
    contemplates = False

    def __post_init__(self):
        super().__post_init__()
        if self.min_prob:
            raise ValueError("a P-EAGLE head has no confidence-gated width (@P): its chain comes from one pass")

    def propose(self, target: Target, dp: DrafterParams, hs: HeadDraftState, inp: DraftInput) -> Proposal:
        logits, cache = parallel_logits(target, dp, hs, inp, self.max_depth)
        tree, q = self.draft_positional(jax.nn.log_softmax(logits, axis=-1), inp,
                                        d2t_v=dp.draft_vocab["d2t"], target_vocab=target.config.vocab_size)
        n = jnp.full(inp.root_b.shape, self.n_nodes, jnp.int32)
        return Proposal(tree, q, n, None, hs.replace(draft_cache=cache))


# ----------------------------------------------------------------------------- the family: loading


def load_peagle(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
                target_tokenizer=None) -> LoadedDrafter:
    """A P-EAGLE head (``DrafterFamily.load``): speculators' ``peagle`` layout (``weights.peagle_format``:
    checked against the target; a trained embedding copy kept), or, as every head, a ``launch.train``
    workdir (``WORKDIR@STEP``), a release, or with no source a random head of variant 'peagle'."""
    import dataclasses as dc

    import numpy as np

    from confu_jax.models.target import embedding_table
    from confu_jax.weights.eagle3_formats import bind_to_target
    from confu_jax.weights.peagle_format import is_peagle_dir, load_peagle_dir, own_embedding

    path = source_path(source) if source else None
    if path is None or not is_peagle_dir(path):
        return load_head_weights(method, target_cfg, target_params, source, seed=seed, step=step,
                                 target_source=target_source, target_tokenizer=target_tokenizer)
    check_release(path, target_params)
    imp = load_peagle_dir(path)
    own = own_embedding(imp, np.asarray(embedding_table(target_params)))
    spec, trainable, vocab = bind_to_target(dc.replace(imp, embed=None), target_cfg, target_params)
    if own is not None:
        trainable["draft"]["embed_tokens"] = own.astype(np.asarray(trainable["draft"]["fc"]["kernel"]).dtype)
    desc = f"{path} (speculators P-EAGLE layout{', its own embedding' if own is not None else ''})"
    return head_weights(target_cfg, target_params, spec.head, trainable, vocab, True, desc)


FAMILIES = (DrafterFamily(
    "peagle", lambda text: PEagleDrafter(parse_peagle_plan(text)), load_peagle,
    methods=(Method("peagle", ("peagle",), "P-EAGLE: an EAGLE-3 head drafting every depth in one pass (parallel "
                    "drafting; a launch.train workdir or speculators' peagle layout, random without)"),),
    chains=DEFAULT_CHAINS, trees=("tree:2,2", "tree:3,2,1", "tree:4,3,2", "ddtree:8,3", "ddtree:16,6"),
    reads_step=True, export_formats=(runs_peagle.EXPORT_FORMAT,)),)
