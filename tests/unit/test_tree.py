"""Draft-tree structure and drafting against brute-force Python constructions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import tree as tr

V = 7
_MIX = 1000003


def _mix(h, tok):
    """Path hash step, uint32 wrap-around (same in jnp and Python)."""
    return h * jnp.uint32(_MIX) + tok.astype(jnp.uint32) + jnp.uint32(1)


def _mix_py(h, tok):
    return (h * _MIX + tok + 1) % (1 << 32)


def _hash32(x):
    """lowbias32 integer hash on uint32 (jnp or numpy): a cheap fixed pseudo-random function."""
    u32 = type(x.dtype.type(0))  # np.uint32 works for numpy and jax arrays alike
    x = x ^ (x >> u32(16))
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> u32(15))
    x = x * u32(0x846CA68B)
    return x ^ (x >> u32(16))


def _logits_of_hash(h, xp):
    u = _hash32(h[..., None] * xp.uint32(V) + xp.arange(V, dtype=xp.uint32))
    return (u >> 8).astype(xp.float32) * xp.float32(6.0 / (1 << 24))  # in [0, 6)


def _logp_of_hash(h_n):
    """A fixed pseudo-random function of the path: draft log-probs keyed by the path hash."""
    return jax.nn.log_softmax(_logits_of_hash(h_n, jnp), axis=-1)


def _logp_of_hash_py(h):
    with np.errstate(over="ignore"):
        x = _logits_of_hash(np.asarray(h, np.uint32), np)
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


def expand_via_parent_slot(state, fr: tr.Frontier):
    """Threads the parent's path hash through ``parent_slot_bk`` (as a draft gathers hidden
    states)."""
    h_parent = jnp.take_along_axis(state, fr.parent_slot_bk, axis=1)
    h = _mix(h_parent, fr.tokens_bk)
    return _logp_of_hash(h), h


def expand_via_ancestor_mask(state, fr: tr.Frontier):
    """Rebuilds each node's path from the scratch buffer and ``ancestor_bkn`` only (how a draft
    attends to its tree KV entries); must agree with the parent-slot version."""
    seed_b, slots_bn = state
    if slots_bn is None:
        slots_bn = jnp.zeros((seed_b.shape[0], fr.n_scratch), jnp.int32)
    k = fr.tokens_bk.shape[1]
    slots_bn = slots_bn.at[:, fr.slot_offset:fr.slot_offset + k].set(fr.tokens_bk)
    h = jnp.broadcast_to(seed_b[:, None], fr.tokens_bk.shape)
    for s in range(fr.n_scratch):  # scratch slots are in depth order
        h = jnp.where(fr.ancestor_bkn[:, :, s], _mix(h, slots_bn[:, s][:, None]), h)
    return _logp_of_hash(h), (seed_b, slots_bn)


def _path_tokens(tree, b, i):
    path = np.asarray(tree.path_btd[b, i])
    return tuple(int(tree.tokens_bt[b, n]) for n in path if n >= 0)


# ---------------------------------------------------------------------------------------------
# build_tree


_build = jax.jit(tr.build_tree, static_argnums=2)


def _random_parents(rng, t):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    return parents


def _brute_structure(parents, valid_in, max_depth):
    t = len(parents)
    depth, anc, paths, valid = [], np.zeros((t, t), bool), [], []
    for i in range(t):
        chain, a = [], i
        while a >= 0:
            chain.append(a)
            a = parents[a]
        chain = chain[::-1]  # root .. i
        d = len(chain) - 1
        ok = chain[0] == 0 and d <= max_depth and all(valid_in[c] or c == 0 for c in chain)
        valid.append(ok)
        if d > max_depth:  # build_tree treats an over-deep node as detached
            depth.append(0)
            anc[i, i] = True
            paths.append([i] + [-1] * max_depth)
            continue
        depth.append(d)
        anc[i, chain] = True
        paths.append(chain + [-1] * (max_depth - d))
    return np.array(depth), anc, np.array(paths), np.array(valid)


def test_build_tree_matches_brute_force():
    rng = np.random.default_rng(0)
    b, t, max_depth = 6, 12, 4
    parents = np.array([_random_parents(rng, t) for _ in range(b)], np.int32)
    valid = rng.random((b, t)) > 0.15
    tokens = rng.integers(0, V, (b, t))
    tree = _build(tokens, parents, max_depth, valid)
    assert tree.path_btd.shape == (b, t, max_depth + 1)
    n_too_deep = 0
    for r in range(b):
        depth, anc, paths, val = _brute_structure(list(parents[r]), valid[r], max_depth)
        over = np.array([not v and d == 0 and i > 0 for i, (d, v) in enumerate(zip(depth, val))])
        n_too_deep += over.sum()
        np.testing.assert_array_equal(np.asarray(tree.valid_bt[r]), val)
        ok = val  # structure of invalid-by-depth nodes is only required to be self-attending
        np.testing.assert_array_equal(np.asarray(tree.depth_bt[r])[ok], depth[ok])
        np.testing.assert_array_equal(np.asarray(tree.ancestor_btt[r])[ok], anc[ok])
        np.testing.assert_array_equal(np.asarray(tree.path_btd[r])[ok], paths[ok])
        assert np.all(np.diag(np.asarray(tree.ancestor_btt[r])))  # every row attends to itself
    assert n_too_deep > 0, "the random trees should include nodes deeper than max_depth"


def test_build_tree_rejects_malformed_parents():
    tokens = np.zeros((1, 5), np.int32)
    parents = np.array([[3, 0, 2, 1, -1]], np.int32)  # root given a parent; 2->2 self; 4 orphan
    tree = _build(tokens, parents, 4)
    np.testing.assert_array_equal(np.asarray(tree.valid_bt[0]), [True, True, False, True, False])
    assert int(tree.parents_bt[0, 0]) == -1 and int(tree.depth_bt[0, 3]) == 2


def test_positions_follow_depth():
    s = tr.static_structure([(0,), (1,), (0, 0)])
    tree = _build(np.zeros((2, 4), np.int32), np.broadcast_to(s.parents_t, (2, 4)), 2)
    np.testing.assert_array_equal(np.asarray(tree.positions_bt(jnp.array([5, 9]))),
                                  [[6, 7, 7, 8], [10, 11, 11, 12]])


# ---------------------------------------------------------------------------------------------
# static trees


def test_static_structure_orders_bfs_and_validates():
    s = tr.static_structure([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    assert s.paths == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    np.testing.assert_array_equal(s.parents_t, [-1, 0, 0, 1, 1, 3])
    np.testing.assert_array_equal(s.depth_t, [0, 1, 1, 2, 2, 3])
    with pytest.raises(ValueError, match=r"parent \(0,\)"):
        tr.static_structure([(0, 0)])
    with pytest.raises(ValueError, match="twice"):
        tr.static_structure([(0,), (0,)])
    c = tr.chain_structure(3)
    np.testing.assert_array_equal(c.parents_t, [-1, 0, 1, 2])


PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


def _brute_static(paths, root, seed):
    """Python construction: node with rank r is its parent's r-th most probable draft token."""
    h_root = _mix_py(seed, root)
    out = {(): ((root,), h_root)}
    for p in sorted(paths, key=lambda p: (len(p), p)):
        toks, h = out[p[:-1]]
        order = np.argsort(-_logp_of_hash_py(h), kind="stable")
        tok = int(order[p[-1]])
        out[p] = (toks + (tok,), _mix_py(h, tok))
    return out


@pytest.mark.parametrize("expand", ["parent_slot", "ancestor_mask"])
def test_draft_static_tree_matches_brute_force(expand):
    s = tr.static_structure(PATHS)
    roots = jnp.array([3, 0, 6], jnp.int32)
    seeds = jnp.array([11, 12, 13], jnp.uint32)
    if expand == "parent_slot":
        fn, state = expand_via_parent_slot, seeds[:, None]
    else:
        fn, state = expand_via_ancestor_mask, (seeds, None)
    tree, _ = jax.jit(lambda st, r: tr.draft_static_tree(fn, st, r, s))(state, roots)
    for b in range(3):
        ref = _brute_static(PATHS, int(roots[b]), int(seeds[b]))
        for i, p in enumerate(s.paths):
            assert _path_tokens(tree, b, i) == ref[p][0], (b, p)
    assert bool(jnp.all(tree.valid_bt))


def test_sampled_chain_q_and_tokens():
    """q at node i is target_probs of the draft at its parent; sampled tokens lie in q's support."""
    from confu_jax.decode.sampling import target_probs
    roots = jnp.array([1, 4], jnp.int32)
    seeds = jnp.array([5, 6], jnp.uint32)
    tree, q_btv, _ = jax.jit(lambda st, r, key: tr.draft_sampled_chain(
        expand_via_parent_slot, st, r, 4, key, 0.8, 0.7))(seeds[:, None], roots,
                                                          jax.random.PRNGKey(3))
    for b in range(2):
        h = _mix_py(int(seeds[b]), int(roots[b]))
        toks = np.asarray(tree.tokens_bt[b])
        for i in range(1, 5):
            q_ref = np.asarray(target_probs(jnp.asarray(_logp_of_hash_py(h)), 0.8, 0.7))
            np.testing.assert_allclose(np.asarray(q_btv[b, i]), q_ref, atol=1e-6)
            assert q_ref[toks[i]] > 0
            h = _mix_py(h, int(toks[i]))
    np.testing.assert_array_equal(np.asarray(tree.parents_bt[0]), [-1, 0, 1, 2, 3])


def test_d2t_maps_draft_ids_to_target_ids():
    d2t = jnp.array([10, 20, 30, 40, 50, 60, 70], jnp.int32)
    s = tr.static_structure([(0,), (1,)])
    roots = jnp.array([2], jnp.int32)
    seed = jnp.array([[7]], jnp.uint32)
    t1, _ = jax.jit(lambda st, r: tr.draft_static_tree(expand_via_parent_slot, st, r, s))(
        seed, roots)
    # the draft sees target ids; map them back to draft ids before hashing the path
    t2, _ = jax.jit(lambda st, r: tr.draft_static_tree(
        lambda st_, fr: expand_via_parent_slot(st_, fr._replace(tokens_bk=jnp.where(
            fr.tokens_bk >= 10, fr.tokens_bk // 10 - 1, fr.tokens_bk))), st, r, s,
        d2t_v=d2t))(seed, roots)
    np.testing.assert_array_equal(np.asarray(t2.tokens_bt[0, 1:]),
                                  (np.asarray(t1.tokens_bt[0, 1:]) + 1) * 10)


# ---------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree


def _brute_dynamic(root, seed, depth, top_k, n_nodes):
    """Python EAGLE-2: frontier top_k by cumulative log-prob, then global top n_nodes-1."""
    pool = []  # (cum, tokens_path, hash)
    frontier = [(0.0, (root,), _mix_py(seed, root))]
    for d in range(depth):
        cands = []
        for cum, toks, h in frontier:
            lp = _logp_of_hash_py(h)
            for tok in np.argsort(-lp, kind="stable")[:top_k]:
                tok = int(tok)
                cands.append((cum + float(lp[tok]), toks + (tok,), _mix_py(h, tok)))
        pool.extend(cands)
        order = sorted(range(len(cands)), key=lambda j: -cands[j][0])  # stable: ties to lower
        frontier = [cands[j] for j in order[:top_k]]
    keep = sorted(sorted(range(len(pool)), key=lambda j: -pool[j][0])[:n_nodes - 1])
    return [(root,)] + [pool[j][1] for j in keep], [0.0] + [pool[j][0] for j in keep]


@pytest.mark.parametrize("depth,top_k,n_nodes", [(4, 3, 12), (3, 4, 26), (1, 5, 4)])
def test_dynamic_tree_matches_brute_force(depth, top_k, n_nodes):
    roots = jnp.array([2, 5], jnp.int32)
    seeds = jnp.array([100, 200], jnp.uint32)
    run = jax.jit(lambda st, r: tr.draft_dynamic_tree(
        expand_via_parent_slot, st, r, depth=depth, top_k=top_k, n_nodes=n_nodes))
    tree, cum, _ = run(seeds[:, None], roots)
    for b in range(2):
        paths_ref, cum_ref = _brute_dynamic(int(roots[b]), int(seeds[b]), depth, top_k, n_nodes)
        got = [_path_tokens(tree, b, i) for i in range(n_nodes)]
        assert got == paths_ref
        np.testing.assert_allclose(np.asarray(cum[b]), cum_ref, rtol=1e-5, atol=1e-5)
        par = np.asarray(tree.parents_bt[b])
        assert all(par[i] < i for i in range(1, n_nodes))
        # siblings in draft order: decreasing draft log-prob under the same parent
        lp = np.asarray(cum[b]) - np.where(par >= 0, np.asarray(cum[b])[np.maximum(par, 0)], 0)
        for p in set(par[1:]):
            sib = np.nonzero(par == p)[0]
            assert np.all(np.diff(lp[sib]) <= 1e-6)
    assert bool(jnp.all(tree.valid_bt))


def test_dynamic_tree_agrees_across_expand_styles():
    roots = jnp.array([2, 5], jnp.int32)
    seeds = jnp.array([100, 200], jnp.uint32)
    kw = dict(depth=4, top_k=3, n_nodes=14)
    t1, _, _ = jax.jit(lambda st, r: tr.draft_dynamic_tree(expand_via_parent_slot, st, r, **kw))(
        seeds[:, None], roots)
    t2, _, _ = jax.jit(lambda st, r: tr.draft_dynamic_tree(expand_via_ancestor_mask, st, r,
                                                           **kw))((seeds, None), roots)
    for a, b in zip(t1, t2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tie_expand(state, fr):
    """Heavily tied log-probs, including exact 0 (a certain token) and -inf (impossible ones)."""
    h = _mix(jnp.take_along_axis(state, fr.parent_slot_bk, 1), fr.tokens_bk)
    kind = h % jnp.uint32(3)
    r = (_hash32(h[..., None] * jnp.uint32(V) + jnp.arange(V, dtype=jnp.uint32)) >> 31).astype(
        jnp.float32)  # 0/1 logits: many exact ties
    certain = jnp.where(jnp.arange(V) == (h % jnp.uint32(V))[..., None], 0.0, -jnp.inf)
    logits = jnp.where(kind[..., None] == 0, certain, jnp.where(kind[..., None] == 1, r, 0.0))
    return jax.nn.log_softmax(logits, axis=-1), h


def test_dynamic_tree_always_keeps_ancestors_under_ties():
    """Cumulative log-prob ties (logp = 0 children, uniform rows) must never drop a parent."""
    n_rows = 64
    roots = jnp.arange(n_rows, dtype=jnp.int32) % V
    seeds = jnp.arange(n_rows, dtype=jnp.uint32)[:, None]
    tree, cum, _ = jax.jit(lambda s, r: tr.draft_dynamic_tree(
        _tie_expand, s, r, depth=5, top_k=3, n_nodes=20))(seeds, roots)
    cum, par = np.asarray(cum), np.asarray(tree.parents_bt)
    assert np.all(par[:, 1:] >= 0), "a kept node lost its parent"
    finite = np.isfinite(cum)
    np.testing.assert_array_equal(np.asarray(tree.valid_bt), finite)
    rows = np.arange(n_rows)[:, None]
    assert np.all(cum[:, 1:] <= cum[rows, par[:, 1:]])
    # the setup really produced ties between a kept child and its parent, and -inf nodes
    assert np.any(cum[:, 1:] == cum[rows, par[:, 1:]]) and np.any(~finite)


def test_dynamic_tree_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_nodes"):
        tr.draft_dynamic_tree(expand_via_parent_slot, jnp.zeros((1, 1), jnp.uint32),
                              jnp.zeros((1,), jnp.int32), depth=2, top_k=2, n_nodes=8)


def test_sampled_chain_scatters_q_into_the_target_vocab():
    d2t = jnp.array([10, 20, 30, 40, 50, 60, 70], jnp.int32)
    tree, q_btv, _ = jax.jit(lambda st, r, key: tr.draft_sampled_chain(
        expand_via_parent_slot, st, r, 3, key, 1.0, 1.0, d2t_v=d2t, target_vocab=80))(
        jnp.array([[7]], jnp.uint32), jnp.array([2], jnp.int32), jax.random.PRNGKey(0))
    q = np.asarray(q_btv[0, 1:])
    np.testing.assert_allclose(q[:, np.asarray(d2t)].sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.delete(q, np.asarray(d2t), axis=-1) == 0)
    toks = np.asarray(tree.tokens_bt[0, 1:])
    assert np.all(q[np.arange(3), toks] > 0)


def test_static_tree_is_build_tree_computed_at_trace_time():
    """Static shapes: the tree equals build_tree's, and the traced program holds no tree building
    (only broadcasts of constants), so iterations do not rebuild it."""
    import numpy as np

    from confu_jax.decode import tree as tr

    for structure in (tr.chain_structure(4), tr.static_structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])):
        t = structure.n_nodes
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, size=(3, t)), jnp.int32)
        got = tr.static_tree(tokens, structure)
        want = tr.build_tree(tokens, jnp.broadcast_to(jnp.asarray(structure.parents_t), (3, t)), structure.max_depth)
        for a, b, name in zip(got, want, tr.DraftTree._fields):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        prims = {e.primitive.name for e in jax.make_jaxpr(lambda x: tr.static_tree(x, structure))(tokens).jaxpr.eqns}
        assert prims <= {"broadcast_in_dim", "convert_element_type"}, prims
