"""The data path with the real SmolLM2 tokenizer and ShareGPT: loss masks, batches, draft vocabulary.

The masks are checked against an independent construction: each assistant message's content is
tokenised on its own, followed by ``<|im_end|>``, and located right after the template's
``<|im_start|>assistant\\n`` header; those positions, and only those, must be in the loss mask.
"""

import collections

import numpy as np
import pytest

from confu_jax import assets
from confu_jax.data import draft_vocab as dv
from confu_jax.data import formats, pipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    try:
        from confu_jax.data.chat import ChatTokenizer

        return ChatTokenizer.load("smollm2-135m-instruct")
    except assets.AssetNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def sharegpt():
    try:
        return formats.load_conversations("sharegpt", max_records=40)[0]
    except assets.AssetNotFoundError as e:
        pytest.skip(str(e))


def _expected_mask(tok, messages, ids):
    """Assistant positions found by locating each separately tokenised answer after its header."""
    header = tok.encode("<|im_start|>assistant\n")
    im_end = tok.token_id("<|im_end|>")
    mask = np.zeros(len(ids), bool)
    pos = 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        answer = tok.encode(m["content"]) + [im_end]
        while ids[pos : pos + len(header)] != header:
            pos += 1
            assert pos < len(ids), "assistant header not found"
        pos += len(header)
        assert ids[pos : pos + len(answer)] == answer, "answer tokens differ from separate tokenisation"
        mask[pos : pos + len(answer)] = True
        pos += len(answer)
    return mask


def test_loss_mask_is_exactly_the_assistant_tokens(tok, sharegpt):
    handwritten = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 equals 4."},
        {"role": "user", "content": "And in words?"},
        {"role": "assistant", "content": " Four — with a leading space, <tags> and\nnew lines.\n"},
    ]
    with_system = [{"role": "system", "content": "Answer briefly."}] + handwritten
    for messages in [handwritten, with_system] + [c["messages"] for c in sharegpt[:25]]:
        ids, _ = tok.encode_chat(messages)
        row = pipeline.encode_example(messages, tok, max_length=len(ids) + 3)
        expected = _expected_mask(tok, messages, ids)
        np.testing.assert_array_equal(row["tokens"][: len(ids)], ids)
        np.testing.assert_array_equal(row["loss_mask"][: len(ids)], expected)
        assert not row["loss_mask"][len(ids) :].any()
        assert (row["tokens"][len(ids) :] == tok.pad_id).all()
    # The default system prompt the SmolLM2 template inserts is context, not an answer.
    ids, _ = tok.encode_chat(handwritten)
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_sharegpt_batches_and_draft_vocab(tok, sharegpt):
    cfg = pipeline.default_data_config()
    cfg.update(max_length=256, global_batch_size=4, num_threads=0, prefetch_buffer_size=0)
    it = pipeline.make_train_iterator(cfg, tok, 1, 2, seed=0, conversations=sharegpt)
    batch = next(it)
    assert batch["tokens"].shape == (2, 256) and batch["tokens"].dtype == np.int32
    for row, idx in enumerate(batch["record_index"]):
        ids, _ = tok.encode_chat(sharegpt[idx]["messages"])
        n = min(len(ids), 256)
        np.testing.assert_array_equal(batch["tokens"][row, :n], ids[:n])
        expected = _expected_mask(tok, sharegpt[idx]["messages"], ids)[:n]
        np.testing.assert_array_equal(batch["loss_mask"][row, :n], expected)

    convs = sharegpt[:15]
    v = dv.draft_vocab_from_conversations(
        convs, tok, target_vocab_size=tok.vocab_size, draft_vocab_size=500
    )
    ref = collections.Counter()
    for c in convs:
        for m in c["messages"]:
            if m["role"] == "assistant":
                ref.update(tok.encode(m["content"]) + [tok.token_id("<|im_end|>")])
    assert tok.token_id("<|im_end|>") in v.d2t.tolist() and set(tok.eos_ids) <= set(v.d2t.tolist())
    assert len(ref) > 500
    top = sorted(ref, key=lambda t: (-ref[t], t))[:500]  # <|im_end|> closes every answer: in top
    assert v.d2t.tolist() == sorted(top)
    kept = {int(t): int(c) for t, c in zip(v.d2t, v.counts)}
    assert all(kept[t] == ref[t] for t in kept)
    # Everything more frequent than the rarest kept (non-forced) token is kept.
    floor = min(c for t, c in kept.items() if t not in tok.eos_ids)
    assert all(t in kept for t, c in ref.items() if c > floor)


def test_encode_transform_crosses_processes_with_the_real_tokenizer(tok, sharegpt):
    """ChatTokenizer does not pickle (jinja template); workers reload it from its source path."""
    import pickle

    enc = pipeline._Encode(sharegpt, tok, 128, 1)
    clone = pickle.loads(pickle.dumps(enc))
    assert clone._tokenizer is not tok and clone._tokenizer.source == tok.source
    for i in range(3):
        a, b = enc.map(i), clone.map(i)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
