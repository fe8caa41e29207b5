"""Verification rules: greedy against a brute-force walk; sampling rules against the exact AR law.

The exact-distribution harness: a tiny target whose next-token logits are a random table indexed
by the last two tokens (vocabulary 6), a draft with a different table (many rejections), and
drafting + verification iterations vmapped over 150k keys until three tokens are emitted. The
empirical joint law of those three tokens is compared with the exact AR law
p(x1|c0,c1) p(x2|c1,x1) p(x3|x1,x2), p = ``target_probs`` (the AR path's own function), by a
chi-square test. Zero-probability triples (top-p) must never appear. A deliberately wrong rule
must fail the same harness, so a pass is not vacuous.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from confu_jax.decode import tree as tr
from confu_jax.decode import verify as vf
from confu_jax.decode.sampling import sample, target_probs

V = 6
N_SAMPLES = 150_000
CONTEXT = (1, 4)  # c0, c1: the root of the first tree is c1
TREE_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
CHAIN_K = 3


def _tables():
    rng = np.random.default_rng(7)
    target = rng.normal(size=(V, V, V)).astype(np.float32) * 1.5
    draft = target + rng.normal(size=(V, V, V)).astype(np.float32) * 1.5
    return jnp.asarray(target), jnp.asarray(draft)


TARGET, DRAFT = _tables()


def _table_expand(table):
    """A draft whose log-probs depend on the node's token and the token before it."""

    def expand(state, fr):  # state: [B,K_prev] tokens of the previous frontier
        prev = jnp.take_along_axis(state, fr.parent_slot_bk, axis=1)
        return jax.nn.log_softmax(table[prev, fr.tokens_bk], axis=-1), fr.tokens_bk

    return expand


def _target_logits(tree, c_prev_b):
    """Target logits at every node: the table at (parent's token, node's token)."""
    par_tok = jnp.take_along_axis(tree.tokens_bt, jnp.maximum(tree.parents_bt, 0), axis=1)
    prev = jnp.where(tree.parents_bt < 0, c_prev_b[:, None], par_tok)
    return TARGET[prev, tree.tokens_bt]


def _dup_pad(tree):
    """Second root child duplicates the first's token; the third is padding with a tempting token
    (the target's argmax at the root), so neither may ever be accepted."""
    tok = tree.tokens_bt.at[:, 2].set(tree.tokens_bt[:, 1])
    valid = tree.valid_bt.at[:, 3].set(False)
    return tr.build_tree(tok, tree.parents_bt, tree.max_depth, valid)


def _wrong_tree_rule(tree, logits, key, temperature, top_p):
    """Accept each child with p(c) (no residual), bonus from p: not lossless."""
    p = target_probs(logits, temperature, top_p)
    b, t, _ = p.shape
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, (b, t))
    rows = jnp.arange(b)

    def step(cur, j):
        child = tree.valid_bt[:, j] & (tree.parents_bt[:, j] == cur)
        acc = child & (u[:, j] < p[rows, cur, tree.tokens_bt[:, j]])
        return jnp.where(acc, j, cur), None

    last, _ = jax.lax.scan(step, jnp.zeros((b,), jnp.int32), jnp.arange(1, t))
    return vf.make_verification(tree, last, sample(k2, p[rows, last]))


def _wrong_chain_rule(tree, logits, q, key, temperature, top_p):
    """min(1, p/q) acceptance but resampling from p instead of the residual: not lossless."""
    k1, k2 = jax.random.split(key)
    v = vf.verify_sampled_chain(tree, logits, q, k1, temperature, top_p)
    rows = jnp.arange(logits.shape[0])
    p_last = target_probs(logits[rows, v.last_node_b], temperature, top_p)
    return vf.make_verification(tree, v.last_node_b, sample(k2, p_last))


@functools.lru_cache(maxsize=None)
def _sampler(rule):
    """jit(vmap over keys) of: three drafting+verification iterations from CONTEXT."""
    struct = tr.static_structure(TREE_PATHS)
    d_max = max(struct.max_depth, CHAIN_K)
    buf_len = 2 + 3 * (d_max + 1)

    def one(key, draft_table, temperature, top_p):
        expand = _table_expand(draft_table)

        def iteration(_, carry):  # each iteration emits >= 1 token, so 3 suffice
            key, buf, length, n_acc = carry
            key, kd, kv = jax.random.split(key, 3)
            c_prev, root = buf[length - 2][None], buf[length - 1][None]
            if rule in ("tree", "tree_dup_pad", "wrong_tree", "greedy"):
                tree, _ = tr.draft_static_tree(expand, c_prev[:, None], root, struct)
                if rule == "tree_dup_pad":
                    tree = _dup_pad(tree)
                logits = _target_logits(tree, c_prev)
                if rule == "wrong_tree":
                    v = _wrong_tree_rule(tree, logits, kv, temperature, top_p)
                elif rule == "greedy":
                    v = vf.verify_greedy(tree, logits)
                else:
                    v = vf.verify_sampled_tree(tree, logits, kv, temperature, top_p)
            else:
                tree, q, _ = tr.draft_sampled_chain(expand, c_prev[:, None], root, CHAIN_K, kd,
                                                    temperature, top_p)
                logits = _target_logits(tree, c_prev)
                fn = _wrong_chain_rule if rule == "wrong_chain" else vf.verify_sampled_chain
                v = fn(tree, logits, q, kv, temperature, top_p)
            buf = jax.lax.dynamic_update_slice(buf, v.emitted_bd[0], (length,))
            return key, buf, length + v.n_accepted_b[0], n_acc + v.n_accepted_b[0] - 1

        buf = jnp.full((buf_len,), -1, jnp.int32).at[:2].set(jnp.array(CONTEXT))
        _, buf, _, n_acc = jax.lax.fori_loop(0, 3, iteration,
                                             (key, buf, jnp.int32(2), jnp.int32(0)))
        return buf[2:5], n_acc

    return jax.jit(jax.vmap(one, in_axes=(0, None, None, None)))


def _exact_joint(temperature, top_p):
    p = np.asarray(target_probs(TARGET, temperature, top_p), np.float64)  # [prev, last, next]
    c0, c1 = CONTEXT
    joint = (p[c0, c1][:, None, None] * p[c1][:, :, None] * p[:, :, :])
    return joint.reshape(-1)


def _run(rule, temperature, top_p, draft=None, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), N_SAMPLES)
    draft = DRAFT if draft is None else draft
    toks, n_acc = _sampler(rule)(keys, draft, jnp.float32(temperature), jnp.float32(top_p))
    toks = np.asarray(toks)
    assert toks.min() >= 0, "fewer than three tokens emitted in three iterations"
    counts = np.bincount((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2], minlength=V ** 3)
    return counts, np.asarray(n_acc)


def _chi2_pvalue(counts, expected_p):
    """Chi-square p-value; zero-probability cells must be empty; cells with expected < 5 merged."""
    assert counts[expected_p == 0].sum() == 0, "emitted a triple the target cannot produce"
    n = counts.sum()
    exp = expected_p / expected_p.sum() * n
    big = exp >= 5
    obs_m = np.append(counts[big], counts[~big & (exp > 0)].sum())
    exp_m = np.append(exp[big], exp[~big & (exp > 0)].sum())
    if exp_m[-1] < 5:  # fold a still-small pool into the smallest cell
        j = np.argmin(exp_m[:-1])
        obs_m[j] += obs_m[-1]
        exp_m[j] += exp_m[-1]
        obs_m, exp_m = obs_m[:-1], exp_m[:-1]
    return stats.chisquare(obs_m, exp_m).pvalue


SETTINGS = [(0.7, 1.0), (1.0, 1.0), (1.0, 0.7)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
@pytest.mark.parametrize("rule", ["tree", "chain"])
def test_sampling_is_lossless(rule, temperature, top_p):
    counts, n_acc = _run(rule, temperature, top_p)
    pval = _chi2_pvalue(counts, _exact_joint(temperature, top_p))
    assert pval > 1e-3, f"{rule} T={temperature} top_p={top_p}: chi-square p={pval:.2e}"
    # drafts are accepted often but not always: both branches of the rule are exercised
    assert 0.3 < n_acc.mean() < 3 * CHAIN_K - 0.3


@pytest.mark.slow
def test_tree_rule_with_duplicate_and_padding_siblings_is_lossless():
    counts, _ = _run("tree_dup_pad", 1.0, 0.9, seed=1)
    assert _chi2_pvalue(counts, _exact_joint(1.0, 0.9)) > 1e-3


def test_chain_rule_when_draft_equals_target():
    """p = q: the residual is empty, every draft must be accepted, and the law is still exact."""
    counts, n_acc = _run("chain", 0.7, 0.8, draft=TARGET, seed=2)
    assert _chi2_pvalue(counts, _exact_joint(0.7, 0.8)) > 1e-3
    assert n_acc.min() >= CHAIN_K  # the first iteration alone accepts all CHAIN_K drafts


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["wrong_tree", "wrong_chain"])
def test_harness_rejects_a_wrong_rule(rule):
    counts, _ = _run(rule, 1.0, 1.0, seed=3)
    assert _chi2_pvalue(counts, _exact_joint(1.0, 1.0)) < 1e-3


def test_greedy_harness_matches_argmax_decoding():
    toks, _ = _sampler("greedy")(jax.random.split(jax.random.PRNGKey(0), 4), DRAFT,
                                 jnp.float32(0.0), jnp.float32(1.0))
    c0, c1 = CONTEXT
    ref = []
    for _ in range(3):
        nxt = int(jnp.argmax(TARGET[c0, c1]))
        ref.append(nxt)
        c0, c1 = c1, nxt
    np.testing.assert_array_equal(np.asarray(toks), np.broadcast_to(ref, (4, 3)))


# ---------------------------------------------------------------------------------------------
# greedy vs a brute-force walk; sampled rule at temperature 0


def _brute_greedy(parents, tokens, valid, logits):
    """Deepest node whose whole path matches the parent's argmax (lowest index on ties)."""
    t = len(parents)
    am = logits.argmax(-1)
    best = (0, 0)  # (depth, -index)
    best_node = 0
    for i in range(1, t):
        a, d, ok = i, 0, True
        while a > 0:
            ok &= bool(valid[a]) and tokens[a] == am[parents[a]]
            a, d = parents[a], d + 1
        if ok and (d, -i) > best:
            best, best_node = (d, -i), i
    path, a = [], best_node
    while a >= 0:
        path.append(a)
        a = parents[a]
    return path[::-1], int(am[best_node])


def _random_trees(seed, distinct_siblings, b=32, t=10, max_depth=4, vocab=4):
    """Random trees (some padding) whose logits often favour one of a node's children."""
    rng = np.random.default_rng(seed)
    parents = np.array([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, t)]
                        for _ in range(b)], np.int32)
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    logits = rng.normal(size=(b, t, vocab)).astype(np.float32)
    for r in range(b):
        for i in range(t):
            kids = np.nonzero(parents[r] == i)[0]
            if distinct_siblings and len(kids):
                tokens[r, kids] = rng.permutation(max(vocab, len(kids)))[:len(kids)]
            if len(kids) and rng.random() < 0.7:
                logits[r, i, tokens[r, rng.choice(kids)] % vocab] += 4.0
    valid = rng.random((b, t)) > 0.1
    tree = jax.jit(tr.build_tree, static_argnums=2)(tokens, parents, max_depth, valid)
    return tree, logits


def test_greedy_matches_brute_force_walk():
    tree, logits = _random_trees(0, distinct_siblings=False)
    v = jax.jit(vf.verify_greedy)(tree, logits)
    par, tok, val = (np.asarray(x) for x in (tree.parents_bt, tree.tokens_bt, tree.valid_bt))
    depths = []
    for r in range(par.shape[0]):
        path, bonus = _brute_greedy(list(par[r]), tok[r], val[r], logits[r])
        n = len(path)
        depths.append(n - 1)
        assert int(v.n_accepted_b[r]) == n
        assert list(np.asarray(v.path_bd[r, :n])) == path
        assert np.all(np.asarray(v.path_bd[r, n:]) == -1)
        assert int(v.bonus_b[r]) == bonus
        emitted = [int(tok[r, i]) for i in path[1:]] + [bonus]
        assert list(np.asarray(v.emitted_bd[r, :n])) == emitted
    assert max(depths) >= 2 and min(depths) == 0  # the random trees cover deep and empty accepts


def test_sampled_tree_at_temperature_zero_is_greedy():
    """Without duplicate siblings (where greedy may take the deeper copy, and the sequential rule
    never tries the second one) the two rules must agree exactly."""
    tree, logits = _random_trees(1, distinct_siblings=True)
    g = jax.jit(vf.verify_greedy)(tree, logits)
    s = jax.jit(vf.verify_sampled_tree)(tree, logits, jax.random.PRNGKey(5), 0.0, 1.0)
    for a, b in zip(g, s):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_chain_padding_ends_without_a_rejection():
    """An invalid node stops the chain and the bonus comes from p, not from the residual.

    Node 1 is drafted with q = p (always accepted); node 2 is padding whose q is one-hot on
    token 2, which holds 98.7% of p at node 1. Were padding a rejection, the residual
    max(p - q, 0) would never emit token 2."""
    logits = jnp.array([[[0.0, 3.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]]])  # [1,3,3]
    p = target_probs(logits, 1.0, 1.0)
    q = jnp.stack([jnp.zeros(3), p[0, 0], jnp.array([0.0, 0.0, 1.0])])[None]
    tree = tr.build_tree(jnp.array([[0, 1, 2]]), jnp.array([[-1, 0, 1]]), 2,
                         jnp.array([[True, True, False]]))
    run = jax.jit(jax.vmap(lambda k: vf.verify_sampled_chain(tree, logits, q, k, 1.0, 1.0)))
    v = run(jax.random.split(jax.random.PRNGKey(0), 512))
    assert np.all(np.asarray(v.n_accepted_b) == 2)
    bonus = np.asarray(v.bonus_b)[:, 0]
    assert np.mean(bonus == 2) > 0.95
    np.testing.assert_array_equal(np.asarray(v.emitted_bd)[:, 0, 0], 1)
    np.testing.assert_array_equal(np.asarray(v.emitted_bd)[:, 0, 1], bonus)
    assert np.all(np.asarray(v.emitted_bd)[:, 0, 2] == -1)


def test_shape_errors_name_the_tensors():
    tree = tr.build_tree(jnp.zeros((1, 3), jnp.int32), jnp.array([[-1, 0, 1]]), 2)
    with pytest.raises(ValueError, match=r"logits_btv must be \[B,T,V\]"):
        vf.verify_greedy(tree, jnp.zeros((1, 4, 5)))


def verify_sampled_tree_reference(tree, logits_btv, key, temperature, top_p=1.0):
    """The residual rule with r materialised as a [B, V] array at every step (the formulation the
    O(T)-per-step implementation replaced): the two must take the same decisions."""
    p_btv = target_probs(logits_btv, temperature, top_p)
    b, t, _ = p_btv.shape
    k_acc, k_bonus = jax.random.split(key)
    u_bt = jax.random.uniform(k_acc, (b, t), jnp.float32)
    rows = jnp.arange(b)

    def step(carry, j):
        cur_b, r_bv = carry
        tok_b = tree.tokens_bt[:, j]
        is_child = tree.valid_bt[:, j] & (tree.parents_bt[:, j] == cur_b)
        r_c = r_bv[rows, tok_b]
        accept = is_child & (u_bt[:, j] * jnp.sum(r_bv, axis=-1) < r_c)
        reject = is_child & ~accept
        r_zeroed = r_bv.at[rows, tok_b].set(jnp.where(reject, 0.0, r_c))
        r_bv = jnp.where(accept[:, None], p_btv[:, j], r_zeroed)
        return (jnp.where(accept, j, cur_b), r_bv), None

    (last_b, r_bv), _ = jax.lax.scan(step, (jnp.zeros((b,), jnp.int32), p_btv[:, 0]), jnp.arange(1, t))
    r_bv = jnp.where(jnp.sum(r_bv, axis=-1, keepdims=True) > 0, r_bv, p_btv[rows, last_b])
    return vf.make_verification(tree, last_b, sample(k_bonus, r_bv).astype(jnp.int32))


def test_sampled_tree_rule_equals_the_materialised_residual_reference():
    """Random trees over a 40-token vocabulary whose siblings often share a token (duplicates) and
    include padding: same accepted node and bonus token as the [B, V]-residual formulation."""
    rng = np.random.default_rng(0)
    b, t, v = 8, 12, 40
    parents = np.array([-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7])
    fast, ref = jax.jit(vf.verify_sampled_tree), jax.jit(verify_sampled_tree_reference)
    n_diff = 0
    for trial in range(60):
        tokens = rng.integers(0, 4, size=(b, t))  # 4 distinct tokens: duplicate siblings are common
        valid = rng.random((b, t)) > 0.1
        tree = tr.build_tree(jnp.asarray(tokens), jnp.broadcast_to(jnp.asarray(parents), (b, t)), 4,
                             jnp.asarray(valid))
        logits = jnp.asarray(rng.normal(size=(b, t, v)).astype(np.float32) * 2)
        logits = logits.at[:, :, :4].add(2.0)  # the drafted tokens carry most of the mass
        key = jax.random.PRNGKey(trial)
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            a, r = fast(tree, logits, key, temperature, top_p), ref(tree, logits, key, temperature, top_p)
            n_diff += int(np.sum(np.asarray(a.last_node_b) != np.asarray(r.last_node_b)))
            n_diff += int(np.sum(np.asarray(a.bonus_b) != np.asarray(r.bonus_b)))
    assert n_diff == 0
