"""Grain pipeline: padding/masks, seeded shuffling, per-host sharding, exact iterator-state restore."""

import json

import numpy as np
import pytest

from confu_jax.data import pipeline
from tests.helpers.fake_chat import PAD, FakeChatTokenizer
from tests.helpers.pipeline_fixtures import MAX_LEN, conversations as _conversations, data_cfg as _cfg

def _take(it, n):
    return [next(it) for _ in range(n)]


def test_encode_example_pads_truncates_and_masks():
    tok = FakeChatTokenizer()
    msgs = _conversations()[3]["messages"]
    ids, mask = tok.encode_chat(msgs)
    row = pipeline.encode_example(msgs, tok, max_length=MAX_LEN)
    n = len(ids)
    assert n < MAX_LEN
    np.testing.assert_array_equal(row["tokens"][:n], ids)
    assert (row["tokens"][n:] == PAD).all() and row["tokens"].dtype == np.int32
    np.testing.assert_array_equal(row["loss_mask"][:n], mask)
    assert not row["loss_mask"][n:].any()
    np.testing.assert_array_equal(row["attention_mask"], np.arange(MAX_LEN) < n)
    # Truncation keeps the first tokens and only the assistant tokens among them.
    short = pipeline.encode_example(msgs, tok, max_length=n - 2)
    np.testing.assert_array_equal(short["tokens"], ids[: n - 2])
    np.testing.assert_array_equal(short["loss_mask"], mask[: n - 2])
    # A row with no answer token left is unusable.
    first_answer = mask.index(True)
    assert pipeline.encode_example(msgs, tok, max_length=first_answer) is None
    assert pipeline.encode_example(msgs, tok, max_length=first_answer + 1) is not None


def test_batches_hold_the_encoded_records_and_each_record_once_per_epoch():
    tok, convs = FakeChatTokenizer(), _conversations()
    it = pipeline.make_train_iterator(_cfg(num_epochs=1), tok, seed=0, conversations=convs)
    batches = list(it)
    assert all(b["tokens"].shape == (4, MAX_LEN) and b["loss_mask"].dtype == bool for b in batches)
    seen = np.concatenate([b["record_index"] for b in batches])
    usable = [i for i in range(len(convs)) if i != 5]  # record 5 has no answer within MAX_LEN
    assert len(seen) == len(usable) // 4 * 4 and len(set(seen.tolist())) == len(seen)
    assert set(seen.tolist()) <= set(usable)
    assert seen.tolist() != sorted(seen.tolist())  # shuffled
    for b in batches:
        for row in range(4):
            ref = pipeline.encode_example(convs[b["record_index"][row]]["messages"], tok, MAX_LEN)
            for key in ("tokens", "loss_mask", "attention_mask"):
                np.testing.assert_array_equal(b[key][row], ref[key])


def test_shuffle_is_deterministic_by_seed():
    tok, convs = FakeChatTokenizer(), _conversations()

    def order(seed):
        it = pipeline.make_train_iterator(_cfg(), tok, seed=seed, conversations=convs)
        return np.concatenate([b["record_index"] for b in _take(it, 8)]).tolist()

    assert order(1) == order(1)
    assert order(1) != order(2)
    # Unshuffled reads in file order (minus the unusable record).
    it = pipeline.make_train_iterator(_cfg(shuffle=False), tok, seed=1, conversations=convs)
    assert np.concatenate([b["record_index"] for b in _take(it, 2)]).tolist() == [0, 1, 2, 3, 4, 6, 7, 8]


def test_per_host_shards_are_disjoint_and_recompose_the_global_stream():
    tok, convs = FakeChatTokenizer(), _conversations()
    cfg = _cfg(min_loss_tokens=0)  # keep every record so element k*n+i of the global stream is defined
    single = pipeline.make_train_iterator(cfg, tok, 0, 1, seed=7, conversations=convs)
    global_stream = np.concatenate([b["record_index"] for b in _take(single, 6)])  # 24 rows
    hosts = [pipeline.make_train_iterator(cfg, tok, i, 2, seed=7, conversations=convs) for i in range(2)]
    per_host = [np.concatenate([b["record_index"] for b in _take(h, 6)]) for h in hosts]
    assert next(hosts[0])["tokens"].shape == (2, MAX_LEN)  # per-host batch = global / hosts
    np.testing.assert_array_equal(per_host[0], global_stream[0::2][:12])
    np.testing.assert_array_equal(per_host[1], global_stream[1::2][:12])
    # Within the first epoch (23 records) the hosts read disjoint records.
    first_epoch = [set(p[: 23 // 2].tolist()) for p in per_host]
    assert not first_epoch[0] & first_epoch[1]
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible by process_count=3"):
        pipeline.make_train_iterator(cfg, tok, 0, 3, conversations=convs)


@pytest.mark.parametrize("num_threads", [0, 2])
def test_restoring_iterator_state_mid_epoch_replays_identical_batches(num_threads):
    tok, convs = FakeChatTokenizer(), _conversations()
    cfg = _cfg(num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
    it = pipeline.make_train_iterator(cfg, tok, 1, 2, seed=3, conversations=convs)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # what orbax's grain handler writes
    expected = _take(it, 9)  # crosses the epoch boundary (23 records, 2 per host-batch)
    fresh = pipeline.make_train_iterator(cfg, tok, 1, 2, seed=3, conversations=convs)
    fresh.set_state(state)
    got = _take(fresh, 9)
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e:
            np.testing.assert_array_equal(e[k], g[k])
    # A different position gives different batches (the comparison above can fail).
    other = pipeline.make_train_iterator(cfg, tok, 1, 2, seed=3, conversations=convs)
    assert not np.array_equal(next(other)["record_index"], expected[0]["record_index"])


def test_full_config_with_data_subconfig_and_files(tmp_path):
    import ml_collections

    p = tmp_path / "d.jsonl"
    with open(p, "w") as f:
        for c in _conversations(8):
            f.write(json.dumps({"id": c["id"], "conversations": c["messages"]}) + "\n")
        f.write("{broken\n")
    full = ml_collections.ConfigDict({"data": _cfg(train_files=f"{p}, {p}", num_epochs=1)})
    batches = list(pipeline.make_train_iterator(full, FakeChatTokenizer(), seed=0))
    assert pipeline.train_files(full) == [str(p), str(p)]
    assert len(batches) == 3  # 2 x 7 usable records (record 5 overflows) -> 3 full batches of 4
    full.data.on_bad_record = "fail"
    with pytest.raises(Exception, match=r"d\.jsonl:9: invalid_json"):
        pipeline.make_train_iterator(full, FakeChatTokenizer(), seed=0)


@pytest.mark.slow
def test_worker_processes_give_a_restorable_stream_of_the_same_records():
    tok, convs = FakeChatTokenizer(), _conversations()
    cfg = _cfg(num_workers=2)
    it = pipeline.make_train_iterator(cfg, tok, seed=5, conversations=convs)
    head = _take(it, 2)
    state = it.get_state()
    expected = _take(it, 6)
    it.close()
    # Each worker reads its own slice of the stream: the first 2 batches per worker (16 rows) stay
    # inside the first epoch of that slice, so no record repeats and the overflowing one is absent.
    first = np.concatenate([b["record_index"] for b in head + expected[:2]])
    assert len(set(first.tolist())) == 16 and 5 not in first
    for b in head + expected:
        for row in range(4):
            ref = pipeline.encode_example(convs[b["record_index"][row]]["messages"], tok, MAX_LEN)
            np.testing.assert_array_equal(b["tokens"][row], ref["tokens"])
            np.testing.assert_array_equal(b["loss_mask"][row], ref["loss_mask"])
    fresh = pipeline.make_train_iterator(cfg, tok, seed=5, conversations=convs)
    fresh.set_state(state)
    got = _take(fresh, 6)
    fresh.close()
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e["record_index"], g["record_index"])
        np.testing.assert_array_equal(e["tokens"], g["tokens"])


def test_data_whose_every_row_is_filtered_fails_fast_with_the_counts():
    """The pipeline repeats forever and drops unusable rows: with none usable it would wait forever."""
    tok = FakeChatTokenizer()
    convs = _conversations(6)
    convs[5]["messages"][1]["content"] = "a b c"
    long_prompt = [{"id": "p", "messages": [{"role": "user", "content": "x " * 40},
                                            {"role": "assistant", "content": "y"}]}]
    with pytest.raises(ValueError, match=r"every one of the 7 .*min_loss_tokens=50 .*2 have no answer token "
                                         r"before position 24, 5 have fewer"):
        pipeline.make_dataset(convs[:6] + long_prompt, tok, max_length=MAX_LEN, per_host_batch_size=2,
                              min_loss_tokens=50)
    assert pipeline.check_some_row_usable(long_prompt + convs, tok, MAX_LEN, 1) == 1
