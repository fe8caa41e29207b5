"""Trees over block drafts (DDTree, arXiv 2604.12989): ``decode.tree.draft_block_tree`` and the
``ddtree:N[,D]`` plan (``decode.plans.BlockTree``).

* The tree is the exact top-(T-1) of the Cartesian tree of per-position top-k by path log-probability,
  checked against brute-force enumeration on random block distributions; nodes come out best first,
  topologically, with siblings in rank order (what the sequential sampled rule visits), every node's
  token the r-th best of its depth and every cumulative score its path's sum.
* Zero-mass drafts leave invalid nodes, never accepted ones.
* Only block drafters read the plan: the head families refuse it at parse time and a plan grown through
  a parent-conditioned ``expand_fn`` refuses at trace time, naming the plan.

Greedy = AR for DFlash and Medusa under a ``ddtree:`` plan is the family contract's
(``tests/contract/test_family_contract.py``); the sampled rule's chi-square is ``test_dflash``'s.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import plans
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.tree import draft_block_tree


def _brute_force_scores(lp_dv: np.ndarray, n: int) -> list:
    """The n best path scores of the Cartesian tree of every position's top-n (no ties in the data)."""
    depth, v = lp_dv.shape
    k = min(n, v)
    top = np.sort(lp_dv, axis=1)[:, ::-1][:, :k]
    scores = [sum(top[i, r] for i, r in enumerate(ranks))
              for d in range(1, depth + 1) for ranks in itertools.product(range(k), repeat=d)]
    return sorted(scores, reverse=True)[:n]


@pytest.mark.parametrize("b,depth,v,n_nodes", [(3, 4, 7, 9), (2, 3, 5, 13), (2, 1, 6, 4), (1, 5, 3, 12)])
def test_block_tree_is_the_best_nodes_of_the_cartesian_tree(b, depth, v, n_nodes):
    rng = np.random.default_rng(n_nodes)
    logp = jax.nn.log_softmax(jnp.asarray(2.0 * rng.standard_normal((b, depth, v)), jnp.float32), -1)
    roots = jnp.arange(b, dtype=jnp.int32)
    tree, cum = jax.jit(lambda lp, r: draft_block_tree(lp, r, n_nodes=n_nodes))(logp, roots)
    tok, par, dep = (np.asarray(x) for x in (tree.tokens_bt, tree.parents_bt, tree.depth_bt))
    cum, lp = np.asarray(cum), np.asarray(logp)
    assert np.asarray(tree.valid_bt).all() and tok.shape == (b, n_nodes)
    for i in range(b):
        np.testing.assert_allclose(sorted(cum[i, 1:], reverse=True), _brute_force_scores(lp[i], n_nodes - 1),
                                   rtol=1e-5, atol=1e-5)
        assert tok[i, 0] == roots[i] and par[i, 0] == -1
        assert np.all(np.diff(cum[i]) <= 1e-6)  # best first
        order = np.argsort(-lp[i], axis=1)
        for j in range(1, n_nodes):
            p = par[i, j]
            assert 0 <= p < j and dep[i, j] == dep[i, p] + 1  # topological, one deeper than its parent
            rank = int(np.nonzero(order[dep[i, j] - 1] == tok[i, j])[0][0])
            np.testing.assert_allclose(cum[i, j], cum[i, p] + lp[i, dep[i, j] - 1, tok[i, j]], rtol=1e-5, atol=1e-5)
            elder = [s for s in range(1, j) if par[i, s] == p]
            ranks = [int(np.nonzero(order[dep[i, j] - 1] == tok[i, s])[0][0]) for s in elder]
            assert ranks == list(range(rank)), (i, j)  # siblings in rank order, none skipped


def test_best_first_over_a_parent_conditioned_draft_is_its_best_nodes():
    """``draft_best_first_tree`` with a distribution that depends on the parent's token and on a state the
    parent passes down (DSpark's Markov bias, its rnn): the tree is the best T-1 nodes of the tree of every
    node's top-k, by brute-force enumeration of the conditional path scores."""
    from confu_jax.decode.tree import draft_best_first_tree

    rng = np.random.default_rng(4)
    b, depth, v, n_nodes = 2, 3, 4, 9
    base = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((b, depth, v)), jnp.float32), -1)
    mix = jnp.asarray(1.5 * rng.standard_normal((v, v)), jnp.float32)  # the bias of a token on its children

    def children(tokens_b, depth_b, state):
        rows = jnp.arange(b)
        state = state + tokens_b.astype(jnp.float32)  # a running sum of the path's tokens
        logits = base[rows, jnp.minimum(depth_b, depth - 1)] + mix[tokens_b] + 0.1 * state[:, None]
        return jax.nn.log_softmax(logits, -1), state

    roots = jnp.array([1, 3], jnp.int32)
    tree, cum = jax.jit(lambda r: draft_best_first_tree(children, r, n_nodes=n_nodes, depth=depth,
                                                        state0=jnp.zeros((b,), jnp.float32)))(roots)
    tok, par, cum = np.asarray(tree.tokens_bt), np.asarray(tree.parents_bt), np.asarray(cum)
    for i in range(b):
        every = [p for dd in range(1, depth + 1) for p in itertools.product(range(v), repeat=dd)]

        def score(path):
            s, state, prev = 0.0, 0.0, int(roots[i])
            for dpos, t in enumerate(path):
                state += prev
                s += float(np.asarray(jax.nn.log_softmax(base[i, dpos] + mix[prev] + 0.1 * state))[t])
                prev = t
            return s

        best = sorted((score(p) for p in every), reverse=True)[:n_nodes - 1]
        np.testing.assert_allclose(sorted(cum[i, 1:], reverse=True), best, rtol=1e-5, atol=1e-5)
        for j in range(1, n_nodes):  # each node's score is its parent's plus its own conditional log-probability
            path = []
            node = j
            while node > 0:
                path.append(int(tok[i, node]))
                node = par[i, node]
            np.testing.assert_allclose(cum[i, j], score(path[::-1]), rtol=1e-5, atol=1e-5)


def test_zero_mass_drafts_are_invalid_nodes():
    """Two tokens with mass at one depth: a budget of 4 drafts leaves the last two invalid."""
    logp = jnp.log(jnp.asarray([[[0.7, 0.3, 0.0, 0.0]]], jnp.float32))
    tree, cum = draft_block_tree(logp, jnp.array([2]), n_nodes=5)
    assert np.asarray(tree.valid_bt)[0].tolist() == [True, True, True, False, False]
    assert np.asarray(tree.tokens_bt)[0, :3].tolist() == [2, 0, 1] and not np.isfinite(np.asarray(cum)[0, 3:]).any()


def test_a_draft_vocabulary_maps_to_target_ids():
    logp = jnp.log(jnp.asarray([[[0.6, 0.4], [0.9, 0.1]]], jnp.float32))
    tree, _ = draft_block_tree(logp, jnp.array([0]), n_nodes=4, d2t_v=jnp.array([7, 5]))
    assert np.asarray(tree.tokens_bt)[0].tolist() == [0, 7, 7, 5]  # x=7 (.6), then 7 under it (.54), sibling 5 (.4)


def test_plan_text_and_the_families_that_read_it():
    p = plans.parse_plan("ddtree:30,8", block=True)
    assert isinstance(p, plans.BlockTree) and (p.n_nodes_total, p.max_depth, p.text) == (31, 8, "ddtree:30,8")
    assert plans.parse_plan("ddtree:6", block=True).text == "ddtree:6" and plans.parse_plan("ddtree:6", block=True).max_depth == 6
    for bad, why in (("ddtree:3,5", "a depth past N = 3"), ("ddtree:0", "N >= 1"), ("ddtree:4,2,1", "N or N,D")):
        with pytest.raises(ValueError, match=why):
            plans.parse_plan(bad, block=True)
    assert parse_drafter("medusa", "ddtree:8,3").describe() == "ddtree:8,3"
    for method in ("eagle3", "confu", "mlp_speculator", "mtp", "lookup"):
        with pytest.raises(ValueError, match="ddtree"):
            parse_drafter(method, "ddtree:8,3")
    with pytest.raises(ValueError, match="conditions on the tokens it drafted"):
        p.grow(lambda s, fr: (None, s), None, None)


@pytest.mark.parametrize("b,depth,v,n_nodes,fanout", [(3, 4, 9, 12, 3), (2, 3, 6, 20, 4), (2, 1, 6, 6, 2),
                                                      (1, 5, 5, 9, 1), (2, 2, 7, 31, 5), (1, 3, 4, 40, 4)])
def test_fanout_tree_equals_jetspec_accum_logp(b, depth, v, n_nodes, fanout):
    """``accum_logp:N,W[,D]`` node for node against JetSpec's own construction (its heap loop,
    transcribed in tests/helpers/jetspec_reference.py): tokens, parents, depths and cumulative
    log-probabilities in its insertion order, over random block drafts (budget cut inside a fan, a
    depth limit that saturates the tree before the budget, fanout 1 = a chain)."""
    from confu_jax.decode.tree import draft_fanout_tree
    from tests.helpers import jetspec_reference as ref

    rng = np.random.default_rng(100 * n_nodes + fanout)
    logits = 2.0 * rng.standard_normal((b, depth, v)).astype(np.float32)
    roots = jnp.arange(b, dtype=jnp.int32) + 1
    tree, cum = jax.jit(lambda lg, r: draft_fanout_tree(jax.nn.log_softmax(lg, -1), r, n_nodes=n_nodes,
                                                         fanout=fanout))(jnp.asarray(logits), roots)
    tok, par, dep, valid = (np.asarray(x) for x in (tree.tokens_bt, tree.parents_bt, tree.depth_bt, tree.valid_bt))
    for i in range(b):
        toks, lps = ref.per_depth_topk(logits[i], fanout)
        want_tok, want_par, want_dep, want_cum = ref.build_from_topk(int(roots[i]), toks, lps, n_nodes)
        n = len(want_tok)
        assert valid[i].sum() == n and valid[i, :n].all(), (i, valid[i], n)
        assert tok[i, :n].tolist() == want_tok and par[i, :n].tolist() == want_par and dep[i, :n].tolist() == want_dep
        np.testing.assert_allclose(np.asarray(cum)[i, :n], want_cum, rtol=1e-5, atol=1e-5)


def test_fanout_plan_text_and_who_grows_it():
    p = plans.parse_plan("accum_logp:30,4,8", block=True)
    assert isinstance(p, plans.FanoutTree) and (p.n_nodes_total, p.fanout, p.max_depth, p.text) == (31, 4, 8,
                                                                                                  "accum_logp:30,4,8")
    assert plans.parse_plan("accum_logp:6,2", block=True).text == "accum_logp:6,2"
    for bad, why in (("accum_logp:6", "expected"), ("accum_logp:3,0", "fanout W >= 1"),
                     ("accum_logp:3,2,5", "a depth past N = 3"), ("accum_logp:4,2,1,1", "N,W or N,W,D")):
        with pytest.raises(ValueError, match=why):
            plans.parse_plan(bad, block=True)
    assert parse_drafter("dflash", "accum_logp:8,2,3").describe() == "accum_logp:8,2,3"
    with pytest.raises(ValueError, match="accum_logp"):
        parse_drafter("eagle3", "accum_logp:8,2,3")
    with pytest.raises(ValueError, match="from the root alone"):
        p.grow_conditional(None, None, None)
