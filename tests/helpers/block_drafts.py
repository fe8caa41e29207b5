"""What the block drafters' own tests share (DSpark, DFlash2, Domino): the tiny case each builds its drafter on
(``block_case``), one proposal of a drafter after a prompt's prefill, and the block's final-normed states recomputed from the pieces (the draft's context K/V of the prompt's
taps, one bidirectional block forward [root, M, ..., M] at the positions after the prompt) — what each test then
reads as its reference implementation's loop does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode.dflash import context_entries
from confu_jax.decode.drafter import DraftInput, PrefillView
from confu_jax.models import dflash as DF
from confu_jax.models.target import real_forward
from tests.helpers.loop_fixtures import make

PROMPT = (3, 9, 4, 17, 3, 9)


def block_case(vocab: int, init, seed: int = 0, n_layers: int = 2, **target_kw):
    """A tiny EAGLE-3-shaped target (``loop_fixtures.make``) and a block draft of ``n_layers`` layers of its shape
    -> (spec with that draft model, target params, the draft's numpy params ``init(key, draft_cfg, n_taps)``, a
    numpy generator seeded ``seed`` for the test's own perturbation of them)."""
    spec, tp, _ = make("eagle3", vocab, seed=seed, **target_kw)
    dcfg = DF.draft_config(spec.target, n_layers, rope_theta=50000.0, rms_eps=1e-6)
    spec = dataclasses.replace(spec, draft_model=dcfg)
    p = jax.tree_util.tree_map(np.asarray, init(jax.random.PRNGKey(seed), dcfg, len(spec.taps)))
    return spec, tp, p, np.random.default_rng(seed)


class FirstProposal:
    """``drafter``'s first proposal after ``prompt`` (greedy): its tree's tokens in ``chain`` (root first), the
    prompt's target output in ``out``, the root in ``root``."""

    def __init__(self, spec, tp, params, drafter, prompt=PROMPT):
        self.spec, self.tp, self.params, self.n = spec, tp, params, len(prompt)
        toks = jnp.asarray([list(prompt)], jnp.int32)
        self.out = real_forward(spec, tp, toks)
        self.root = jnp.argmax(self.out.logits_btv[:, -1], axis=-1).astype(jnp.int32)
        view = PrefillView(toks, jnp.array([self.n]), self.root, self.out.taps_btc, None, 32)
        self.state = drafter.init(params.target, params.drafter_params, view)
        self.inp = DraftInput(self.root, jnp.array([self.n - 1]), jnp.zeros((1,), bool), jax.random.PRNGKey(0),
                              jnp.float32(0.0), jnp.float32(1.0))
        self.proposal = drafter.propose(params.target, params.drafter_params, self.state, self.inp)
        self.chain = np.asarray(self.proposal.tree.tokens_bt)[0].tolist()

    def block(self, p: dict, backbone: dict, mask_token: int, slots: int):
        """The block's final-normed states [1, slots, d], from the pieces."""
        k, v = context_entries(self.params.drafter_params, p, self.out.taps_btc, jnp.arange(self.n)[None])
        blk = jnp.asarray([[int(self.root[0])] + [mask_token] * (slots - 1)])
        return DF.block_hidden(backbone, self.spec.draft_model, DF.embed_block(self.tp, blk),
                               jnp.arange(self.n, self.n + slots)[None], jnp.ones((1, slots, slots), bool),
                               k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4), jnp.array([self.n]))
