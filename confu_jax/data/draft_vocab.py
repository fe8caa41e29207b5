"""Draft vocabulary (EAGLE-3): the draft's LM head covers only the most frequent answer tokens.

``d2t`` int32 [V_draft]: the target id of each draft id, in **ascending target-id order** (as
EAGLE-3 / SpecForge build it), so the inverse map is a cumulative sum: draft id of target token
``t`` = ``cumsum(t2d)[t] - 1`` where ``t2d[t]``. EAGLE-3's checkpoints store ``d2t`` as offsets
(``target = draft + d2t[draft]``); ``eagle3_offsets()`` / ``from_eagle3()`` convert.
``t2d`` bool [V_target]: whether a target token has a draft id.
``counts`` int64 [V_draft]: how often each kept token occurred as a loss-masked answer token.

Frequencies are counted on the tokens the loss actually trains on: the assistant-mask tokens of
the chat-templated, truncated conversations (the same encoding as the training pipeline). End-of-
sequence / end-of-turn tokens are always kept, whatever their count, so the draft can stop.
Ties in frequency are broken by the smaller target id, so the result is deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from confu_jax import storage


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    d2t: np.ndarray  # int32 [V_draft], ascending target ids
    t2d: np.ndarray  # bool [V_target]
    counts: np.ndarray  # int64 [V_draft]

    def __post_init__(self):
        d2t, t2d, counts = self.d2t, self.t2d, self.counts
        if d2t.ndim != 1 or t2d.ndim != 1 or counts.shape != d2t.shape:
            raise ValueError(
                f"DraftVocab: expected d2t [V_draft], t2d [V_target], counts [V_draft]; got "
                f"{d2t.shape}, {t2d.shape}, {counts.shape}"
            )
        if np.any(np.diff(d2t) <= 0):
            raise ValueError("DraftVocab: d2t must hold strictly ascending target ids")
        if int(t2d.sum()) != d2t.size or (d2t.size and not t2d[d2t].all()):
            raise ValueError(
                f"DraftVocab: t2d marks {int(t2d.sum())} tokens but d2t lists {d2t.size}, or they "
                "disagree on which"
            )

    @property
    def draft_size(self) -> int:
        return int(self.d2t.size)

    @property
    def target_size(self) -> int:
        return int(self.t2d.size)

    def target_to_draft(self, target_ids) -> np.ndarray:
        """Draft id of each target id, -1 where the token is outside the draft vocabulary."""
        target_ids = np.asarray(target_ids)
        draft_of_target = np.where(self.t2d, np.cumsum(self.t2d) - 1, -1).astype(np.int32)
        return draft_of_target[target_ids]

    def eagle3_offsets(self) -> np.ndarray:
        """``d2t`` in EAGLE-3's checkpoint format: target id minus draft id."""
        return (self.d2t - np.arange(self.draft_size)).astype(np.int64)

    @classmethod
    def from_eagle3(cls, d2t_offsets, t2d) -> "DraftVocab":
        d2t_offsets = np.asarray(d2t_offsets)
        d2t = (d2t_offsets + np.arange(d2t_offsets.size)).astype(np.int32)
        return cls(d2t=d2t, t2d=np.asarray(t2d, bool), counts=np.zeros(d2t.size, np.int64))

    def as_arrays(self) -> dict:
        """Plain arrays for a checkpoint pytree (orbax) or ``np.savez``."""
        return {"d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}

    @classmethod
    def from_arrays(cls, arrays) -> "DraftVocab":
        missing = {"d2t", "t2d"} - set(arrays)
        if missing:
            raise KeyError(f"draft vocabulary arrays lack {sorted(missing)} (have {sorted(arrays)})")
        d2t = np.asarray(arrays["d2t"], np.int32)
        counts = np.asarray(arrays["counts"], np.int64) if "counts" in arrays else np.zeros(d2t.size, np.int64)
        return cls(d2t=d2t, t2d=np.asarray(arrays["t2d"], bool), counts=counts)

    def save(self, path: str) -> None:
        with storage.open(path, "wb") as f:  # a file object keeps np.savez from appending '.npz'
            np.savez(f, **self.as_arrays())

    @classmethod
    def load(cls, path: str) -> "DraftVocab":
        with storage.open(path, "rb") as f, np.load(f) as z:
            try:
                return cls.from_arrays(dict(z))
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}: not a valid draft vocabulary: {e}") from e


def count_answer_tokens(
    rows: Iterable[tuple[Sequence[int], Sequence[bool]]], target_vocab_size: int
) -> np.ndarray:
    """int64 [V_target]: occurrences of each token where the mask is True, over all rows."""
    counts_v = np.zeros((target_vocab_size,), np.int64)
    for ids, mask in rows:
        ids = np.asarray(ids, np.int64)
        mask = np.asarray(mask, bool)
        if ids.shape != mask.shape:
            raise ValueError(f"count_answer_tokens: ids {ids.shape} vs mask {mask.shape}")
        answer = ids[mask]
        if answer.size and (answer.min() < 0 or answer.max() >= target_vocab_size):
            raise ValueError(
                f"count_answer_tokens: token id {int(answer.max())} outside the target vocabulary "
                f"of {target_vocab_size}"
            )
        counts_v += np.bincount(answer, minlength=target_vocab_size)
    return counts_v


def build_draft_vocab(
    counts_v: np.ndarray, draft_vocab_size: int, always_include: Sequence[int] = ()
) -> DraftVocab:
    """Keep ``always_include`` plus the most frequent tokens up to ``draft_vocab_size``.

    Tokens never seen fill the remainder (smallest ids first) when the data has fewer distinct
    answer tokens than the requested size, so the draft head's shape is what the config says.
    """
    counts_v = np.asarray(counts_v, np.int64)
    target_vocab_size = counts_v.size
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in [1, {target_vocab_size}] (the target vocabulary), got "
            f"{draft_vocab_size}"
        )
    forced = sorted({int(t) for t in always_include})
    if forced and (forced[0] < 0 or forced[-1] >= target_vocab_size):
        raise ValueError(f"always_include ids {forced} outside [0, {target_vocab_size})")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"{len(forced)} always-included tokens exceed draft_vocab_size={draft_vocab_size}")
    # Stable sort on -count: equal counts keep ascending id order.
    order = np.argsort(-counts_v, kind="stable")
    is_forced = np.zeros(target_vocab_size, bool)
    is_forced[forced] = True
    rest = order[~is_forced[order]][: draft_vocab_size - len(forced)]
    t2d = np.zeros(target_vocab_size, bool)
    t2d[forced] = True
    t2d[rest] = True
    d2t = np.flatnonzero(t2d).astype(np.int32)
    return DraftVocab(d2t=d2t, t2d=t2d, counts=counts_v[d2t])


def vocab_coverage(train_counts_v: np.ndarray, eval_counts_v: np.ndarray, sizes: Sequence[int],
                   always_include: Sequence[int] = ()) -> list[dict]:
    """How much answer text a draft vocabulary of each size can propose -> one dict per size:
    ``{'size', 'train', 'eval'}``, the fractions of answer tokens (training counts, held-out
    counts) whose id is in the vocabulary ``build_draft_vocab`` keeps for that size from the
    training counts. A token outside the draft vocabulary can never be drafted, so the held-out
    coverage bounds every draft step's acceptance: it is what the size should be chosen by."""
    train = np.asarray(train_counts_v, np.int64)
    held = np.asarray(eval_counts_v, np.int64)
    if train.shape != held.shape:
        raise ValueError(f"vocab_coverage: train counts {train.shape} vs eval counts {held.shape}")
    out = []
    for size in sizes:
        t2d = build_draft_vocab(train, int(size), always_include).t2d
        out.append({"size": int(size), "train": float(train[t2d].sum() / max(train.sum(), 1)),
                    "eval": float(held[t2d].sum() / max(held.sum(), 1))})
    return out


def draft_vocab_from_conversations(
    conversations: Iterable[dict],
    tokenizer,
    *,
    target_vocab_size: int,
    draft_vocab_size: int,
    max_length: int | None = None,
) -> DraftVocab:
    """Count answer tokens of conversations encoded exactly as for training, then build the map.

    ``tokenizer`` needs ``encode_chat`` and ``eos_ids`` (``ChatTokenizer``); ``max_length`` applies
    the training truncation so tokens the loss never sees are not counted.
    """

    def rows():
        for conv in conversations:
            ids, mask = tokenizer.encode_chat(conv["messages"], add_generation_prompt=False)
            if max_length is not None:
                ids, mask = ids[:max_length], mask[:max_length]
            yield ids, mask

    counts_v = count_answer_tokens(rows(), target_vocab_size)
    return build_draft_vocab(counts_v, draft_vocab_size, always_include=list(tokenizer.eos_ids))


def draft_vocab_for_training(
    data_config, tokenizer, target_vocab_size: int, conversations: Sequence[dict] | None = None
) -> DraftVocab:
    """The draft vocabulary a training run uses, from the ``data`` config.

    ``data.draft_vocab_path`` set: load that .npz (and check it fits the target and the size asked
    for). Otherwise count the first ``data.draft_vocab_max_records`` (0 = all) training
    conversations, truncated to ``data.max_length`` like the batches. ``data.draft_vocab_size`` <= 0
    means the whole target vocabulary. The caller saves the result with the checkpoint.
    """
    from confu_jax.data import formats, pipeline

    size = int(data_config.draft_vocab_size)
    size = target_vocab_size if size <= 0 else size
    if data_config.draft_vocab_path:
        v = DraftVocab.load(data_config.draft_vocab_path)
        if v.target_size != target_vocab_size or v.draft_size != size:
            raise ValueError(
                f"{data_config.draft_vocab_path}: draft vocabulary maps {v.draft_size} draft ids onto "
                f"{v.target_size} target ids; this run expects {size} onto {target_vocab_size}"
            )
        return v
    limit = int(data_config.draft_vocab_max_records) or None
    if conversations is None:
        conversations, _ = formats.load_conversations(
            pipeline.train_files(data_config), on_bad_record=data_config.on_bad_record, max_records=limit
        )
    if limit is not None:
        conversations = conversations[:limit]
    return draft_vocab_from_conversations(
        conversations, tokenizer, target_vocab_size=target_vocab_size, draft_vocab_size=size,
        max_length=int(data_config.max_length),
    )
