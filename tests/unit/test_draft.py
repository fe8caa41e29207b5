"""Draft head: TTT vs incremental decoding, the future entry, a Hugging Face reference, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.kv_cache import commit, to_cache_layout
from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.draft import DraftFuture, DraftHead, draft_features, draft_future_entry
from confu_jax.models.draft_decode import draft_block, init_draft_cache
from confu_jax.models.draft_ttt import TTTFuture, draft_ttt
from confu_jax.models.vocab_map import draft_to_target_ids, draft_vocab_from_d2t, identity_draft_vocab, target_to_draft_logits
from confu_jax.models.target import contemplate_queries, real_forward
from tests.helpers.model_fakes import DRAFT_VOCAB, tiny_params, tiny_spec

ATOL = 2e-5
_ttt = jax.jit(draft_ttt, static_argnums=(0, 5))
_block = jax.jit(draft_block, static_argnums=0)
_future = jax.jit(draft_future_entry, static_argnums=0)
_features = jax.jit(draft_features, static_argnums=0)


def _close(a, b, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def _setup(variant, b=2, n=10, seed=3):
    spec = tiny_spec(variant)
    tp, tr = tiny_params(spec, seed=seed)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(2, spec.target.vocab_size, (b, n)), jnp.int32)
    h_cat = jnp.asarray(rng.normal(size=(b, n, 3 * spec.d_model)), jnp.float32)
    future = None
    if spec.head.has_future:
        anchors = np.array([[1, 5], [2, 6]], np.int32)[:b]
        index = np.full((b, n), -1, np.int32)
        for r in range(b):
            for k, t in enumerate(anchors[r]):
                index[r, t:t + 3] = k  # replication window l = 2
        f = jnp.asarray(rng.normal(size=(b, 2, spec.d_model)), jnp.float32)
        future = TTTFuture(f, jnp.asarray(anchors), jnp.asarray(index))
    return spec, tp, tr["draft"], tokens, h_cat, future


def _shifted(tokens, s=1):
    """Draft input tokens x[j+s] (0 past the end), as TTT reads them."""
    return jnp.concatenate([tokens[:, s:], jnp.zeros((tokens.shape[0], s), tokens.dtype)], axis=1)


def _row_future(spec, dp, g, future, j_b):
    """The single future entry row b uses when drafting from index j_b, and whether it exists."""
    b = g.shape[0]
    rows = jnp.arange(b)
    k_b = future.index_bn[rows, j_b]
    fe = _future(spec, dp, future.f_bkd, g[rows[:, None], future.anchor_bk], future.anchor_bk)
    sel = jnp.maximum(k_b, 0)
    return DraftFuture(fe.k_bnhd[rows, sel][:, None], fe.v_bnhd[rows, sel][:, None]), k_b >= 0


def _extend(spec, dp, embed, tokens, g, j_b, fut, vis):
    """Step-0 block over the whole sequence (causal) + commit of entries 0..j_b to a draft cache."""
    b, n = tokens.shape
    cache = init_draft_cache(spec, b, n + 8)
    kw = {} if fut is None else dict(future=fut, future_visible_bt=jnp.broadcast_to(vis[:, None], (b, n)))
    out = _block(spec, dp, embed, _shifted(tokens), g, jnp.broadcast_to(jnp.arange(n), (b, n)), cache=cache, **kw)
    cache = commit(cache, out.k_new_bthd[None], out.v_new_bthd[None], j_b + 1)
    return out, cache, kw


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["confu", "eagle3"])
def test_incremental_chain_equals_ttt(variant):
    spec, tp, dp, tokens, h_cat, future = _setup(variant)
    embed = tp["embed"]["embedding"]
    b, n = tokens.shape
    steps = 4
    ttt = _ttt(spec, dp, embed, tokens, h_cat, steps, future=future)
    g = _features(spec, dp, h_cat)
    rows = jnp.arange(b)
    # rows draft from an index inside an anchor's window, then from one outside every window
    for j_b in (jnp.asarray([6, 2]), jnp.asarray([4, 5])):
        fut = vis = None
        if future is not None:
            fut, vis = _row_future(spec, dp, g, future, j_b)
        out, cache, kw = _extend(spec, dp, embed, tokens, g, j_b, fut, vis)
        _close(out.logits_btv[rows, j_b], ttt.logits_rbnv[0, rows, j_b])
        _close(out.h_out_btd[rows, j_b], ttt.h_out_rbnd[0, rows, j_b])
        if kw:
            kw["future_visible_bt"] = vis[:, None]
        scratch_k = jnp.zeros((b, steps) + out.k_new_bthd.shape[2:])
        scratch_v = jnp.zeros_like(scratch_k)
        hidden = out.h_out_btd[rows, j_b][:, None]
        tok_pad = jnp.concatenate([tokens, jnp.zeros((b, steps + 1), tokens.dtype)], 1)
        for s in range(1, steps):
            smask = jnp.broadcast_to(jnp.arange(steps) < s - 1, (b, 1, steps))
            o = _block(spec, dp, embed, tok_pad[rows, j_b + 1 + s][:, None], hidden, (j_b + s)[:, None],
                       cache=cache, scratch_k_bmhd=scratch_k, scratch_v_bmhd=scratch_v, scratch_mask_btm=smask, **kw)
            _close(o.logits_btv[:, 0], ttt.logits_rbnv[s, rows, j_b])
            _close(o.hidden_btd[:, 0], ttt.hidden_rbnd[s, rows, j_b])
            scratch_k = scratch_k.at[:, s - 1].set(o.k_new_bthd[:, 0])
            scratch_v = scratch_v.at[:, s - 1].set(o.v_new_bthd[:, 0])
            hidden = o.h_out_btd


@pytest.mark.slow
def test_tree_levels_equal_ttt_along_each_path():
    spec, tp, dp, tokens, h_cat, future = _setup("confu")
    embed = tp["embed"]["embedding"]
    b, n = tokens.shape
    rows = jnp.arange(b)
    j_b = jnp.asarray([5, 3])
    g = _features(spec, dp, h_cat)
    fut, vis = _row_future(spec, dp, g, future, j_b)
    out, cache, _ = _extend(spec, dp, embed, tokens, g, j_b, fut, vis)
    rng = np.random.default_rng(0)
    lvl1 = jnp.asarray(rng.integers(2, spec.target.vocab_size, (b, 3)), jnp.int32)
    lvl2 = jnp.asarray(rng.integers(2, spec.target.vocab_size, (b, 2)), jnp.int32)
    parent2 = np.array([0, 2])  # level-2 node i is a child of level-1 node parent2[i]
    fkw = dict(future=fut, future_visible_bt=None)
    o1 = _block(spec, dp, embed, lvl1, jnp.repeat(out.h_out_btd[rows, j_b][:, None], 3, 1),
                jnp.broadcast_to((j_b + 1)[:, None], (b, 3)), cache=cache,
                block_mask_btt=jnp.broadcast_to(jnp.eye(3, dtype=bool), (b, 3, 3)), **fkw)
    smask = jnp.broadcast_to(jnp.eye(3, dtype=bool)[parent2], (b, 2, 3))
    o2 = _block(spec, dp, embed, lvl2, o1.h_out_btd[:, parent2], jnp.broadcast_to((j_b + 2)[:, None], (b, 2)),
                cache=cache, block_mask_btt=jnp.broadcast_to(jnp.eye(2, dtype=bool), (b, 2, 2)),
                scratch_k_bmhd=o1.k_new_bthd, scratch_v_bmhd=o1.v_new_bthd, scratch_mask_btm=smask, **fkw)

    # reference: TTT over sequences whose continuation after x[j+1] is each root-to-leaf path
    paths = [(0, 0), (1, None), (2, 1)]  # (level-1 node, level-2 node)
    seqs = []
    for a, c in paths:
        x = np.array(tokens)
        x[np.arange(b), np.asarray(j_b) + 2] = np.asarray(lvl1[:, a])
        if c is not None:
            x[np.arange(b), np.asarray(j_b) + 3] = np.asarray(lvl2[:, c])
        seqs.append(x)
    p = len(paths)
    tile = lambda a: jnp.concatenate([a] * p, 0)  # noqa: E731  (path-major batch)
    fut_p = TTTFuture(tile(future.f_bkd), tile(future.anchor_bk), tile(future.index_bn))
    ttt = _ttt(spec, dp, embed, jnp.asarray(np.concatenate(seqs, 0)), tile(h_cat), 3, future=fut_p)
    for i, (a, c) in enumerate(paths):
        r = i * b + np.arange(b)
        _close(o1.logits_btv[:, a], ttt.logits_rbnv[1, r, np.asarray(j_b)])
        if c is not None:
            _close(o2.logits_btv[:, c], ttt.logits_rbnv[2, r, np.asarray(j_b)])


def test_future_acts_only_through_its_entry():
    spec, tp, dp, tokens, h_cat, future = _setup("confu")
    e_spec = tiny_spec("eagle3")
    embed = tp["embed"]["embedding"]
    b, n = tokens.shape
    g = _features(spec, dp, h_cat)
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    fut, _ = _row_future(spec, dp, g, future, jnp.asarray([6, 2]))
    args = (embed, _shifted(tokens), g, pos)
    hidden = _block(spec, dp, *args, future=fut, future_visible_bt=jnp.zeros((b, n), bool))
    seen = _block(spec, dp, *args, future=fut)
    plain = _block(e_spec, {k: v for k, v in dp.items() if k != "moe_f"}, *args)
    # invisible future == EAGLE-3 with the same weights: no other path from [f]/f into the draft
    for x, y in zip(hidden, plain):
        _close(x, y, atol=1e-6)
    # visible future moves every query's output but nothing that would be stored (K/V of inputs)
    assert float(jnp.abs(seen.logits_btv - plain.logits_btv).min(-1).max()) > 0
    assert float(jnp.abs(seen.logits_btv - plain.logits_btv).max(-1).min()) > 1e-4
    np.testing.assert_array_equal(np.asarray(seen.k_new_bthd), np.asarray(plain.k_new_bthd))
    np.testing.assert_array_equal(np.asarray(seen.v_new_bthd), np.asarray(plain.v_new_bthd))


def _torch_reference(spec, dp, emb, hid, pos, mask):
    """EAGLE-3 layer from Hugging Face Llama modules (q/k/v widened to 2d as in EAGLE-3 cnets.py)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig as HFConfig
    from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)

    t = spec.target
    d = t.d_model
    cfg = HFConfig(hidden_size=d, num_attention_heads=t.n_heads, num_key_value_heads=t.n_kv_heads,
                   head_dim=t.head_dim, intermediate_size=spec.draft_ffn_dim, rope_theta=t.rope_theta,
                   rms_norm_eps=t.rms_eps, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "eager"
    T = lambda a: torch.tensor(np.asarray(a, np.float32))  # noqa: E731
    lin = lambda k: torch.nn.Parameter(T(dp[k]["kernel"]).T.contiguous())  # noqa: E731
    attn = LlamaAttention(cfg, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * d, dp[name]["kernel"].shape[1], bias=False))
        getattr(attn, name).weight = lin(name)
    attn.o_proj.weight = lin("o_proj")
    mlp = LlamaMLP(cfg)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight = lin(name)
    norms = {}
    for name in ("input_norm", "hidden_norm", "post_attn_norm", "final_norm"):
        norms[name] = LlamaRMSNorm(d, eps=t.rms_eps)
        norms[name].weight = torch.nn.Parameter(T(dp[name]["scale"]))
    rope = LlamaRotaryEmbedding(cfg)
    with torch.no_grad():
        e, h = T(emb)[None], T(hid)[None]
        x = torch.cat([norms["input_norm"](e), norms["hidden_norm"](h)], -1)
        cos_sin = rope(x, torch.tensor(np.asarray(pos))[None])
        add_mask = torch.where(torch.tensor(np.asarray(mask)), 0.0, torch.finfo(torch.float32).min)[None, None]
        a, _ = attn(x, position_embeddings=cos_sin, attention_mask=add_mask)
        h = h + a
        h = h + mlp(norms["post_attn_norm"](h))
        return (norms["final_norm"](h) @ lin("lm_head").T)[0].numpy()


def test_draft_layer_and_future_token_match_huggingface_modules():
    """The future entry behaves exactly like one extra draft input appended at position p+1."""
    spec, tp, dp, tokens, h_cat, future = _setup("confu", b=1)
    embed = tp["embed"]["embedding"]
    n = tokens.shape[1]
    g = _features(spec, dp, h_cat)
    p = int(future.anchor_bk[0, 1])
    fut, _ = _row_future(spec, dp, g, future, jnp.asarray([p]))
    out = _block(spec, dp, embed, _shifted(tokens), g, jnp.arange(n)[None], future=fut)

    f_tok = DraftHead(spec).apply({"params": dp}, g[:, p], method=DraftHead.future_token)  # [f] = MoE_f(g[p])
    emb = np.concatenate([np.asarray(embed)[np.asarray(_shifted(tokens))[0]], np.asarray(f_tok)], 0)
    hid = np.concatenate([np.asarray(g[0]), np.asarray(future.f_bkd[0, 1])[None]], 0)
    pos = np.concatenate([np.arange(n), [p + 1]])
    mask = np.tril(np.ones((n + 1, n + 1), bool))
    mask[:, n] = True  # every query sees the future entry
    ref = _torch_reference(spec, dp, emb, hid, pos, mask)
    _close(out.logits_btv[0], ref[:n], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["confu", "eagle3"])
def test_gradients_reach_every_trainable_leaf_and_never_the_target(variant):
    spec = tiny_spec(variant)
    tp, tr = tiny_params(spec, seed=5)
    rng = np.random.default_rng(5)
    b, n = 2, 10
    tokens = jnp.asarray(rng.integers(2, spec.target.vocab_size, (b, n)), jnp.int32)
    vocab = identity_draft_vocab(spec.target.vocab_size, DRAFT_VOCAB)
    anchors = jnp.asarray([[2, 6], [1, 5]], jnp.int32)
    index = jnp.asarray(np.where(np.arange(n) < 5, 0, 1)[None].repeat(b, 0), jnp.int32)

    def loss(tp_, tr_):
        real = real_forward(spec, tp_, tokens)
        fut = None
        if spec.head.has_future:
            src = real.taps_btc[jnp.arange(b)[:, None], anchors - 1]
            f = contemplate_queries(spec, tp_, tr_["confu"], to_cache_layout(real.k_new_lbthd),
                                     to_cache_layout(real.v_new_lbthd), anchors, src)
            fut = TTTFuture(f, anchors, index)
        out = draft_ttt(spec, tr_["draft"], tp_["embed"]["embedding"], tokens, real.taps_btc, 3, future=fut)
        p_t = jax.nn.softmax(target_to_draft_logits(vocab, real.logits_btv), -1)
        return -jnp.sum(p_t[None] * jax.nn.log_softmax(out.logits_rbnv, -1))

    g_tp, g_tr = jax.jit(jax.grad(loss, argnums=(0, 1)))(tp, tr)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree_util.tree_leaves(g_tp))
    flat = jax.tree_util.tree_flatten_with_path(g_tr)[0]
    assert len(flat) == len(jax.tree_util.tree_leaves(tr))
    for path, x in flat:
        assert float(jnp.abs(x).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    names = {jax.tree_util.keystr(p) for p, _ in flat}
    if variant == "confu":
        for must in ("soft_prompt_k_lphd", "soft_prompt_v_lphd", "moe_con", "moe_f", "'fc'", "q_proj"):
            assert any(must in s for s in names), must
    else:
        assert not any("moe" in s or "soft" in s for s in names)


def test_draft_vocab_maps():
    v = draft_vocab_from_d2t(np.array([3, 7, 1, 9]), 12)
    np.testing.assert_array_equal(np.asarray(v["t2d"]).nonzero()[0], [1, 3, 7, 9])
    np.testing.assert_array_equal(np.asarray(draft_to_target_ids(v, jnp.asarray([2, 0]))), [1, 3])
    logits = jnp.arange(12.0)[None]
    np.testing.assert_array_equal(np.asarray(target_to_draft_logits(v, logits)), [[3, 7, 1, 9]])
    ident = identity_draft_vocab(12, 5)
    np.testing.assert_array_equal(np.asarray(ident["d2t"]), np.arange(5))
    with pytest.raises(ValueError, match="same target id"):
        draft_vocab_from_d2t(np.array([1, 1]), 12)
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        draft_vocab_from_d2t(np.array([1, 12]), 12)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [False, True])
def test_chunked_draft_attention_equals_one_dense_pass(extra):
    """Query chunks under lax.map (remat in the backward pass) give the dense pass's output and
    gradients: a length that is not a multiple of the chunk, a query that sees nothing, GQA."""
    from confu_jax.models.draft_attention import draft_attention

    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, x = 2, 11, 4, 2, 8, 3
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    seg = jnp.asarray([[0] * 5 + [1] * 6, [0] * 11])
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    mask = mask.at[1, 4].set(False)  # row 1, query 4 sees no shared key
    args = (q, k, v, mask)
    if extra:
        kx = jnp.asarray(rng.normal(size=(b, t, x, hkv, d)), jnp.float32)
        vx = jnp.asarray(rng.normal(size=(b, t, x, hkv, d)), jnp.float32)
        mx = jnp.asarray(rng.random((b, t, x)) < 0.6).at[1, 4].set(False)
        args = args + (kx, vx, mx)
    w = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)

    def loss(q, k, v, *rest, q_chunk):
        if extra:
            out = draft_attention(q, k, v, mask, rest[0], rest[1], args[6], q_chunk=q_chunk)
        else:
            out = draft_attention(q, k, v, mask, q_chunk=q_chunk)
        return jnp.sum(out * w), out

    diff = (0, 1, 2) + ((3, 4) if extra else ())
    inputs = args[:3] + ((args[4], args[5]) if extra else ())
    (l0, o0), g0 = jax.value_and_grad(lambda *a: loss(*a, q_chunk=0), argnums=diff, has_aux=True)(*inputs)
    (l1, o1), g1 = jax.value_and_grad(lambda *a: loss(*a, q_chunk=4), argnums=diff, has_aux=True)(*inputs)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o0), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(o0[1, 4]).max()) == float(jnp.abs(o1[1, 4]).max()) == 0.0  # sees nothing
    for a, c in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("q_chunk", [0, 4])
def test_draft_attention_bias_and_weights_equal_a_float64_softmax(q_chunk):
    """``bias_hx`` (ConFu's future-entry bias) adds a logit per query head to a per-query key, and
    ``extra_weights`` returns those keys' softmax weights: both equal a float64 softmax written out
    query by query, dense or in chunks; a bias b on a key of weight w gives it w e^b / (1 - w + w e^b)."""
    from confu_jax.models.draft_attention import draft_attention

    rng = np.random.default_rng(1)
    b, t, hq, hkv, d, x = 2, 7, 4, 2, 8, 3
    q, k, v = (rng.normal(size=(b, t, h, d)) for h in (hq, hkv, hkv))
    kx, vx = rng.normal(size=(2, b, t, x, hkv, d))
    mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t)).copy()
    mask[1, 3] = False  # a query that sees only its per-query keys
    mx = rng.random((b, t, x)) < 0.7
    mx[:, :, 0] = True
    bias = np.zeros((hq, x))
    bias[:, 0] = rng.normal(size=hq) * 2

    def reference(bias):
        out, w = np.zeros((b, t, hq, d)), np.zeros((b, t, hq, x))
        for bi in range(b):
            for ti in range(t):
                for h in range(hq):
                    kv = h // (hq // hkv)
                    s_sh = np.where(mask[bi, ti], k[bi, :, kv] @ q[bi, ti, h] / np.sqrt(d), -np.inf)
                    s_x = np.where(mx[bi, ti], kx[bi, ti, :, kv] @ q[bi, ti, h] / np.sqrt(d) + bias[h], -np.inf)
                    p = np.exp(np.concatenate([s_sh, s_x]) - np.max(np.concatenate([s_sh, s_x])))
                    p /= p.sum()
                    out[bi, ti, h] = p[:t] @ v[bi, :, kv] + p[t:] @ vx[bi, ti, :, kv]
                    w[bi, ti, h] = p[t:]
        return out, w

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    args = (f32(q), f32(k), f32(v), jnp.asarray(mask), f32(kx), f32(vx), jnp.asarray(mx))
    out0, w0 = draft_attention(*args, extra_weights=True, q_chunk=q_chunk)
    out_b, w_b = draft_attention(*args, bias_hx=f32(bias), extra_weights=True, q_chunk=q_chunk)
    for (out, w), (want_out, want_w) in (((out0, w0), reference(np.zeros_like(bias))), ((out_b, w_b), reference(bias))):
        np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5)
        np.testing.assert_allclose(np.asarray(w), want_w, atol=1e-6)
    w, e = np.asarray(w0, np.float64)[..., 0], np.exp(bias[:, 0])
    np.testing.assert_allclose(np.asarray(w_b)[..., 0], w * e / (1 - w + w * e), atol=1e-6)
    assert np.abs(np.asarray(w_b) - np.asarray(w0)).max() > 0.05  # the bias moved the weights
    np.testing.assert_allclose(np.asarray(draft_attention(*args, bias_hx=f32(bias), q_chunk=q_chunk)),
                               np.asarray(out_b), atol=0)


@pytest.mark.slow
def test_layer_remat_changes_neither_values_nor_gradients_nor_params():
    """``remat_layers`` (the contemplate pass's per-layer recompute) gives the plain scan's hidden
    states and gradients w.r.t. what training differentiates (input embeddings, soft-prompt K/V),
    with the same parameter tree."""
    from confu_jax.models.llama import Llama
    from confu_jax.models.unrolled import apply_target

    spec = tiny_spec("confu")
    target, trainable = tiny_params(spec)
    cfg = spec.target
    rng = np.random.default_rng(3)
    b, t, s = 2, 5, 9
    emb = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)
    pk = trainable["confu"]["soft_prompt_k_lphd"]
    pv = trainable["confu"]["soft_prompt_v_lphd"]
    ck = jnp.asarray(rng.normal(size=(cfg.n_layers, b, cfg.n_kv_heads, s, cfg.head_dim)), jnp.float32)
    cv = jnp.asarray(rng.normal(size=ck.shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)

    def f(emb, pk, pv, remat):
        out = apply_target(target, cfg, None, jnp.full((b, t), s, jnp.int32), embeds_btd=emb,
                           attend=AttendTo(mask=jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t)), k_cache=ck,
                                           v_cache=cv, cache_len=jnp.full((b, t), s - 2), k_prefix=pk, v_prefix=pv,
                                           prefix_visible=jnp.ones((b, t), bool)),
                           return_logits=False, remat_layers=remat)
        return jnp.sum(out.hidden_btd * w), out.hidden_btd

    (_, h0), g0 = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(emb, pk, pv, False)
    (_, h1), g1 = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(emb, pk, pv, True)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), rtol=1e-6, atol=1e-6)
    for a, c in zip(g1, g0):
        assert float(jnp.abs(c).max()) > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    tok = jnp.zeros((1, 3), jnp.int32)
    pos = jnp.arange(3)[None]
    shapes = [jax.tree.map(lambda x: x.shape, jax.eval_shape(
        lambda: Llama(cfg, remat_layers=r).init(jax.random.PRNGKey(0), tok, pos))) for r in (False, True)]
    assert shapes[0] == shapes[1]
