"""Medusa-1 heads as a ``Drafter`` (docs/DESIGN.md §11 "Medusa"; heads: ``models.medusa``).

Why it is its own family: Medusa drafts from **one vector**. Head k reads the target's final-normed
hidden state h[p] at the last accepted position p and predicts x[p+k+2]; the root of the tree is
the bonus x[p+1] (predicted by the target itself from the same h[p]), so the depth-(k+1) nodes are
head k's guesses. Heads never see the tokens they are stacked on: every node at one depth gets the
same distribution, whatever its parent — no draft KV cache, no recurrence, one batched matmul per
ResBlock layer per round.

**State** (``hidden_state.LastHiddenState``): ``hidden_bd`` = h[p]. ``init`` takes it from the prefill (the last
prompt token, ``PrefillView.last_hidden_bd``); ``update`` from the verification pass at the last
accepted node (``VerifyOutput.hidden_btd[ver.last_node_b]``, whose logits gave the bonus), so the
heads cost nothing on the target side: the hidden state is computed by every verification anyway.

**Trees** (``plan``, depth D ≤ the number of heads):

* ``chain:K``: head i's top-1 at depth i+1;
* ``sampled_chain:K`` (T > 0): node i+1 drawn from q_i = head i's distribution after the target's
  temperature / top-p (``decode.tree.draft_sampled_chain``), verified by Leviathan's rule;
* ``static`` trees (Medusa's "choices" paths; text ``tree:k1,k2,...,kD`` = the Cartesian product of
  head i's top-k_i, Medusa-1's original tree; ``plans.StaticTree.cartesian`` builds it): a node of rank r at
  depth d+1 is head d's r-th token, under every parent;
* ``dynamic:D,K,N`` (EAGLE-2's selection by cumulative head log-probability) also works, since the
  tree drafters only ask for the log-probabilities below each frontier node; so does ``ddtree:N[,D]``
  (DDTree's best-first tree over the heads' top-k: ``decode.plans.BlockTree``).

Verification is the project's exact rules (§4): greedy equality, sequential residual sampling for
deterministic trees, Leviathan for sampled chains. Medusa's "typical acceptance" (lossy) is not
implemented.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from confu_jax.decode.drafter import DraftInput, Proposal, full_proposal
from confu_jax.decode.family import (DEFAULT_CARTESIAN_TREES, DEFAULT_CHAINS, DrafterFamily, Method, SourceKind,
                                     own_weights_loader)
from confu_jax.decode.hidden_state import LastHiddenDrafter, LastHiddenState, load_own_tree, own_tree
from confu_jax.decode.loaded import LoadedDrafter
from confu_jax.runs import medusa as runs_medusa
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models.medusa import config_of, medusa_logits
from confu_jax.models.vocab_map import to_target_vocab

MEDUSA_FORMS = ("chain:K, sampled_chain:K, dynamic:D,K,N, tree:k1,...,kD (top-k_i of head i, Cartesian) or "
                "ddtree:N[,D] (DDTree: the N best nodes over the heads' top-k, at most D deep) or accum_logp:N,W[,D] "
                "(JetSpec's tree: the best node's W children at a time, N nodes)")


def medusa_params(dp) -> dict:
    return own_tree(dp, "medusa", "a Medusa drafter", "models.medusa.init_medusa, a trained configs/*_medusa.py "
                    "workdir, or an imported FasterDecoding head")


def parse_medusa_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (no ``+cM``)."""
    return parse_plan(text, what="Medusa", forms=MEDUSA_FORMS, block=True)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(LastHiddenDrafter):
    """Medusa-1 heads drafting the trees of ``plan`` (module docstring); its state is h[p]
    (``LastHiddenDrafter``)."""

    plan: DraftPlan
    what = "Medusa heads"

    def propose(self, target, dp, st: LastHiddenState, inp: DraftInput) -> Proposal:
        heads = medusa_params(dp)
        c = config_of(heads)
        depth = self.max_depth
        if depth > c.num_heads:
            raise ValueError(f"plan {self.describe()!r} drafts {depth} deep; these Medusa heads predict only "
                             f"{c.num_heads} tokens ahead (depth <= medusa_num_heads)")
        sub = jax.tree_util.tree_map(lambda x: x[:depth], heads)  # only the heads the tree reaches
        logits_kbv = to_target_vocab(medusa_logits(sub, st.hidden_bd), target.config.vocab_size)
        tree, q = self.draft_positional(jnp.swapaxes(jax.nn.log_softmax(logits_kbv, axis=-1), 0, 1), inp)
        return full_proposal(tree, q, st)


# ----------------------------------------------------------------------------- the family: loading


def load_medusa(target_cfg, target_params: dict, source=None, seed: int = 0,
                target_source: str = "the loaded target", num_heads: int = 4) -> LoadedDrafter:
    """What Medusa decodes with: the heads of a ``launch.train`` Medusa workdir (``runs.medusa``, target
    checked), of a FasterDecoding directory (``medusa_lm_head.safetensors`` / ``.pt`` + config.json:
    ``weights.medusa_format``, width and vocabulary checked), or, with no source, the reference
    initialisation (ResBlock W = 0, LM heads = the target's; ``trained`` False)."""
    from confu_jax.models.medusa import init_medusa
    from confu_jax.models.target import lm_head_matrix
    from confu_jax.runs.medusa import is_medusa_workdir, load_medusa_run
    from confu_jax.weights.medusa_format import is_medusa_dir, load_medusa_dir

    def untrained():
        w, axis = lm_head_matrix(target_cfg, target_params)
        heads = jax.device_get(init_medusa(jax.random.PRNGKey(seed), num_heads, 1, jnp.asarray(w), axis))
        return heads, f"Medusa reference initialisation ({num_heads} heads, seed {seed})"

    def run(path):
        r = load_medusa_run(path, target_cfg, target_params, target_source=target_source)
        return r.heads, r.source

    def check(heads):
        c = config_of(heads)
        if c.d_model != target_cfg.d_model:
            raise ValueError(f"{source}: Medusa heads of width {c.d_model} cannot read a target of width "
                             f"{target_cfg.d_model}")
        if c.vocab_size < target_cfg.vocab_size:
            raise ValueError(f"{source}: Medusa heads over {c.vocab_size} tokens; the target has "
                             f"{target_cfg.vocab_size}")

    kinds = (SourceKind("a Medusa launch.train workdir (config.json with a 'medusa' section + checkpoints/)",
                        is_medusa_workdir, run),
             SourceKind("a FasterDecoding Medusa directory (medusa_lm_head.safetensors/.pt)", is_medusa_dir,
                        lambda p: (load_medusa_dir(p).heads, f"{p} (FasterDecoding Medusa format)")))
    return load_own_tree(target_cfg, target_params, "medusa", source, untrained=untrained, kinds=kinds, check=check)

FAMILIES = (DrafterFamily(
    "medusa", lambda text: MedusaDrafter(parse_medusa_plan(text)), own_weights_loader(load_medusa),
    methods=(Method("medusa", (), "Medusa-1 heads on the target's last hidden state (trained with "
                    "configs/*_medusa.py, or a FasterDecoding medusa_lm_head directory)", own_weights=True),),
    chains=DEFAULT_CHAINS[:3], trees=DEFAULT_CARTESIAN_TREES + ("ddtree:8,3",),
    max_depth=lambda dp: config_of(dp.weights["medusa"]).num_heads, export_formats=(runs_medusa.EXPORT_FORMAT,)),)
