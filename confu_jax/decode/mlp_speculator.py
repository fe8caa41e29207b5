"""IBM's MLP speculator as a ``Drafter`` (docs/DESIGN.md §11 "MLP speculator"; stages:
``models.mlp_speculator``; reference: fms-extras ``fms_extras/models/speculator.py``
``MLPSpeculator.generate_suffixes``, vLLM ``vllm/model_executor/models/mlp_speculator.py``
``generate_proposals``).

Why it is its own family: like Medusa it drafts from the target's final-normed hidden state h[p] at
the last accepted position p, which every verification computes anyway; unlike Medusa its stages
are recurrent: stage i reads the state the previous stage left **on the node's own path** and the
node's token. So each tree node carries its own state, which depends on its path:

* the root (the bonus x[p+1]): T(root) = stage_0(s_{-1}, x[p+1]), s_{-1} = h[p] (ln0(h[p])/sqrt(2)
  with scale_input); its children are head_0(T(root));
* a node n at depth k ≥ 1: T(n) = stage_k(T(parent(n)), x_n); its children are head_k(T(n)).

``expand_fn`` threads the frontier's states (``[B, K, D]``; the root frontier's ``[B, 1, d]`` input)
and gathers each node's parent state with ``Frontier.parent_slot_bk`` — as ``HeadDrafter`` keeps the
draft's per-node hidden state — so stage k runs once per expanded node at depth k (the reference's
``generate_suffixes`` expands its state the same way, ``b k d`` → ``b kk' d``).

**State** (``hidden_state.LastHiddenState``): ``hidden_bd`` = h[p], from the prefill
(``PrefillView.last_hidden_bd``) and then from each verification at the last accepted node
(``VerifyOutput.hidden_btd[ver.last_node_b]``), exactly Medusa's: the per-node states live only
inside one ``propose``, recomputed from the path.

**Trees** (``plan``, depth D ≤ ``n_predict``):

* ``chain:K``: each stage's top-1 on the previous stage's choice (vLLM's greedy proposals);
* ``sampled_chain:K`` (T > 0): node i+1 drawn from q_i = stage i's distribution on the drawn path
  after the target's temperature / top-p (``decode.tree.draft_sampled_chain``), verified by
  Leviathan's rule;
* ``tree:k1,...,kD``: the reference's ``top_k_tokens_per_head`` tree — every node at depth d has
  stage d's top-k_{d+1} under its own state as children (the Cartesian shape of Medusa-1's tree, but
  each node's children differ). The reference then keeps its ``n_candidates`` best full-depth
  candidates; ``dynamic:D,K,N`` is the project's form of that pruning (EAGLE-2's selection by
  cumulative draft log-probability), which needs no extra rule;
* any static "choices" tree (``plans.StaticTree(paths)``).

Verification is the project's exact rules (§4); no lossy acceptance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode.drafter import DraftInput, Proposal, full_proposal
from confu_jax.decode.family import (DEFAULT_CARTESIAN_TREES, DEFAULT_CHAINS, DrafterFamily, Method, SourceKind,
                                     own_weights_loader)
from confu_jax.decode.hidden_state import LastHiddenDrafter, LastHiddenState, load_own_tree, own_tree
from confu_jax.decode.loaded import LoadedDrafter
from confu_jax.runs import mlp_speculator as runs_mlp_speculator
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models.mlp_speculator import config_of, input_state, stage_logits, stage_state
from confu_jax.models.vocab_map import to_target_vocab

MLP_SPECULATOR_FORMS = ("chain:K, sampled_chain:K, dynamic:D,K,N or tree:k1,...,kD (top-k_i of stage i under "
                        "every node, the reference's top_k_tokens_per_head)")


def mlp_speculator_params(dp) -> dict:
    return own_tree(dp, "mlp_speculator", "an MLP speculator drafter", "models.mlp_speculator.init_mlp_speculator, "
                    "a trained configs/*_mlp_speculator.py workdir, or an imported fms / vLLM mlp_speculator directory")


def parse_mlp_speculator_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (no ``+cM``)."""
    return parse_plan(text, what="MLP speculator", forms=MLP_SPECULATOR_FORMS)


@dataclasses.dataclass(frozen=True)
class MLPSpeculatorDrafter(LastHiddenDrafter):
    """An MLP speculator drafting the trees of ``plan`` (module docstring); its state is h[p]
    (``LastHiddenDrafter``)."""

    plan: DraftPlan
    what = "an MLP speculator"

    def propose(self, target, dp, st: LastHiddenState, inp: DraftInput) -> Proposal:
        sp = mlp_speculator_params(dp)
        c = config_of(sp)
        depth = self.max_depth
        if depth > c.n_predict:
            raise ValueError(f"plan {self.describe()!r} drafts {depth} deep; this MLP speculator has only "
                             f"{c.n_predict} stages (depth <= n_predict)")
        vocab = target.config.vocab_size

        def expand_fn(prev_bkx, fr: tree_lib.Frontier):
            """Stage ``fr.depth`` on each frontier node: its parent's state (the root's parent: s_{-1})
            and its own token -> (log-probabilities of its children, the frontier's states)."""
            parent = jnp.take_along_axis(prev_bkx, fr.parent_slot_bk[..., None], axis=1)
            s_bke = stage_state(sp, fr.depth, parent, fr.tokens_bk)
            logits = to_target_vocab(stage_logits(sp, fr.depth, s_bke), vocab)
            return jax.nn.log_softmax(logits, axis=-1), s_bke

        s0 = input_state(sp, st.hidden_bd)[:, None]  # [B, 1, d]: the root's parent state
        tree, q, _ = self.draft(expand_fn, s0, inp)
        return full_proposal(tree, q, st)


# ----------------------------------------------------------------------------- the family: loading


def load_mlp_speculator(target_cfg, target_params: dict, source=None, seed: int = 0,
                        target_source: str = "the loaded target", n_predict: int = 3) -> LoadedDrafter:
    """What the MLP speculator decodes with: the stages of a ``launch.train`` MLP speculator workdir
    (``runs.mlp_speculator``, target checked), of a published fms-extras / vLLM directory (config.json with
    model_type ``mlp_speculator`` + model.safetensors: ``weights.mlp_speculator_format``, width and
    vocabulary checked), or, with no source, the reference initialisation (``n_predict`` stages of the
    target's width, N(0, 1/sqrt(d)) weights; ``trained`` False)."""
    from confu_jax.models.mlp_speculator import init_mlp_speculator, make_config
    from confu_jax.runs.mlp_speculator import is_mlp_speculator_workdir, load_mlp_speculator_run
    from confu_jax.weights.mlp_speculator_format import is_mlp_speculator_dir, load_mlp_speculator_dir

    def untrained():
        c = make_config(n_predict, target_cfg.d_model, target_cfg.vocab_size)
        params = jax.device_get(init_mlp_speculator(jax.random.PRNGKey(seed), c))
        return params, f"MLP speculator reference initialisation ({n_predict} stages, seed {seed})"

    def run(path):
        r = load_mlp_speculator_run(path, target_cfg, target_params, target_source=target_source)
        return r.params, r.source

    def check(params):
        c = config_of(params)
        if c.emb_dim != target_cfg.d_model:
            raise ValueError(f"{source}: an MLP speculator of emb_dim {c.emb_dim} cannot read a target of width "
                             f"{target_cfg.d_model}")
        if c.vocab_size < target_cfg.vocab_size:
            raise ValueError(f"{source}: MLP speculator over {c.vocab_size} tokens; the target has "
                             f"{target_cfg.vocab_size}")

    kinds = (SourceKind("an MLP speculator launch.train workdir (config.json with an 'mlp_speculator' section + "
                        "checkpoints/)", is_mlp_speculator_workdir, run),
             SourceKind("a published MLP speculator directory (config.json with model_type 'mlp_speculator' + "
                        "model.safetensors)", is_mlp_speculator_dir,
                        lambda p: (load_mlp_speculator_dir(p).params, f"{p} (fms / vLLM mlp_speculator format)")))
    return load_own_tree(target_cfg, target_params, "mlp_speculator", source, untrained=untrained, kinds=kinds,
                         check=check)

FAMILIES = (DrafterFamily(
    "mlp_speculator", lambda text: MLPSpeculatorDrafter(parse_mlp_speculator_plan(text)),
    own_weights_loader(load_mlp_speculator),
    methods=(Method("mlp_speculator", (), "IBM's MLP speculator: recurrent stages on the target's last hidden state "
                    "and the drafted tokens (trained with configs/*_mlp_speculator.py, or an fms / vLLM "
                    "mlp_speculator directory)", own_weights=True),),
    chains=DEFAULT_CHAINS[:3], trees=DEFAULT_CARTESIAN_TREES,
    max_depth=lambda dp: config_of(dp.weights["mlp_speculator"]).n_predict,
    export_formats=(runs_mlp_speculator.EXPORT_FORMAT,)),)
