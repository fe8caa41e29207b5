"""Draft vocabulary: counts on known fixtures, selection order, EOS always kept, save/load, formats."""

import collections

import numpy as np
import pytest

from confu_jax.data import draft_vocab as dv
from tests.helpers.fake_chat import END, VOCAB, FakeChatTokenizer


def test_counts_only_masked_tokens():
    rows = [
        ([5, 6, 6, 7, 9], [False, True, True, False, True]),
        ([6, 7, 7, 7, 1], [True, True, True, False, False]),
    ]
    counts = dv.count_answer_tokens(rows, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 3, 2, 0, 1]
    with pytest.raises(ValueError, match="token id 12 outside the target vocabulary of 10"):
        dv.count_answer_tokens([([12], [True])], 10)


def test_top_k_with_ties_by_id_and_forced_eos():
    #            id: 0  1  2  3  4  5  6  7  8  9
    counts = np.array([0, 5, 9, 5, 1, 0, 7, 5, 0, 2])
    v = dv.build_draft_vocab(counts, 4)
    # 2 (9), 6 (7), then the tie at 5 goes to the smaller ids 1 and 3; d2t ascending.
    assert v.d2t.tolist() == [1, 2, 3, 6]
    assert v.t2d.tolist() == [i in (1, 2, 3, 6) for i in range(10)]
    assert v.counts.tolist() == [5, 9, 5, 7]
    # A never-seen EOS (id 8) is kept and pushes out the least frequent of the top 4.
    v = dv.build_draft_vocab(counts, 4, always_include=[8])
    assert v.d2t.tolist() == [1, 2, 6, 8]
    # Asking for more tokens than were seen fills with unseen ids, smallest first.
    v = dv.build_draft_vocab(counts, 8)
    assert v.d2t.tolist() == [0, 1, 2, 3, 4, 6, 7, 9]
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 10\]"):
        dv.build_draft_vocab(counts, 11)


def test_maps_save_load_and_eagle3_format(tmp_path):
    counts = np.arange(20)[::-1] * 3 % 17
    v = dv.build_draft_vocab(counts, 7, always_include=[19])
    ids = np.arange(20)
    d = v.target_to_draft(ids)
    assert (d[v.d2t] == np.arange(7)).all() and (d[~v.t2d] == -1).all()
    path = tmp_path / "vocab.npz"
    v.save(str(path))
    w = dv.DraftVocab.load(str(path))
    for a, b in zip(v.as_arrays().values(), w.as_arrays().values()):
        np.testing.assert_array_equal(a, b)
    assert w.d2t.dtype == np.int32 and w.t2d.dtype == bool
    # EAGLE-3 checkpoints store target = draft + d2t[draft].
    off = v.eagle3_offsets()
    np.testing.assert_array_equal(np.arange(7) + off, v.d2t)
    np.testing.assert_array_equal(dv.DraftVocab.from_eagle3(off, v.t2d).d2t, v.d2t)
    bad = tmp_path / "bad.npz"
    np.savez(str(bad), d2t=np.array([3, 1], np.int32), t2d=np.zeros(5, bool))
    with pytest.raises(ValueError, match="bad.npz: not a valid draft vocabulary.*ascending"):
        dv.DraftVocab.load(str(bad))


def test_from_conversations_matches_independent_count():
    tok = FakeChatTokenizer()
    convs = [
        {"messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "x y x"}]},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "x x x x"},
                {"role": "assistant", "content": "y z"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "z z w"},
            ]
        },
    ]
    ref = collections.Counter()
    for c in convs:
        for m in c["messages"]:
            if m["role"] == "assistant":
                ref.update(tok.encode(m["content"]) + [END])
    v = dv.draft_vocab_from_conversations(convs, tok, target_vocab_size=VOCAB, draft_vocab_size=3)
    top = sorted(ref, key=lambda t: (-ref[t], t))
    expected = sorted({END} | set([t for t in top if t != END][:2]))
    assert v.d2t.tolist() == expected
    assert v.counts.tolist() == [ref[t] for t in expected]
    # User-only words ("x" four times in a prompt) must not outweigh answer words.
    full = dv.draft_vocab_from_conversations(convs, tok, target_vocab_size=VOCAB, draft_vocab_size=VOCAB)
    assert {int(t): int(c) for t, c in zip(full.d2t, full.counts) if c} == dict(ref)


def test_draft_vocab_for_training_counts_or_loads_per_config(tmp_path):
    from confu_jax.data.pipeline import default_data_config

    tok = FakeChatTokenizer()
    convs = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b b c c c"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "d d d d"}]},
    ]
    cfg = default_data_config()
    cfg.update(draft_vocab_size=2, draft_vocab_max_records=1, max_length=100)
    v = dv.draft_vocab_for_training(cfg, tok, VOCAB, conversations=convs)
    # Only the first conversation is counted: "c" (3) plus the forced END.
    assert v.d2t.tolist() == sorted([END, tok.encode("c")[0]])
    cfg.draft_vocab_size = 0
    assert dv.draft_vocab_for_training(cfg, tok, VOCAB, conversations=convs).draft_size == VOCAB
    path = tmp_path / "v.npz"
    v.save(str(path))
    cfg.update(draft_vocab_path=str(path), draft_vocab_size=2)
    np.testing.assert_array_equal(dv.draft_vocab_for_training(cfg, tok, VOCAB).d2t, v.d2t)
    cfg.draft_vocab_size = 3
    with pytest.raises(ValueError, match="maps 2 draft ids onto 64 target ids; this run expects 3 onto 64"):
        dv.draft_vocab_for_training(cfg, tok, VOCAB)


def test_vocab_coverage_by_hand():
    from confu_jax.data.draft_vocab import vocab_coverage

    train = np.array([0, 10, 5, 3, 2, 0], np.int64)  # keeps 1, then 2, then 3 ...
    held = np.array([4, 1, 1, 0, 2, 2], np.int64)
    got = vocab_coverage(train, held, [1, 2, 3], always_include=[5])
    # size 1: {5} (forced); size 2: {5, 1}; size 3: {5, 1, 2}
    assert got == [{"size": 1, "train": 0.0, "eval": 0.2},
                   {"size": 2, "train": 0.5, "eval": 0.3},
                   {"size": 3, "train": 0.75, "eval": 0.4}]
    with pytest.raises(ValueError, match="train counts"):
        vocab_coverage(train, held[:3], [1])
