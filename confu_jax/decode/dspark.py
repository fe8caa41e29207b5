"""DSpark as a ``Drafter`` (docs/DESIGN.md §11 "DSpark"; the model: ``models.dspark``; references: vLLM
``v1/worker/gpu/spec_decode/dspark/speculator.py`` ``_sample_sequential`` and ``adaptive_verification.py``,
speculators ``models/dspark/``).

Why its own family: one backbone forward gives every slot's base logits at once, as DFlash's block, but the
Markov head makes slot k's distribution depend on the token drafted at slot k-1, so drafts are drawn left
to right. In this project's terms (p = the last accepted position, x[p+1] = the bonus / root):

* the draft's KV cache holds the context entries of positions 0..p (DFlash's: ``decode.dflash``, whose
  ``init`` / ``update`` this family keeps);
* propose: the block [x[p+1], M, ..., M] of D slots at positions p+1..p+D (``sample_from_anchor``: the
  anchor slot drafts too) gives the base logits b_k and states h_k; the plan's tree grows through one
  ``children`` function that, for a node at depth k whose token is t, returns
  log softmax(b_k + bias(w1[t], h_k)) — the bias-corrected distribution, the one drafts are drawn from and
  the sampled rules read as q (so T > 0 stays exactly lossless, as vLLM's ``draft_logits`` cache);
  the rnn head's state rides along per frontier node (gathered through its parent);
* ``chain:K@P`` (the confidence head, chains only): a row asks to verify only the leading drafts whose
  survival — the running product of the confidences conf_k = σ(proj([h_k; w1[t_k]])) — is at least P; the
  loop compiles the widths 1..K+1 and verifies the narrowest that holds every active row's (one program,
  ``lax.switch``; ``Drafter.widths``). vLLM's adaptive verification admits slots by the same survival
  scores against a measured cost table; a threshold is its batch-1 form at a flat marginal cost.

Plans: ``chain:K``, ``sampled_chain:K``, ``tree:k1,...,kD`` (each node's children the top-k of its own
bias-corrected distribution), ``dynamic:D,K,N`` and DDTree's ``ddtree:N[,D]`` — best-first node by node, each
popped node's children distribution computed from its own token (``decode.tree.draft_best_first_tree``); the
block has D slots for a depth-D plan. One ``children`` function serves them all
(``DraftPlan.grow_conditional``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from confu_jax.decode.dflash import DFlashDrafter, dflash_params, parse_conditional_plan, published_block_config
from confu_jax.decode.drafter import DraftInput, Proposal
from confu_jax.decode.family import (DEFAULT_CARTESIAN_TREES, DrafterFamily, Method, SourceKind, own_weights_loader,
                                     resolve_source)
from confu_jax.decode.loaded import LoadedDrafter, own_weights
from confu_jax.decode.plans import Chain
from confu_jax.models import dspark as D
from confu_jax.models.dflash import block_logits
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.runs import dspark as runs_dspark

DSPARK_FORMS = ("chain:K (a block of K: the root and K-1 masks, each slot drafting the next token), chain:K@P "
                "(verify the leading drafts whose confidence survival is >= P), sampled_chain:K, tree:k1,...,kD, "
                "dynamic:D,K,N or ddtree:N[,D] (DDTree's best-first tree, each node's children from its own "
                "Markov-biased distribution)")


def parse_dspark(text: str) -> "DSparkDrafter":
    """A DSpark plan, optionally ``@P`` (confidence-scheduled length, chains only)."""
    body, at, prob = text.partition("@")
    plan = parse_conditional_plan(body, "DSpark", DSPARK_FORMS)
    if not at:
        return DSparkDrafter(plan)
    try:
        p = float(prob)
    except ValueError:
        raise ValueError(f"bad DSpark plan {text!r}: @P needs a survival threshold in (0, 1), e.g. chain:6@0.3; "
                         f"expected {DSPARK_FORMS}") from None
    return DSparkDrafter(plan, min_survival=p)


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(DFlashDrafter):
    """A DSpark draft drafting the trees of ``plan`` from one backbone pass and its Markov head (module
    docstring); ``min_survival`` > 0: the confidence head sets each row's verification length."""

    min_survival: float = 0.0
    what = "a DSpark draft"
    params_key = "dspark"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.min_survival < 1.0:
            raise ValueError(f"DSpark @P needs a survival threshold in (0, 1), got {self.min_survival}")
        if self.min_survival > 0 and not isinstance(self.plan, Chain):
            raise ValueError(f"a confidence-scheduled length (@{self.min_survival:g}) shortens a chain from its end; "
                             f"plan {self.plan.text!r} cannot shorten: use chain:K@P")

    def backbone(self, p: dict) -> dict:
        return D.backbone(p)

    @property
    def widths(self) -> tuple:
        return tuple(range(1, self.n_nodes + 1)) if self.min_survival > 0 else (self.n_nodes,)

    def describe(self) -> str:
        return self.plan.text + (f"@{self.min_survival:g}" if self.min_survival else "")

    def propose(self, target, dp, st, inp: DraftInput) -> Proposal:
        p = dflash_params(dp, self.params_key)
        depth = self.max_depth
        b = inp.root_b.shape[0]
        h = self.block_states(target, dp, st, inp, depth)
        base = to_target_vocab(block_logits(target.config, target.params, h), target.config.vocab_size)  # [B,D,V]

        rows = jnp.arange(b)[:, None]

        def children(tokens_bk, depth_bk, state):
            """A node's children: slot k's base logits + the bias from the node's own token (k its depth)."""
            k = jnp.minimum(depth_bk, depth - 1)
            bias, new_state = D.markov_bias(p, D.prev_embedding(p, tokens_bk), h[rows, k], state)
            logits = base[rows, k].astype(jnp.float32) + to_target_vocab(bias, target.config.vocab_size)
            return jax.nn.log_softmax(logits, axis=-1), new_state

        rank = D.markov_rank(p)
        state0 = jnp.zeros((b, 1, rank), jnp.float32) if D.head_type(p) == "rnn" else None
        tree, q = self.draft_conditional(children, state0, inp)
        n = jnp.full((b,), self.n_nodes, jnp.int32)
        if self.min_survival > 0:
            if "confidence" not in p:
                raise ValueError(f"plan {self.describe()!r}: this DSpark draft has no confidence head "
                                 "(drop @P, or load a draft trained with one)")
            conf = D.confidence(p, h, D.prev_embedding(p, tree.tokens_bt[:, :depth]))  # slot k: node k+1's
            survive = (jnp.cumprod(conf, axis=1) >= self.min_survival) & tree.valid_bt[:, 1:]
            n = 1 + jnp.sum(jnp.cumprod(survive.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        return Proposal(tree, q, n, None, st)


# ----------------------------------------------------------------------------- the family: loading


def load_dspark(target_cfg, target_params: dict, source=None, seed: int = 0,
                target_source: str = "the loaded target", num_layers: int = 3, rank: int = 64) -> LoadedDrafter:
    """What DSpark decodes with: the draft of a ``launch.train`` DSpark workdir (``runs.dspark``, target checked)
    or of speculators' ``dspark`` layout (``weights.dspark_format``; width, vocabulary and taps checked) — either
    keeps its block size, which bounds a plan's depth — or, with no source, an untrained draft
    (``num_layers`` layers of the target's shape over DFlash's default taps, a vanilla Markov head of rank
    ``rank``, a confidence head reading it, the last token id as the mask; ``trained`` False)."""
    import numpy as np

    from confu_jax.models.dflash import check_dflash_params, default_taps, draft_config
    from confu_jax.runs.dspark import is_dspark_workdir, load_dspark_run
    from confu_jax.weights.dspark_format import is_dspark_dir, load_dspark_dir

    if source is None:
        dcfg, taps = draft_config(target_cfg, num_layers), default_taps(target_cfg.n_layers)
        p = jax.device_get(D.init_dspark(jax.random.PRNGKey(seed), dcfg, len(taps), target_cfg.vocab_size, rank=rank))
        scalars = {"mask_token_id": np.int32(target_cfg.vocab_size - 1)}
        trained, desc = False, f"DSpark initialisation ({num_layers} layers, Markov rank {rank}, seed {seed})"
    else:
        def run(path):
            r = load_dspark_run(path, target_cfg, target_params, target_source=target_source)
            return r.params, r.draft, r.taps, r.mask_token_id, r.block_size, r.source

        def published(path):
            imp = load_dspark_dir(path)
            dcfg = published_block_config(source, imp, target_cfg, "DSpark")
            return (imp.params, dcfg, imp.taps, imp.mask_token_id, imp.block_size,
                    f"{path} (speculators DSpark layout, block {imp.block_size})")

        p, dcfg, taps, mask, block, desc = resolve_source(source, (
            SourceKind("a DSpark launch.train workdir (config.json with a 'dspark' section + checkpoints/)",
                       is_dspark_workdir, run),
            SourceKind("a speculators DSpark directory (config.json with speculators_model_type 'dspark' + "
                       "model.safetensors)", is_dspark_dir, published)))
        scalars = {"mask_token_id": np.int32(mask), "block_size": np.int32(block)}
        trained = True
    check_dflash_params(D.backbone(p), dcfg, len(taps))
    return own_weights(target_cfg, target_params, {"dspark": {**p, **scalars}}, trained, desc,
                       draft_model=dcfg, tap_layers=tuple(taps))


def block_depth(dp):
    """The deepest plan a loaded DSpark draft runs: its trained block's slots (None untrained)."""
    block = dp.weights["dspark"].get("block_size")
    return None if block is None else int(block)


FAMILIES = (DrafterFamily(
    "dspark", parse_dspark, own_weights_loader(load_dspark),
    methods=(Method("dspark", (), "DSpark: DFlash's block backbone with a Markov logit bias (drafts sampled left to "
                    "right) and a confidence head setting the verification length (chain:K@P); trained with configs/*_dspark.py",
                    own_weights=True),),
    trees=DEFAULT_CARTESIAN_TREES + ("ddtree:8,3",), max_depth=block_depth, export_formats=(runs_dspark.EXPORT_FORMAT,)),)
