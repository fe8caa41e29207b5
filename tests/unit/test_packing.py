"""Packed training rows (several conversations per row, docs/DESIGN.md §4 "Training objective"):
the same conversations packed or padded one per row give the same per-conversation loss and
gradients, and the batch loss is layout-independent; the attention's segment lower bound equals
the reference; the grain packer keeps every conversation intact."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.kernels.attention_reference import AttendTo, masked_attention_reference
from confu_jax.kernels.blockwise_attention import masked_attention_blockwise
from confu_jax.models.vocab_map import draft_vocab_from_d2t
from confu_jax.train import loss as L
from confu_jax.train import rows as R
from tests.helpers.model_fakes import DRAFT_VOCAB, tiny_params, tiny_spec

LENGTHS = (9, 13, 7, 11)  # conversations; packed as rows [9 + 13, 7 + 11] of N_PACK
N_PAD, N_PACK = 16, 24
# EAGLE-3: the default objective. ConFu: every candidate an anchor (deterministic, independent of the
# row layout) with a window and a fixed lag of 3, so lag clipping at a segment start is exercised.
CFG_E = L.ObjectiveConfig(ttt_steps=3, vocab_chunk=48)
CFG_C = L.ObjectiveConfig(ttt_steps=3, k_train=L.ALL_POSITIONS, replication=2, max_lag=3,
                          lag_weights=(0.0, 0.0, 1.0), vocab_chunk=48)


def _conversations(v, seed=3):
    """(tokens, loss_mask) per conversation: a prompt then an answer (position 0 never predicted)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        toks = rng.integers(2, v, n).astype(np.int32)
        mask = np.zeros(n, bool)
        mask[rng.integers(1, 4):] = True
        mask[0] = False
        out.append((toks, mask))
    return out


def _padded(convs, keep=None):
    """One conversation per row, right padded; ``keep``: only that conversation's loss mask."""
    tok = np.zeros((len(convs), N_PAD), np.int32)
    lm = np.zeros((len(convs), N_PAD), bool)
    att = np.zeros((len(convs), N_PAD), bool)
    for i, (t, m) in enumerate(convs):
        tok[i, :len(t)], att[i, :len(t)] = t, True
        lm[i, :len(t)] = m if keep in (None, i) else False
    return {"tokens": jnp.asarray(tok), "loss_mask": jnp.asarray(lm), "attention_mask": jnp.asarray(att)}


def _packed(convs, keep=None):
    """Conversations (0, 1) in row 0 and (2, 3) in row 1, with segment ids and positions."""
    tok = np.zeros((2, N_PACK), np.int32)
    lm = np.zeros((2, N_PACK), bool)
    seg = np.zeros((2, N_PACK), np.int32)
    pos = np.zeros((2, N_PACK), np.int32)
    for row, members in enumerate(((0, 1), (2, 3))):
        at = 0
        for s, i in enumerate(members):
            t, m = convs[i]
            sl = slice(at, at + len(t))
            tok[row, sl], seg[row, sl], pos[row, sl] = t, s + 1, np.arange(len(t))
            lm[row, sl] = m if keep in (None, i) else False
            at += len(t)
    return {"tokens": jnp.asarray(tok), "loss_mask": jnp.asarray(lm), "attention_mask": jnp.asarray(seg > 0),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


@functools.lru_cache(maxsize=None)
def _setup(variant):
    spec = tiny_spec(variant)
    tp, tr = tiny_params(spec, seed=7)
    v = spec.target.vocab_size
    d2t = np.sort(np.random.default_rng(0).choice(v, DRAFT_VOCAB, replace=False))
    dv = draft_vocab_from_d2t(d2t, v)
    cfg = CFG_C if spec.head.has_future else CFG_E

    def f(trainable, batch):
        return L.confu_loss(spec, trainable, tp, dv, batch, jax.random.PRNGKey(0), cfg)

    return tr, _conversations(v), jax.jit(jax.value_and_grad(f, has_aux=True))


def _assert_same(a, b, what):
    (la, ma), ga = a
    (lb, mb), gb = b
    assert float(mb["positions/step0"]) > 0, f"{what}: nothing trained, the comparison would be vacuous"
    for r in range(3):
        assert float(ma[f"positions/step{r}"]) == float(mb[f"positions/step{r}"]), (what, r)
    np.testing.assert_allclose(float(la), float(lb), rtol=2e-5, atol=1e-6, err_msg=what)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree_util.tree_leaves(gb)):
        scale = float(jnp.max(jnp.abs(x))) + 1e-6
        np.testing.assert_allclose(np.asarray(y) / scale, np.asarray(x) / scale, atol=1e-4,
                                   err_msg=f"{what}: gradient {jax.tree_util.keystr(path)}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "confu"])
def test_packed_equals_padded_per_conversation(variant):
    """Each conversation's loss (the others' loss masks cleared) and its gradient w.r.t. every
    trainable parameter are the same packed as padded; so is the whole batch's."""
    tr, convs, vg = _setup(variant)
    _assert_same(vg(tr, _padded(convs)), vg(tr, _packed(convs)), f"{variant} batch")
    for i in range(len(convs)):
        _assert_same(vg(tr, _padded(convs, keep=i)), vg(tr, _packed(convs, keep=i)),
                     f"{variant} conversation {i}")


def test_packed_rows_do_not_leak_across_segments():
    """Changing the tokens of conversation 0 leaves conversation 1's loss and gradient (same row)
    unchanged: no attention, window, lag or TTT lookahead crosses the boundary."""
    tr, convs, vg = _setup("confu")
    other = list(convs)
    t0, m0 = convs[0]
    other[0] = ((t0 + 5) % 90 + 2, m0)
    _assert_same(vg(tr, _packed(convs, keep=1)), vg(tr, _packed(other, keep=1)), "conversation 1")


def test_row_layout_defaults():
    """Positions default to index − segment start; segment starts follow the segment ids."""
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    rows = R.row_layout({"tokens": jnp.zeros_like(seg), "segment_ids": seg})
    np.testing.assert_array_equal(rows.segment_start_bn, [[0, 0, 0, 3, 3, 5, 6, 6]])
    np.testing.assert_array_equal(rows.positions_bn, [[0, 1, 2, 0, 1, 0, 0, 1]])
    assert R.row_layout({"tokens": seg}) == R.RowLayout()
    with pytest.raises(ValueError, match="segment_ids"):
        R.row_layout({"tokens": seg, "positions": seg})


@pytest.mark.slow
def test_cache_start_blockwise_equals_reference():
    """The cache's lower bound (a contemplate sees its own segment's slots only) in the blockwise
    attention equals the reference, chunked or not, and equals attending a cache cut at that start."""
    rng = np.random.default_rng(0)
    b, t, s, hq, hkv, d = 2, 5, 12, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    kb = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    vb = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    lens = jnp.asarray(rng.integers(4, s + 1, (b, t)), jnp.int32)
    start = jnp.minimum(jnp.asarray(rng.integers(0, 6, (b, t)), jnp.int32), lens - 1)
    ref = masked_attention_reference(q, kb, vb, AttendTo(mask=eye, k_cache=kc, v_cache=vc, cache_len=lens, cache_start=start))
    for chunk in (512, 2):
        got = masked_attention_blockwise(q, kb, vb, AttendTo(mask=eye, k_cache=kc, v_cache=vc, cache_len=lens,
                                                             cache_start=start), q_chunk=chunk)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # query (0, 0) alone: the same as a cache holding only slots start..len-1
    st, ln = int(start[0, 0]), int(lens[0, 0])
    cut = masked_attention_reference(q[:1, :1], kb[:1, :1], vb[:1, :1],
                                     AttendTo(mask=eye[:1, :1, :1], k_cache=kc[:1, :, st:ln], v_cache=vc[:1, :, st:ln],
                                              cache_len=jnp.asarray([ln - st])))
    np.testing.assert_allclose(ref[:1, :1], cut, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the grain packer


@pytest.mark.parametrize("pack_length", [0, 64])
def test_pipeline_packs_every_conversation_intact(pack_length):
    """One epoch of packed rows holds each usable conversation exactly once, unchanged, as one
    segment (positions from 0, attention mask = segment > 0), and the iterator state restores.
    ``data.pack_length``: rows of that length, each conversation still truncated to max_length, and fewer
    rows for the same conversations; a row shorter than max_length is refused."""
    from confu_jax.data import pipeline
    from tests.helpers.fake_chat import FakeChatTokenizer
    from tests.helpers.pipeline_fixtures import MAX_LEN, conversations as _conversations, data_cfg as _cfg

    tok = FakeChatTokenizer()
    convs = _conversations()
    want = sorted(tuple(r["tokens"].tolist()) + tuple(r["loss_mask"].tolist())
                  for r in (pipeline.encode_example(c["messages"], tok, MAX_LEN, pad=False) for c in convs)
                  if r is not None)
    cfg = _cfg(pack=True, pack_bins=3, shuffle=False, num_epochs=1, global_batch_size=1,  # no remainder dropped
               pack_length=pack_length)
    rows, got = 0, []
    for batch in pipeline.make_train_iterator(cfg, tok, conversations=convs):
        assert set(batch) == set(pipeline.PACKED_KEYS) | {"record_index"}
        assert batch["tokens"].shape[1] == (pack_length or MAX_LEN)
        for b in range(batch["tokens"].shape[0]):
            seg, pos = batch["segment_ids"][b], batch["positions"][b]
            np.testing.assert_array_equal(batch["attention_mask"][b], seg > 0)
            ids = batch["record_index"][b]  # each segment is one record, named on every one of its tokens
            assert (ids[seg == 0] == -1).all()
            assert not batch["loss_mask"][b][seg == 0].any()
            for s in range(1, seg.max() + 1):
                where = np.nonzero(seg == s)[0]
                assert (np.diff(where) == 1).all(), "a conversation is split"
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                got.append(tuple(batch["tokens"][b][where].tolist()) + tuple(batch["loss_mask"][b][where].tolist()))
                assert len(set(ids[where].tolist())) == 1 and ids[where][0] >= 0
                ref = pipeline.encode_example(convs[ids[where][0]]["messages"], tok, MAX_LEN, pad=False)
                np.testing.assert_array_equal(ref["tokens"], batch["tokens"][b][where])
            rows += 1
    assert sorted(got) == want
    assert rows < len(want), "packing put no two conversations in one row"
    if pack_length:
        one_length = sum(1 for _ in pipeline.make_train_iterator(_cfg(pack=True, pack_bins=3, shuffle=False,
                                                                       num_epochs=1, global_batch_size=1), tok,
                                                                  conversations=convs))
        assert rows < one_length, (rows, one_length)
        with pytest.raises(ValueError, match="pack_length=16: expected 0"):
            pipeline.make_train_iterator(_cfg(pack=True, pack_length=16), tok, conversations=convs)

    it = pipeline.make_train_iterator(_cfg(pack=True, seed=1), tok, conversations=convs)
    next(it)
    state = it.get_state()
    expect = [next(it) for _ in range(3)]
    it2 = pipeline.make_train_iterator(_cfg(pack=True, seed=1), tok, conversations=convs)
    it2.set_state(state)
    for e in expect:
        g = next(it2)
        for k in pipeline.PACKED_KEYS:
            np.testing.assert_array_equal(g[k], e[k])
