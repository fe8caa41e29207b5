"""Training and held-out batches from conversation files, with the draft vocabulary counted on them.

The last ``config.objective.eval_records`` conversations of the training files are held out for
evaluation; the draft vocabulary is counted on the rest (it is saved with every checkpoint).
"""

from __future__ import annotations

import logging

import numpy as np

from confu_jax.models.spec import ModelSpec
from confu_jax.assets import strip_asset

log = logging.getLogger(__name__)

BATCH_KEYS = ("tokens", "loss_mask", "attention_mask")


class KeepKeys:
    """A batch iterator restricted to the keys the loss reads, plus the host-side ``record_index``
    (the training loop logs and drops it: ``train.log_records``); checkpointable like the inner one."""

    def __init__(self, inner, keys=BATCH_KEYS):
        self.inner, self.keys = inner, tuple(keys) + ("record_index",)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        return {k: np.asarray(batch[k]) for k in self.keys if k in batch}

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state) -> None:
        self.inner.set_state(state)


def process_rows(batch: dict, process_index: int, process_count: int) -> dict:
    n = next(iter(batch.values())).shape[0]
    lo, hi = process_index * n // process_count, (process_index + 1) * n // process_count
    return {k: v[lo:hi] for k, v in batch.items()}


def training_tokenizer(config):
    """The target's ``ChatTokenizer`` with ``data.chat_template_kwargs``: every row training renders
    (training and held-out rows, the draft vocabulary's counts, offline target features) goes through
    the template with the same kwargs, as the target sees its prompts at inference."""
    from confu_jax.data.chat import ChatTokenizer, parse_template_kwargs

    kwargs = parse_template_kwargs(config.data.get("chat_template_kwargs", ""), "config.data.chat_template_kwargs")
    return ChatTokenizer.load(strip_asset(config.model.source), template_kwargs=kwargs)


def warn_template_mismatch(conversations, tokenizer) -> int:
    """Log (once, with a count) generated records whose ``chat_template`` kwargs differ from the ones
    training renders with; returns that count.

    Why: the kwargs decide the generation prompt (Qwen3's empty reasoning block with
    ``enable_thinking`` false), so rows rendered with other kwargs than the answers were generated
    under put the loss on tokens the target was given, not generated. A warning, not an error: the
    template text itself may legitimately differ (another copy of the same target's tokenizer)."""
    want = dict(getattr(tokenizer, "template_kwargs", {}) or {})
    bad = [c for c in conversations if isinstance(c.get("chat_template"), dict)
           and dict(c["chat_template"].get("kwargs") or {}) != want]
    if bad:
        log.warning("%d of %d training conversations were generated with chat template kwargs %s (e.g. %s), but "
                    "training renders them with %s: set data.chat_template_kwargs to what generate_data was given",
                    len(bad), len(conversations), bad[0]["chat_template"].get("kwargs"), bad[0]["id"], want)
    return len(bad)


def real_data(config, spec: ModelSpec):
    """(draft vocab, train_iterator, eval_batches) over conversations, with a held-out tail."""
    from confu_jax.data import formats, pipeline
    from confu_jax.data.draft_vocab import draft_vocab_for_training

    data = config.data
    tokenizer = training_tokenizer(config)
    conversations, report = formats.load_conversations(
        pipeline.train_files(data), on_bad_record=data.on_bad_record, max_records=data.max_records or None)
    log.info("training data: %s", report.summary())
    warn_template_mismatch(conversations, tokenizer)
    train_convs, eval_convs = formats.split_held_out(conversations, int(config.objective.eval_records))
    vocab = draft_vocab_for_training(data, tokenizer, spec.target.vocab_size, conversations=train_convs)

    def train_iterator(pidx, pcount):  # packed rows (data.pack) also carry segment_ids and positions
        keys = pipeline.PACKED_KEYS if data.get("pack", False) else BATCH_KEYS
        return KeepKeys(pipeline.make_train_iterator(config, tokenizer, pidx, pcount, seed=int(config.train.seed),
                                                      conversations=train_convs), keys)

    def eval_batches(pidx, pcount):  # always padded: the loss is the same packed or padded
        rows = [r for r in (pipeline.encode_example(c["messages"], tokenizer, int(data.max_length),
                                                    int(data.min_loss_tokens)) for c in eval_convs) if r is not None]
        g = int(data.global_batch_size)
        out = []
        for i in range(min(int(config.objective.eval_batches), len(rows) // g)):
            batch = {k: np.stack([r[k] for r in rows[i * g:(i + 1) * g]]) for k in BATCH_KEYS}
            out.append(process_rows(batch, pidx, pcount))
        if not out:
            log.warning("no held-out batch: %d usable eval conversations < data.global_batch_size=%d", len(rows), g)
        return out

    return vocab, train_iterator, eval_batches
