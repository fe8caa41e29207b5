"""DFlash2 as a ``Drafter`` (docs/DESIGN.md §11 "DFlash2"; the model: ``models.dflash2``; references: vLLM 0.32
``v1/worker/gpu/spec_decode/dflash2/speculator.py`` and ``model_executor/models/qwen3_dflash2.py``, speculators
0.9 ``models/dflash2/``).

Why its own family: one backbone forward (DFlash's block, with DFlash2's convolutions) gives every slot's unary
logits and state at once, but the candidate selector makes slot k's distribution depend on the token drafted at
slot k−1, so drafts are drawn left to right — DSpark's shape over DFlash's block reading. In this project's terms
(p = the last accepted position, x[p+1] = the bonus / root):

* the draft's KV cache holds the context entries of positions 0..p (DFlash's ``init`` / ``update``, kept);
* propose: the block [x[p+1], M, ..., M] of D+1 slots at positions p+1..p+D+1 gives, for slot k = 1..D, the
  unary logits u_k (the target's LM head), their top-K candidates and the projected state W h_k; the plan's tree
  grows through one ``children`` function: a node at depth d whose token is t gets slot d+1's candidates scored
  u[c] + ⟨P[t] ⊙ W h_{d+1}, S[c]⟩, as a distribution softmax over those K scores and zero elsewhere — the one
  drafts are drawn from and the sampled rules read as q (vLLM caches the same scores, −inf outside, as its
  ``draft_logits``; the target's temperature and top-p apply to both alike), so T > 0 stays exactly lossless.

Plans: ``chain:K`` (vLLM's greedy walk: each slot's best-scored candidate under the previous draft),
``sampled_chain:K`` (vLLM's walk at T > 0: each slot drawn from its scores), ``tree:k1,...,kD``, ``dynamic:D,K,N``
and DDTree's ``ddtree:N[,D]`` (each node's children from its own scores: ``DraftPlan.grow_conditional``); not
``accum_logp`` (it offers every parent the same children). A trained draft's block bounds a plan's depth
(``block_size`` − 1, DFlash's reading).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from confu_jax.decode.dflash import DFlashDrafter, dflash_params, parse_conditional_plan, published_block_config
from confu_jax.decode.drafter import DraftInput, Proposal, full_proposal
from confu_jax.decode.family import (DEFAULT_CARTESIAN_TREES, DrafterFamily, Method, SourceKind, own_weights_loader,
                                     resolve_source)
from confu_jax.decode.loaded import LoadedDrafter, own_weights
from confu_jax.models import dflash2 as D2
from confu_jax.models.dflash import block_logits
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.runs import dflash2 as runs_dflash2

DFLASH2_FORMS = ("chain:K (a block of K+1: the root and K masks, each slot's best candidate under the previous "
                 "draft), sampled_chain:K, tree:k1,...,kD, dynamic:D,K,N or ddtree:N[,D] (DDTree's best-first "
                 "tree, each node's children from its own selector scores)")


def parse_dflash2(text: str) -> "DFlash2Drafter":
    return DFlash2Drafter(parse_conditional_plan(text, "DFlash2", DFLASH2_FORMS))


@dataclasses.dataclass(frozen=True)
class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 draft drafting the trees of ``plan`` from one block forward and its selector (module docstring)."""

    what = "a DFlash2 draft"
    params_key = "dflash2"

    def backbone(self, p: dict) -> dict:
        return D2.backbone(p)

    def conv(self, p: dict):
        return D2.conv(p)

    def propose(self, target, dp, st, inp: DraftInput) -> Proposal:
        p = dflash_params(dp, self.params_key)
        depth, k = self.max_depth, D2.top_k(p)
        vocab = target.config.vocab_size
        b = inp.root_b.shape[0]
        h = self.block_states(target, dp, st, inp, depth + 1)[:, 1:]  # slots 1..D
        unary = to_target_vocab(block_logits(target.config, target.params, h), vocab)  # [B,D,V]
        cand, cand_unary = D2.top_candidates(unary, k)  # [B,D,K]
        projected = D2.project(p, h)  # [B,D,r]
        rows = jnp.arange(b)[:, None]

        def children(tokens_bk, depth_bk, state):
            """A node's children: slot d+1's candidates scored under the node's own token (d its depth)."""
            d = jnp.minimum(depth_bk, depth - 1)
            ctx = D2.selector_context(p, projected[rows, d], tokens_bk)  # [B,n,r]
            scores = D2.candidate_scores(p, cand_unary[rows, d], cand[rows, d], ctx)  # [B,n,K]
            return jax.nn.log_softmax(D2.scores_to_logits(scores, cand[rows, d], vocab), axis=-1), state

        tree, q = self.draft_conditional(children, None, inp)
        return full_proposal(tree, q, st)


# ----------------------------------------------------------------------------- the family: loading


def load_dflash2(target_cfg, target_params: dict, source=None, seed: int = 0,
                 target_source: str = "the loaded target", num_layers: int = 3, top_k: int = 16,
                 rank: int = 64, kernel_size: int = 2, group_size: int = 16) -> LoadedDrafter:
    """What DFlash2 decodes with: the draft of a ``launch.train`` DFlash2 workdir (``runs.dflash2``, target
    checked) or of speculators' ``dflash2`` layout (``weights.dflash2_format``; width, vocabulary and taps
    checked) — either keeps its block size and its selector's K — or, with no source, an untrained draft
    (``num_layers`` layers of the target's shape over DFlash's default taps, identity convolutions, a selector of
    rank ``rank`` reranking the top ``top_k``, the last token id as the mask; ``trained`` False)."""
    import numpy as np

    from confu_jax.models.dflash import check_dflash_params, default_taps, draft_config
    from confu_jax.runs.dflash2 import is_dflash2_workdir, load_dflash2_run, top_k as top_k_of
    from confu_jax.weights.dflash2_format import is_dflash2_dir, load_dflash2_dir

    if source is None:
        dcfg, taps = draft_config(target_cfg, num_layers), default_taps(target_cfg.n_layers)
        group = group_size if target_cfg.d_model % group_size == 0 else 1
        p = jax.device_get(D2.init_dflash2(jax.random.PRNGKey(seed), dcfg, len(taps), target_cfg.vocab_size,
                                           kernel_size=kernel_size, group_size=group, rank=rank))
        mask, block, k = target_cfg.vocab_size - 1, None, min(top_k, target_cfg.vocab_size)
        trained, desc = False, f"DFlash2 initialisation ({num_layers} layers, selector rank {rank}, top {top_k}, seed {seed})"
    else:
        def run(path):
            r = load_dflash2_run(path, target_cfg, target_params, target_source=target_source)
            return r.params, r.draft, r.taps, r.mask_token_id, r.block_size, top_k_of(r), r.source

        def published(path):
            imp = load_dflash2_dir(path)
            dcfg = published_block_config(source, imp, target_cfg, "DFlash2")
            return (imp.params, dcfg, imp.taps, imp.mask_token_id, imp.block_size, imp.top_k,
                    f"{path} (speculators DFlash2 layout, block {imp.block_size}, top {imp.top_k})")

        p, dcfg, taps, mask, block, k, desc = resolve_source(source, (
            SourceKind("a DFlash2 launch.train workdir (config.json with a 'dflash2' section + checkpoints/)",
                       is_dflash2_workdir, run),
            SourceKind("a speculators DFlash2 directory (config.json with speculators_model_type 'dflash2' + "
                       "model.safetensors)", is_dflash2_dir, published)))
        trained = True
    if not 1 <= k <= target_cfg.vocab_size:
        raise ValueError(f"DFlash2 selector top_k {k}: expected 1..{target_cfg.vocab_size} (the vocabulary)")
    check_dflash_params(D2.backbone(p), dcfg, len(taps), D2.conv(p))
    scalars = {"mask_token_id": np.int32(mask), "top_k": np.arange(k, dtype=np.int32),
               **({} if block is None else {"block_size": np.int32(block)})}
    return own_weights(target_cfg, target_params, {"dflash2": {**p, **scalars}}, trained, desc,
                       draft_model=dcfg, tap_layers=tuple(taps))


def block_depth(dp):
    """The deepest plan a loaded DFlash2 draft runs: block_size − 1 (None untrained)."""
    block = dp.weights["dflash2"].get("block_size")
    return None if block is None else int(block) - 1


FAMILIES = (DrafterFamily(
    "dflash2", parse_dflash2, own_weights_loader(load_dflash2),
    methods=(Method("dflash2", (), "DFlash2: DFlash's block draft with grouped dynamic convolutions and a candidate "
                    "selector reranking each slot's top-K by the previous draft (trained with configs/*_dflash2.py, or "
                    "a speculators dflash2 directory)", own_weights=True),),
    trees=DEFAULT_CARTESIAN_TREES + ("ddtree:8,3",), max_depth=block_depth,
    export_formats=(runs_dflash2.EXPORT_FORMAT,)),)
