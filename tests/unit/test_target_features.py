"""Offline target features (docs/DESIGN.md §4 "Offline target features"): the stored teacher equals
the online one on the same batch, the EAGLE-3 loss and gradients from a store equal the online
ones, the byte formula is the shards' size, writing resumes, and a mismatched store is refused."""

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from confu_jax.data import target_features as tf
from confu_jax.data.draft_vocab import DraftVocab
from confu_jax.models.target import real_forward
from confu_jax.train import loss as L
from confu_jax.train import teacher as T
from confu_jax.train.target_features import write_rows
from tests.helpers.model_fakes import DRAFT_VOCAB, tiny_params, tiny_spec

N, ROWS = 16, 5
CFG = L.ObjectiveConfig(ttt_steps=3, vocab_chunk=48)


@functools.lru_cache(maxsize=None)
def _setup():
    spec = tiny_spec("eagle3")
    tp, tr = tiny_params(spec, seed=11)
    v = spec.target.vocab_size
    d2t = np.sort(np.random.default_rng(0).choice(v, DRAFT_VOCAB, replace=False)).astype(np.int32)
    t2d = np.zeros(v, bool)
    t2d[d2t] = True
    vocab = DraftVocab(d2t, t2d, np.zeros(DRAFT_VOCAB, np.int64))
    rng = np.random.default_rng(2)
    rows = []
    for i in range(ROWS):
        n = int(rng.integers(8, N + 1))
        tok = np.zeros(N, np.int32)
        tok[:n] = rng.integers(2, v, n)
        lm = np.zeros(N, bool)
        lm[3:n] = True
        rows.append({"tokens": tok, "loss_mask": lm, "attention_mask": np.arange(N) < n})
    return spec, tp, tr, vocab, rows


def _settings(spec, top_k, dtype):
    return tf.StoreSettings(target_fingerprint="test", source="random", max_length=N, top_k=top_k, dtype=dtype,
                            d_model=spec.target.d_model, taps=tuple(spec.taps),
                            draft_vocab_size=spec.head.draft_vocab_size, vocab_size=spec.target.vocab_size)


def _store(path, top_k=DRAFT_VOCAB, dtype="float32", rows_per_shard=2, n_rows=ROWS):
    spec, tp, _, vocab, rows = _setup()
    w = tf.FeatureWriter(str(path), _settings(spec, top_k, dtype), vocab, rows_per_shard)
    write_rows(w, spec, tp, vocab, rows[:n_rows], batch_size=2, vocab_chunk=48)
    return tf.FeatureStore(str(path))


def _batch(store):
    return {k: jnp.asarray(np.stack([store[i][k] for i in range(len(store))])) for k in store[0]}


def _online_batch(rows):
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in ("tokens", "loss_mask", "attention_mask")}


def _dv(vocab):
    return {"d2t": jnp.asarray(vocab.d2t), "t2d": jnp.asarray(vocab.t2d)}


@pytest.mark.slow
def test_offline_teacher_equals_online(tmp_path):
    """Full top-k in float32: the stored taps, teacher log-probs, argmax, in-draft mask and draft mass
    are the online ones at every real token of the same batch."""
    spec, tp, _, vocab, rows = _setup()
    batch = _batch(_store(tmp_path))
    online = _online_batch(rows)
    np.testing.assert_array_equal(batch["tokens"], online["tokens"])
    np.testing.assert_array_equal(batch["attention_mask"], online["attention_mask"])
    out = real_forward(spec, tp, online["tokens"], return_logits=False)
    want = T.teacher_from_hidden(spec, tp, _dv(vocab), out.hidden_btd, 48)
    got = T.teacher_from_offline(batch, _dv(vocab), DRAFT_VOCAB)
    real = np.asarray(online["attention_mask"])
    np.testing.assert_allclose(np.asarray(batch["h_cat"])[real], np.asarray(out.taps_btc)[real], rtol=1e-5, atol=2e-5)  # jit vs eager, batch 2 vs 5
    np.testing.assert_allclose(np.asarray(got.logp_bnv)[real], np.asarray(want.logp_bnv)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.argmax_bn)[real], np.asarray(want.argmax_bn)[real])
    np.testing.assert_array_equal(np.asarray(got.in_draft_bn)[real], np.asarray(want.in_draft_bn)[real])
    np.testing.assert_allclose(np.asarray(got.draft_mass_bn)[real], np.asarray(want.draft_mass_bn)[real], rtol=1e-5)


def test_topk_teacher_is_the_online_teacher_truncated(tmp_path):
    """k < V_draft: the offline teacher is the online one restricted to its top-k, renormalised."""
    spec, tp, _, vocab, rows = _setup()
    k = 8
    got = T.teacher_from_offline(_batch(_store(tmp_path, top_k=k)), _dv(vocab), DRAFT_VOCAB)
    out = real_forward(spec, tp, _online_batch(rows)["tokens"], return_logits=False)
    want = np.asarray(T.teacher_from_hidden(spec, tp, _dv(vocab), out.hidden_btd, 48).logp_bnv)
    real = np.asarray(_online_batch(rows)["attention_mask"])
    top = np.argsort(-want, axis=-1)[..., :k]
    trunc = np.full_like(want, -np.inf)
    np.put_along_axis(trunc, top, np.take_along_axis(want, top, -1), -1)
    trunc = trunc - np.log(np.exp(trunc).sum(-1, keepdims=True))
    p_got, p_want = np.exp(np.asarray(got.logp_bnv))[real], np.exp(trunc)[real]
    np.testing.assert_allclose(p_got, p_want, atol=1e-6)
    assert (np.count_nonzero(p_got, axis=-1) == k).all()


@functools.lru_cache(maxsize=None)
def _value_and_grad():
    spec, tp, _, vocab, _ = _setup()
    dv = _dv(vocab)
    return jax.value_and_grad(lambda tr, b: L.confu_loss(spec, tr, tp, dv, b, jax.random.PRNGKey(0), CFG),
                              has_aux=True)


@pytest.mark.slow
def test_eagle3_loss_from_offline_equals_online(tmp_path):
    """EAGLE-3's loss, metrics and gradients from stored features equal the online ones (float32,
    full top-k); a bf16 store stays within 1 % of them (the random tiny teacher is near uniform, so a
    top-k far below V_draft changes it by design: test_topk_teacher_is_the_online_teacher_truncated)."""
    _, _, tr, _, rows = _setup()
    vg = _value_and_grad()
    (l_on, m_on), g_on = vg(tr, _online_batch(rows))
    (l_off, m_off), g_off = vg(tr, _batch(_store(tmp_path / "f32")))
    assert float(m_on["positions/step0"]) > 0
    np.testing.assert_allclose(float(l_off), float(l_on), rtol=1e-5)
    for k in ("positions/step0", "acc/step0", "acceptance_length", "teacher/argmax_in_draft"):
        np.testing.assert_allclose(float(m_off[k]), float(m_on[k]), rtol=1e-5, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_on), jax.tree_util.tree_leaves(g_off)):
        scale = float(jnp.max(jnp.abs(a))) + 1e-8
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
    (l_bf, _), _ = vg(tr, _batch(_store(tmp_path / "bf16", dtype="bfloat16")))
    assert abs(float(l_bf) - float(l_on)) < 0.01 * float(l_on)


def test_bytes_per_token_is_the_shard_size(tmp_path):
    """The documented formula counts exactly the stored tensors (plus 8·(R+1) bytes of row offsets)."""
    spec = _setup()[0]
    for dtype, k in (("bfloat16", 16), ("float32", DRAFT_VOCAB)):
        store = _store(tmp_path / dtype, top_k=k, dtype=dtype)
        total, tokens, rows = 0, 0, 0
        for sh in store.shards:
            with safe_open(str(tmp_path / dtype / sh["file"]), "numpy") as f:
                total += sum(f.get_tensor(name).nbytes for name in f.keys())
            tokens, rows = tokens + sh["tokens"], rows + sh["rows"]
        per_tok = tf.bytes_per_token(spec.target.d_model, k, DRAFT_VOCAB, dtype)
        assert total == per_tok * tokens + 8 * (rows + len(store.shards))
    # the figures quoted in the docs
    assert tf.bytes_per_token(576, 64, 4096) == 3729 and tf.bytes_per_token(4096, 64, 32000) == 24849
    assert tf.kv_bytes_per_token(30, 3, 64) == 23040 and tf.kv_bytes_per_token(32, 8, 128) == 131072


def test_writing_resumes_and_refuses_other_settings(tmp_path):
    """A store cut after 2 complete shards and resumed holds the same rows as one written at once;
    a writer with other settings or another draft vocabulary is refused by name."""
    whole = _store(tmp_path / "whole")
    _store(tmp_path / "cut", n_rows=4)  # rows 0..3 = 2 complete shards
    assert len(tf.FeatureStore(str(tmp_path / "cut"))) == 4
    resumed = _store(tmp_path / "cut")
    assert len(resumed) == len(whole) == ROWS
    for i in range(ROWS):
        a, b = whole.row(i), resumed.row(i)
        for k in tf.ROW_KEYS:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"row {i} {k}")
    spec, _, _, vocab, _ = _setup()
    with pytest.raises(ValueError, match="top_k"):
        tf.FeatureWriter(str(tmp_path / "whole"), _settings(spec, 8, "float32"), vocab)
    d2t = np.sort(np.append(vocab.d2t[:-1], np.nonzero(~vocab.t2d)[0][0])).astype(np.int32)
    t2d = np.zeros_like(vocab.t2d)
    t2d[d2t] = True
    with pytest.raises(ValueError, match="draft vocabulary"):
        tf.FeatureWriter(str(tmp_path / "whole"), _settings(spec, DRAFT_VOCAB, "float32"),
                         DraftVocab(d2t, t2d, vocab.counts))


def test_store_is_a_grain_source(tmp_path):
    """The store pickles without open shard handles and batches through grain with every key."""
    store = _store(tmp_path)
    store[0]  # opens a shard
    clone = pickle.loads(pickle.dumps(store))
    np.testing.assert_array_equal(clone[3]["h_cat"], store[3]["h_cat"])
    batch = next(iter(tf.feature_dataset(store, per_host_batch_size=2, shuffle=False)))
    assert set(batch) == {"tokens", "loss_mask", "attention_mask", "record_index", *T.OFFLINE_KEYS}
    assert batch["record_index"].tolist() == [0, 1]  # store rows, for train.log_records
    assert batch["h_cat"].shape == (2, N, 3 * spec_d()) and batch["teacher_topk_ids"].dtype == np.int32
    with pytest.raises(IndexError, match="outside"):
        store.row(ROWS)


def spec_d():
    return _setup()[0].target.d_model


def test_training_reads_a_matching_store_only(tmp_path):
    """``data.target_features``: batches and the draft vocabulary come from the store (last rows
    held out); a store of another target, or ConFu with offline features, is refused by name."""
    from configs.tiny import get_config
    from confu_jax.train.confu_task import build_task
    from confu_jax.train.target_features import offline_data

    spec, _, _, vocab, _ = _setup()
    store = _store(tmp_path)
    config = get_config("eagle3")
    config.data.max_length, config.data.global_batch_size = N, 2
    config.objective.eval_records, config.objective.eval_batches = 2, 1
    config.data.target_features = str(tmp_path)
    got_vocab, train_it, eval_batches, rows_per_epoch = offline_data(config, spec, "test")
    assert rows_per_epoch == ROWS - 2
    np.testing.assert_array_equal(got_vocab.d2t, vocab.d2t)
    batch = next(train_it(0, 1))
    assert batch["h_cat"].shape == (2, N, 3 * spec.target.d_model)
    held = eval_batches(0, 1)
    assert len(held) == 1
    np.testing.assert_array_equal(held[0]["tokens"], np.stack([store[3]["tokens"], store[4]["tokens"]]))
    with pytest.raises(ValueError, match="target_fingerprint"):
        offline_data(config, spec, "another target")
    confu = get_config("confu")
    confu.data.target_features = str(tmp_path)
    with pytest.raises(ValueError, match="eagle3 only"):
        build_task(confu)


def test_train_rows_repeats_a_subset_every_epoch(tmp_path):
    """``data.train_rows``: training reads exactly the store's first N rows, each once per epoch in
    a new order, never a held-out row; more rows than the store's training part are refused."""
    from configs.tiny import get_config
    from confu_jax.train.target_features import offline_data

    spec = _setup()[0]
    store = _store(tmp_path)
    config = get_config("eagle3")
    config.data.max_length, config.data.global_batch_size = N, 1
    config.objective.eval_records = 1  # the store's last row; rows 0..3 are its training part
    config.data.target_features = str(tmp_path)
    config.data.train_rows = 3
    _, train_it, _, rows_per_epoch = offline_data(config, spec, "test")
    assert rows_per_epoch == 3
    it = train_it(0, 1)
    by_tokens = {store[i]["tokens"].tobytes(): i for i in range(ROWS)}
    read = [by_tokens[next(it)["tokens"][0].tobytes()] for _ in range(3 * 8)]
    epochs = [read[i:i + 3] for i in range(0, len(read), 3)]
    assert all(sorted(e) == [0, 1, 2] for e in epochs), epochs  # every epoch: each subset row once
    assert len({tuple(e) for e in epochs}) > 1, epochs  # reshuffled between epochs
    config.data.train_rows = 5
    with pytest.raises(ValueError, match="holds 4 training rows"):
        offline_data(config, spec, "test")


@pytest.mark.slow
def test_offline_training_logs_epochs_and_resumes_exactly(tmp_path):
    """A run on a store, stopped after 3 steps and resumed to 6, takes the identical batches and
    losses of one run of 6 (the store's grain iterator state is checkpointed), and logs the epoch."""
    from configs.tiny import get_config
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.train.loop import train
    from confu_jax.train.metric_writers import read_csv
    from confu_jax.train.target_loading import load_target

    config = get_config("eagle3")
    spec, target = load_target(config, model_spec_from_config(config))
    n, v, dv = int(config.data.max_length), spec.target.vocab_size, spec.head.draft_vocab_size
    d2t = np.arange(v - dv, v, dtype=np.int32)
    t2d = np.zeros(v, bool)
    t2d[d2t] = True
    vocab = DraftVocab(d2t, t2d, np.zeros(dv, np.int64))
    rng = np.random.default_rng(3)
    rows = [{"tokens": rng.integers(2, v, n).astype(np.int32), "loss_mask": np.arange(n) >= 4,
             "attention_mask": np.ones(n, bool)} for _ in range(16)]
    settings = tf.StoreSettings(target_fingerprint=target_fingerprint(target), source="random", max_length=n,
                                top_k=16, dtype="bfloat16", d_model=spec.target.d_model, taps=tuple(spec.taps),
                                draft_vocab_size=dv, vocab_size=v)
    store_dir = str(tmp_path / "store")
    write_rows(tf.FeatureWriter(store_dir, settings, vocab, 4), spec, target, vocab, rows, batch_size=2,
               vocab_chunk=48)
    config.data.target_features = store_dir
    config.data.global_batch_size, config.data.train_rows = 8, 10  # rows 0..9; 12..15 held out
    config.objective.eval_records = 4
    config.train.eval_every, config.train.log_every, config.train.progress_bar = 0, 1, False
    config.train.checkpoint.every, config.train.checkpoint.async_save = 1, False
    config.train.steps = 6
    train(config, str(tmp_path / "whole"))
    config.train.steps = 3
    train(config, str(tmp_path / "resumed"))
    config.train.steps = 6
    train(config, str(tmp_path / "resumed"))
    whole, resumed = (read_csv(str(tmp_path / w / "metrics.csv")) for w in ("whole", "resumed"))
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["epoch"] for r in whole] == pytest.approx([s * 8 / 10 for s in range(1, 7)])
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole], rtol=1e-6)


def _short_rows(count=6):
    """Conversations of 3-7 tokens in rows of N: 2-4 fit in one packed row."""
    spec = _setup()[0]
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(count):
        n = int(rng.integers(3, 8))
        tok = np.zeros(N, np.int32)
        tok[:n] = rng.integers(2, spec.target.vocab_size, n)
        rows.append({"tokens": tok, "loss_mask": (np.arange(N) >= 1) & (np.arange(N) < n),
                     "attention_mask": np.arange(N) < n})
    return rows


def test_packed_writing_stores_what_one_conversation_a_row_stores(tmp_path):
    """``write_rows(pack=True)`` (several conversations per target forward, as launch.target_features
    does by default) stores every row as the one-conversation-a-row writer does, in the same order,
    float32 to rounding; a packed write resumes after the rows already stored."""
    spec, tp, _, vocab, _ = _setup()
    rows = _short_rows(10)
    settings = _settings(spec, DRAFT_VOCAB, "float32")
    write_rows(tf.FeatureWriter(str(tmp_path / "padded"), settings, vocab, 4), spec, tp, vocab, rows,
               batch_size=2, vocab_chunk=48)
    packed_dir = str(tmp_path / "packed")
    assert write_rows(tf.FeatureWriter(packed_dir, settings, vocab, 4), spec, tp, vocab, rows[:6],
                      batch_size=2, vocab_chunk=48, pack=True) == 6  # shards of rows 0-3 and 4-5
    assert write_rows(tf.FeatureWriter(packed_dir, settings, vocab, 4), spec, tp, vocab, rows,
                      batch_size=2, vocab_chunk=48, pack=True) == 4  # resumed: rows 6-9
    padded, packed = tf.FeatureStore(str(tmp_path / "padded")), tf.FeatureStore(packed_dir)
    assert len(packed) == len(padded) == len(rows)
    for i in range(len(rows)):
        a, b = padded.row(i), packed.row(i)
        for k in ("tokens", "loss_mask", "teacher_topk_ids", "teacher_argmax"):
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"row {i} {k}")
        for k in ("h_cat", "teacher_topk_logp", "teacher_lse_draft", "teacher_lse_full"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=2e-5, err_msg=f"row {i} {k}")


@pytest.mark.slow
def test_packed_store_rows_train_as_the_online_packed_batch(tmp_path):
    """``data.pack`` with a store: each packed segment carries its own conversation's stored features,
    and the loss, metrics and gradients equal the online loss on the same packed rows (the target run
    with segment masks and restarting positions) — float32, full top-k."""
    spec, tp, tr, vocab, _ = _setup()
    w = tf.FeatureWriter(str(tmp_path), _settings(spec, DRAFT_VOCAB, "float32"), vocab, 4)
    write_rows(w, spec, tp, vocab, _short_rows(), batch_size=2, vocab_chunk=48)
    store = tf.FeatureStore(str(tmp_path))
    batch = next(iter(tf.feature_dataset(store, per_host_batch_size=2, shuffle=False, pack=True)))
    seg = batch["segment_ids"]
    assert seg.max(axis=1).min() >= 2  # every row holds several conversations
    by_tokens = {store.unpadded(i)["tokens"].tobytes(): i for i in range(len(store))}
    for b in range(2):
        for s in range(1, seg[b].max() + 1):
            at = seg[b] == s
            row = store.unpadded(by_tokens[batch["tokens"][b][at].tobytes()])
            np.testing.assert_array_equal(batch["positions"][b][at], np.arange(at.sum()))
            for k in tf.ROW_KEYS[1:]:
                np.testing.assert_array_equal(batch[k][b][at], row[k], err_msg=k)
    online = {k: jnp.asarray(batch[k]) for k in ("tokens", "loss_mask", "attention_mask", "segment_ids", "positions")}
    vg = _value_and_grad()
    (l_on, m_on), g_on = vg(tr, online)
    (l_off, m_off), g_off = vg(tr, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(float(l_off), float(l_on), rtol=1e-5)
    for k in ("positions/step0", "acc/step0", "acceptance_length"):
        np.testing.assert_allclose(float(m_off[k]), float(m_on[k]), rtol=1e-5, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_on), jax.tree_util.tree_leaves(g_off)):
        scale = float(jnp.max(jnp.abs(a))) + 1e-8
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
