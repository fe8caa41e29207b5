"""Domino as a ``Drafter`` (docs/DESIGN.md §11 "Domino"; the model: ``models.domino``; reference: SpecForge
@a6b6b023 ``specforge/modeling/draft/domino.py`` ``DominoDraftModel._sample_draft_tokens``).

Why its own family: one backbone forward (DFlash's block, read with ``shift_label``) gives every slot's base
logits and state at once, but the GRU makes slot k's distribution depend on the tokens drafted before it, so drafts
are drawn left to right — DSpark's shape with a recurrent state. In this project's terms (p = the last accepted
position, x[p+1] = the bonus / root):

* the draft's KV cache holds the context entries of positions 0..p (DFlash's ``init`` / ``update``, kept);
* propose: the block [x[p+1], M, ..., M] of D+1 slots at positions p+1..p+D+1 (the reference's block of bs slots
  drafting bs−1 tokens) gives slot k's base logits b_k and state h_k; the plan's tree grows through one
  ``children`` function: a node at depth d whose token is t advances its parent's GRU state by E[t] (the target's
  embedding; the root's parent state is 0) and gets slot d's distribution softmax(b_d + embed_proj([h_d ; s]))
  (b_d alone below ``pure_draft_prefix_len``) — the one drafts are drawn from and the sampled rules read as q, so
  T > 0 stays exactly lossless; the state rides along per frontier node, gathered through its parent.

Plans: ``chain:K`` (the reference's ``_sample_draft_tokens`` at temperature 0), ``sampled_chain:K``,
``tree:k1,...,kD``, ``dynamic:D,K,N``, ``ddtree:N[,D]`` (``DraftPlan.grow_conditional``); not ``accum_logp``.
A trained draft's block bounds a plan's depth (block_size − 1).
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
from confu_jax.models import domino as M
from confu_jax.models.dflash import block_logits, embed_block
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.runs import domino as runs_domino

DOMINO_FORMS = ("chain:K (a block of K+1 slots, each drafting the next token under the GRU's correction), "
                "sampled_chain:K, tree:k1,...,kD, dynamic:D,K,N or ddtree:N[,D] (DDTree's best-first tree, each "
                "node's children from its own GRU state)")


def parse_domino(text: str) -> "DominoDrafter":
    return DominoDrafter(parse_conditional_plan(text, "Domino", DOMINO_FORMS))


@dataclasses.dataclass(frozen=True)
class DominoDrafter(DFlashDrafter):
    """A Domino draft drafting the trees of ``plan`` from one block forward and its GRU (module docstring)."""

    what = "a Domino draft"
    params_key = "domino"

    def backbone(self, p: dict) -> dict:
        return M.backbone(p)

    def propose(self, target, dp, st, inp: DraftInput) -> Proposal:
        p = dflash_params(dp, self.params_key)
        depth = self.max_depth
        vocab = target.config.vocab_size
        b = inp.root_b.shape[0]
        h = self.block_states(target, dp, st, inp, depth + 1)[:, :depth]  # slot k drafts depth k+1
        base = to_target_vocab(block_logits(target.config, target.params, h), vocab)  # [B,D,V]
        rows = jnp.arange(b)[:, None]

        def children(tokens_bk, depth_bk, state):
            """A node's children: its parent's GRU state advanced by its token, slot d's corrected logits."""
            d = jnp.minimum(depth_bk, depth - 1)
            s = M.gru_step(p, state, embed_block(target.params, tokens_bk))
            corr = to_target_vocab(M.correction(p, h[rows, d], s), vocab)
            logits = base[rows, d].astype(jnp.float32) + jnp.where((d >= p["prefix_len"])[..., None], corr, 0.0)
            return jax.nn.log_softmax(logits, axis=-1), s

        tree, q = self.draft_conditional(children, jnp.zeros((b, 1, M.gru_width(p)), jnp.float32), inp)
        return full_proposal(tree, q, st)


# ----------------------------------------------------------------------------- the family: loading


def load_domino(target_cfg, target_params: dict, source=None, seed: int = 0,
                target_source: str = "the loaded target", num_layers: int = 3, gru_hidden_dim: int = 64,
                emb_dim: int = 32, prefix_len: int = 1) -> LoadedDrafter:
    """What Domino decodes with: the draft of a ``launch.train`` Domino workdir (``runs.domino``, target checked)
    or of SpecForge's published layout (``weights.domino_format``; width, vocabulary and taps checked) — either
    keeps its block size and ``pure_draft_prefix_len`` — or, with no source, an untrained draft (``num_layers``
    layers of the target's shape over DFlash's default taps, a GRU of ``gru_hidden_dim``, a projection through
    ``emb_dim``, the last token id as the mask; ``trained`` False)."""
    import numpy as np

    from confu_jax.models.dflash import check_dflash_params, default_taps, draft_config
    from confu_jax.runs.domino import is_domino_workdir, load_domino_run, prefix_len as prefix_len_of
    from confu_jax.weights.domino_format import is_domino_dir, load_domino_dir

    if source is None:
        dcfg, taps = draft_config(target_cfg, num_layers), default_taps(target_cfg.n_layers)
        p = jax.device_get(M.init_domino(jax.random.PRNGKey(seed), dcfg, len(taps), target_cfg.vocab_size,
                                         gru_hidden_dim=gru_hidden_dim, emb_dim=emb_dim))
        mask, block, prefix = target_cfg.vocab_size - 1, None, prefix_len
        trained, desc = False, f"Domino initialisation ({num_layers} layers, GRU {gru_hidden_dim}, seed {seed})"
    else:
        def run(path):
            r = load_domino_run(path, target_cfg, target_params, target_source=target_source)
            return r.params, r.draft, r.taps, r.mask_token_id, r.block_size, prefix_len_of(r), r.source

        def published(path):
            imp = load_domino_dir(path)
            dcfg = published_block_config(source, imp, target_cfg, "Domino", zlab_layer_ids=True)
            return (imp.params, dcfg, imp.taps, imp.mask_token_id, imp.block_size, imp.prefix_len,
                    f"{path} (SpecForge Domino layout, block {imp.block_size})")

        p, dcfg, taps, mask, block, prefix, desc = resolve_source(source, (
            SourceKind("a Domino launch.train workdir (config.json with a 'domino' section + checkpoints/)",
                       is_domino_workdir, run),
            SourceKind("a SpecForge Domino directory (config.json with architectures ['DominoDraftModel'] + "
                       "model.safetensors)", is_domino_dir, published)))
        trained = True
    check_dflash_params(M.backbone(p), dcfg, len(taps))
    scalars = {"mask_token_id": np.int32(mask), "prefix_len": np.int32(prefix),
               **({} if block is None else {"block_size": np.int32(block)})}
    return own_weights(target_cfg, target_params, {"domino": {**p, **scalars}}, trained, desc,
                       draft_model=dcfg, tap_layers=tuple(taps))


def block_depth(dp):
    """The deepest plan a loaded Domino draft runs: block_size − 1 (None untrained)."""
    block = dp.weights["domino"].get("block_size")
    return None if block is None else int(block) - 1


FAMILIES = (DrafterFamily(
    "domino", parse_domino, own_weights_loader(load_domino),
    methods=(Method("domino", (), "Domino: DFlash's block draft with a GRU correcting each slot's logits from the "
                    "tokens drafted before it (trained with configs/*_domino.py, or a SpecForge Domino directory)",
                    own_weights=True),),
    trees=DEFAULT_CARTESIAN_TREES + ("ddtree:8,3",), max_depth=block_depth,
    export_formats=(runs_domino.EXPORT_FORMAT,)),)
