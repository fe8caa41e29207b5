"""Sparse contemplate tokens (ConFu §4 future work): only M of the T tree nodes get a contemplate.

- the verification pass's real-token outputs do not change (logits, taps, K/V);
- each contemplate's f equals a contemplate appended alone to its node's path (plain forward);
- the next iteration's f comes from the deepest contemplated node on the accepted path;
- greedy speculative output still equals AR, for chains and dynamic trees.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode import drafting, loop, plans
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.tree import build_tree
from confu_jax.models.kv_cache import commit, init_cache
from confu_jax.models.target import verify
from confu_jax.models.tree_layout import ancestors_from_parents
from tests.helpers.model_fakes import path_to, random_parents, tiny_params, tiny_spec
from tests.helpers.loop_fixtures import generated_rows, make, prompts_for
from tests.helpers.target_fixtures import (close as _close, jit_real_forward as _real_forward,
                                   plain_with_contemplate as _plain_with_contemplate)


@pytest.mark.slow
def test_sparse_verify_keeps_node_outputs_and_each_f_is_its_paths_contemplate():
    spec = tiny_spec("confu")
    tp, tr = tiny_params(spec, seed=2)
    confu = tr["confu"]
    b, t, m, v = 3, 9, 4, spec.target.vocab_size
    rng = np.random.default_rng(11)
    n_prompt = np.array([6, 3, 8], np.int32)
    prompts = rng.integers(2, v, (b, n_prompt.max())).astype(np.int32)
    cache = init_cache(spec.target.n_layers, b, 32, spec.target.n_kv_heads, spec.target.head_dim)
    out0 = _real_forward(spec, tp, jnp.asarray(prompts))
    cache = commit(cache, out0.k_new_lbthd, out0.v_new_lbthd, jnp.asarray(n_prompt))
    parents = np.stack([random_parents(rng, t) for _ in range(b)])
    tokens = rng.integers(2, v, (b, t)).astype(np.int32)
    con_src = jnp.asarray(rng.normal(size=(b, 3 * spec.d_model)).astype(np.float32))
    # root always contemplated, the other M-1 anywhere in the tree (sorted: topological order)
    con_nodes = np.stack([np.sort(np.concatenate([[0], rng.choice(np.arange(1, t), m - 1, replace=False)]))
                          for _ in range(b)]).astype(np.int32)
    anc = ancestors_from_parents(jnp.asarray(parents))

    vfn = jax.jit(functools.partial(verify, spec))
    full = vfn(tp, confu, cache, jnp.asarray(tokens), anc, con_src)
    sparse = vfn(tp, confu, cache, jnp.asarray(tokens), anc, con_src, con_nodes_bm=jnp.asarray(con_nodes))
    assert sparse.future_btd.shape == (b, m, spec.d_model)
    for name in ("logits_btv", "h_cat_btc", "k_new_lbthd", "v_new_lbthd"):
        _close(getattr(sparse, name), getattr(full, name))
    _close(sparse.future_btd, jnp.take_along_axis(full.future_btd, jnp.asarray(con_nodes)[..., None], 1))

    # reference: for each contemplated node, the plain forward of prompt + its path + [con]
    width = n_prompt.max() + t + 1
    seqs = np.zeros((b * m, width), np.int32)
    lens = np.zeros((b * m,), np.int32)
    for r in range(b):
        for c in range(m):
            s = list(prompts[r, :n_prompt[r]]) + [tokens[r, j] for j in path_to(parents[r], con_nodes[r, c])]
            seqs[r * m + c, :len(s)] = s
            lens[r * m + c] = len(s)
    ref = _plain_with_contemplate(spec, tp, confu, seqs, lens, jnp.repeat(con_src, m, axis=0))
    _close(sparse.future_btd.reshape(b * m, -1), ref.hidden_btd[jnp.arange(b * m), jnp.asarray(lens)])


def test_future_source_is_the_deepest_contemplated_node_on_the_accepted_path():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 2, 3]] * 4, jnp.int32)
    tree = build_tree(jnp.zeros((4, 7), jnp.int32), parents, 3)
    con = jnp.asarray([[0, 1, 5]] * 4, jnp.int32)  # contemplates after nodes 0, 1 and 5
    last = jnp.asarray([6, 4, 2, 5], jnp.int32)
    got = np.asarray(drafting._future_source(tree, last, con))
    # 6 -> 3 -> 1 (contemplated: index 1); 4 -> 1 (1); 2 -> 0 (root: 0); 5 itself (2)
    np.testing.assert_array_equal(got, [1, 1, 0, 2])
    np.testing.assert_array_equal(np.asarray(drafting._future_source(tree, last, None)), np.asarray(last))


def test_contemplate_nodes_rule():
    spec = tiny_spec("confu")
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 2, 3]] * 2, jnp.int32)
    tree = build_tree(jnp.zeros((2, 7), jnp.int32), parents, 3)
    dyn = plans.DynamicTree(3, 2, 7, contemplates=3)
    score = jnp.asarray([[0.0, -0.1, -2.0, -0.3, -3.0, -2.5, -0.2],
                         [0.0, -1.0, -0.5, -1.2, -4.0, -0.6, -1.3]])
    # highest cumulative scores, root first, returned in topological (index) order
    np.testing.assert_array_equal(np.asarray(drafting.contemplate_nodes(spec.has_future, dyn, tree, score)),
                                  [[0, 1, 6], [0, 2, 5]])
    chain = plans.parse_plan("chain:6+c3")
    np.testing.assert_array_equal(np.asarray(drafting.contemplate_nodes(spec.has_future, chain, tree, None)), [[0, 1, 2]] * 2)
    # full ConFu and EAGLE-3: no selection (every node / no contemplates)
    assert drafting.contemplate_nodes(spec.has_future, plans.parse_plan("chain:6"), tree, None) is None
    assert drafting.contemplate_nodes(tiny_spec("eagle3").has_future, chain, tree, None) is None


@pytest.mark.slow
@pytest.mark.parametrize("variant,vocab,plan", [("confu", 24, "chain:3+c2"), ("confu", 4, "dynamic:2,4,20+c5"),
                                                ("confu_nomoe", 24, "dynamic:3,3,8+c1")])
def test_sparse_contemplates_greedy_equals_ar(variant, vocab, plan):
    spec, tp, params = make(variant, vocab)
    prompts = prompts_for(vocab)
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=24, eos_ids=())
    sp = loop.generate_speculative(params.target, HeadDrafter(plans.parse_plan(plan)), params.drafter_params, prompts,
                                   max_new_tokens=24, eos_ids=())
    assert generated_rows(sp, 4) == generated_rows(ar, 4)
    if vocab == 4:  # the full 2-level tree: passes accept >= 3 tokens, so f comes from deep nodes
        log = np.asarray(sp.accept_log_bi)[:, : int(np.asarray(sp.n_passes_b).min()) - 1]
        assert log.size and np.all(log >= 3)
