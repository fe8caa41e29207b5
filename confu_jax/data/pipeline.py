"""Grain training pipeline: conversations -> padded, loss-masked token batches, sharded per host.

Pipeline (one ``grain`` graph, so its iterator state can be checkpointed and restored exactly):

    record indices --shuffle(seed)--> --repeat(num_epochs)--> [process_index::process_count]
      --map(chat template + assistant mask + truncate + pad)--> drop unusable --batch(per-host)-->

* Shuffling is a global permutation of the record indices seeded by ``seed``; with
  ``repeat`` every epoch gets a different permutation (grain folds the epoch into the seed).
* Sharding slices the *global* shuffled stream: host ``i`` of ``n`` takes elements ``i, i+n, ...``,
  so the hosts read disjoint records, the union of one step's per-host batches is one global batch,
  and per-host batch = global batch / process_count.
* Padding by default: every row is one conversation truncated/padded to ``max_length`` (static
  shapes for jit). ``pack=True`` (``data.pack``) instead packs several conversations into each row
  with grain's first-fit packer (``grain.experimental.FirstFitPackIterDataset``) and adds
  ``segment_ids`` int32 [B, N] (1, 2, ... per conversation in the row, 0 on padding) and
  ``positions`` int32 [B, N] (restarting at 0 per conversation); the objective keeps attention,
  anchors, windows, lags and TTT targets inside each conversation (docs/DESIGN.md §4), so packed
  rows train exactly what the same conversations padded would, with less padding computed.
  Packed rows carry ``record_index`` per token (int32 [B, N], -1 on padding).
* A row whose truncation leaves fewer than ``min_loss_tokens`` assistant tokens is dropped; with a
  finite ``num_epochs`` hosts may therefore run out one batch apart: drive training by step count.

Batch (numpy, per host): ``tokens`` int32 [B, N]; ``loss_mask`` bool [B, N], True where the token *at
that position* is an assistant token to predict (assistant content + its end-of-turn token, as
``ChatTokenizer.encode_chat`` marks it); ``attention_mask`` bool [B, N], True on real tokens;
``record_index`` int32 [B], the conversation's index in the loaded list (for debugging and audits:
``train.log_records``; host-side only, the training loop takes it out before the batch goes to devices).
"""

from __future__ import annotations

import logging
import pickle
from typing import Protocol, Sequence

import grain
import ml_collections
import numpy as np

from confu_jax import storage
from confu_jax.data import formats

log = logging.getLogger(__name__)


class ChatEncoder(Protocol):
    """What the pipeline needs from a tokenizer (``confu_jax.data.chat.ChatTokenizer`` has it)."""

    pad_id: int

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]: ...


def default_data_config() -> ml_collections.ConfigDict:
    """Defaults of the ``data`` sub-config (every key documented; override with --config.data.X)."""
    c = ml_collections.ConfigDict()
    # Conversation files, comma-separated (a string so --config.data.train_files=a.jsonl,b.jsonl
    # works): asset names ('sharegpt') or .json (array) / .jsonl paths; formats and record shapes
    # are recognised automatically (ShareGPT, SpecForge, UltraChat).
    c.train_files = "sharegpt"
    c.on_bad_record = "skip"  # 'skip': count + report file:line; 'fail': raise on the first one
    c.max_records = 0  # read at most this many good conversations (0 = all)
    c.max_length = 2048  # tokens per row after the chat template; longer rows are truncated
    c.min_loss_tokens = 1  # rows with fewer assistant tokens left after truncation are dropped
    # Extra chat-template variables for every row, a JSON object ('{"enable_thinking": false}' for
    # Qwen3; '' = none): rows are rendered as the target sees them at inference with these kwargs, so
    # use the ones the data was generated with (launch.generate_data --chat_template_kwargs; each
    # generated record names them). A kwarg the template does not read is refused.
    c.chat_template_kwargs = ""
    # Pack several conversations per row (segment ids + per-conversation positions; the loss never
    # crosses a boundary, docs/DESIGN.md §4). Measured (launch.train_bench --layouts=padded,packed):
    # ~2x real tokens/s on short conversations, no change on full rows. Off by default so that an
    # existing run resumes with the data order it started with.
    c.pack = False
    c.pack_bins = 0  # first-fit packing bins in flight (0 = the per-host batch size); more = fuller rows
    # Packed rows' length (0 = max_length, which still truncates each conversation). Rows longer than the
    # conversations fill far better: ShareGPT rows of <= 1024 tokens (mean 493, many > 512) fill rows of 1024 to
    # 77 % and rows of 2048 to 96 % (64 bins; docs/training.md "Trainer parity"). Longer rows cost attention.
    c.pack_length = 0
    # A launch.target_features directory: EAGLE-3 reads the stored taps + teacher instead of running
    # the target (rows, order and draft vocabulary come from the store; '' = online).
    c.target_features = ""
    # With target_features: train on the store's first N training rows only (0 = all), reshuffled
    # each epoch — a fixed subset read for several epochs (the held-out rows stay the store's last).
    c.train_rows = 0
    # Rows per step over all hosts. 0: 16 rounded up to a multiple of the data-parallel devices
    # (mesh data × fsdp: 16 on up to 16 chips, 32 on a 32-chip pod), resolved when the run starts
    # (train.loop.resolve_run_config) and saved resolved in config.json. An explicit value must
    # divide over those devices.
    c.global_batch_size = 0
    c.shuffle = True
    c.num_epochs = 0  # 0 = repeat forever (train by step count)
    c.num_threads = 2  # grain reader threads per host (tokenisation happens in them)
    c.prefetch_buffer_size = 16  # elements prefetched per host
    # Worker processes per host building batches (0 = in the training process). Tokenisation holds
    # the GIL, so threads do not scale it; processes do. The tokenizer must pickle, or have a
    # ``source`` its class can ``load`` it from (ChatTokenizer), and is re-created in each worker.
    c.num_workers = 0
    # Draft vocabulary (EAGLE-3 d2t/t2d): the most frequent assistant tokens of the training data.
    c.draft_vocab_size = 16384
    c.draft_vocab_max_records = 0  # conversations counted for the frequencies (0 = all)
    c.draft_vocab_path = ""  # .npz to load instead of counting ('' = count, then save beside ckpt)
    return c


def _data_cfg(config) -> ml_collections.ConfigDict:
    """Accept either the data sub-config or a full config that has one under ``.data``."""
    if "train_files" not in config and "data" in config:
        return config.data
    return config


def train_files(config) -> list[str]:
    """``data.train_files`` as a list (comma-separated string, or a list/tuple)."""
    files = _data_cfg(config).train_files
    if isinstance(files, str):
        files = files.split(",")
    files = [f.strip() for f in files if f.strip()]
    if not files:
        raise ValueError("data.train_files is empty; expected comma-separated files or asset names")
    return files


def encode_example(
    messages: Sequence[dict],
    tokenizer: ChatEncoder,
    max_length: int,
    min_loss_tokens: int = 1,
    pad: bool = True,
) -> dict | None:
    """One conversation -> padded row arrays, or None if truncation leaves too few answer tokens.

    ``pad=False``: the truncated conversation's own length (the packer lays it into a row)."""
    ids, mask = tokenizer.encode_chat(messages, add_generation_prompt=False)
    if len(ids) != len(mask):
        raise ValueError(
            f"encode_chat returned {len(ids)} ids but {len(mask)} assistant-mask entries"
        )
    n = min(len(ids), max_length)
    width = max_length if pad else n
    tokens_n = np.full((width,), tokenizer.pad_id, np.int32)
    loss_mask_n = np.zeros((width,), bool)
    attention_mask_n = np.zeros((width,), bool)
    tokens_n[:n] = ids[:n]
    loss_mask_n[:n] = mask[:n]
    attention_mask_n[:n] = True
    # Position 0 has no preceding token to predict it from.
    loss_mask_n[0] = False
    if int(loss_mask_n.sum()) < min_loss_tokens:
        return None
    return {"tokens": tokens_n, "loss_mask": loss_mask_n, "attention_mask": attention_mask_n}


class _Reload:
    """A tokenizer crossing a process boundary by the path it was loaded from (and its chat-template
    kwargs, so a worker renders rows as the main process does)."""

    def __init__(self, cls, source, template_kwargs=None):
        self.cls, self.source, self.template_kwargs = cls, source, template_kwargs

    def load(self):
        if self.template_kwargs:
            return self.cls.load(self.source, template_kwargs=self.template_kwargs)
        return self.cls.load(self.source)


class _Encode(grain.transforms.Map):
    """The per-record map; picklable so grain can run it in worker processes."""

    def __init__(self, conversations, tokenizer, max_length, min_loss_tokens, pad=True):
        self._conversations = conversations
        self._tokenizer = tokenizer
        self._max_length = max_length
        self._min_loss_tokens = min_loss_tokens
        self._pad = pad

    def __getstate__(self):
        state = dict(self.__dict__)
        tok = state["_tokenizer"]
        try:
            pickle.dumps(tok)
        except Exception as e:  # e.g. ChatTokenizer holds a compiled jinja template
            source = getattr(tok, "source", None)
            if not (source and storage.exists(source) and hasattr(type(tok), "load")):
                raise TypeError(
                    f"data.num_workers > 0 needs a picklable tokenizer or one with a loadable "
                    f"'source' path; {type(tok).__name__} has neither ({e})"
                ) from e
            state["_tokenizer"] = _Reload(type(tok), source, getattr(tok, "template_kwargs", None))
        return state

    def __setstate__(self, state):
        if isinstance(state["_tokenizer"], _Reload):
            state["_tokenizer"] = state["_tokenizer"].load()
        self.__dict__.update(state)

    def map(self, index):
        index = int(index)
        row = encode_example(
            self._conversations[index]["messages"],
            self._tokenizer,
            self._max_length,
            self._min_loss_tokens,
            self._pad,
        )
        if row is not None and self._pad:
            row["record_index"] = np.int32(index)
        elif row is not None:
            del row["attention_mask"]  # rebuilt from the packer's segment ids
            row["record_index"] = np.full(len(row["tokens"]), index, np.int32)  # packed with the tokens
        return row


PACKED_KEYS = ("tokens", "loss_mask", "attention_mask", "segment_ids", "positions")


class _PackedRow(grain.transforms.Map):
    """The packer's output -> the batch contract (``segment_ids``, ``positions``, ``attention_mask``),
    plus the per-token ``extra_keys`` packed alongside (offline target features)."""

    def __init__(self, extra_keys: Sequence[str] = ()):
        self._extra_keys = tuple(extra_keys)

    def map(self, row):
        seg = np.asarray(row["tokens_segment_ids"], np.int32)
        out = {"tokens": np.asarray(row["tokens"], np.int32), "loss_mask": np.asarray(row["loss_mask"], bool),
               "attention_mask": seg > 0, "segment_ids": seg,
               "positions": np.asarray(row["tokens_positions"], np.int32),
               **{k: row[k] for k in self._extra_keys}}
        if "record_index" in out:  # the packer pads with 0, a record's index: -1 says "no record"
            out["record_index"] = np.where(seg > 0, np.asarray(out["record_index"], np.int32), -1)
        return out


def pack_rows(ds: grain.IterDataset, max_length: int, num_bins: int,
              extra_keys: Sequence[str] = ()) -> grain.IterDataset:
    """Unpadded conversations -> rows of ``max_length`` holding several, first fit (see module doc).

    grain's packer fills ``num_bins`` rows in flight, placing each conversation in the first row
    with room, and pads (token 0, segment 0) what is left; its iterator state is checkpointable.
    ``extra_keys``: further per-token arrays of each element ([n, ...], packed like the tokens)."""
    from grain import experimental

    keys = ("tokens", "loss_mask", *extra_keys)
    packed = experimental.FirstFitPackIterDataset(
        ds, length_struct={k: max_length for k in keys}, num_packing_bins=int(num_bins), shuffle_bins=False)
    return packed.map(_PackedRow(extra_keys))


def check_pack_length(pack_length: int, max_length: int) -> int:
    """The packed rows' length: ``pack_length``, or ``max_length`` when 0; a row shorter than the longest
    conversation it must hold is refused."""
    if int(pack_length) == 0:
        return int(max_length)
    if int(pack_length) < int(max_length):
        raise ValueError(f"data.pack_length={pack_length}: expected 0 (= data.max_length) or at least "
                         f"data.max_length={max_length}, the longest conversation a packed row must hold")
    return int(pack_length)


def check_some_row_usable(conversations: Sequence[dict], tokenizer: ChatEncoder, max_length: int,
                          min_loss_tokens: int) -> int:
    """Index of the first conversation the row filter keeps; raises if it keeps none.

    The pipeline repeats its records forever and drops unusable rows, so data whose every record
    is dropped would make the first batch wait forever. Checking stops at the first usable record
    (cheap); only data that is entirely unusable is encoded in full, to say why.
    """
    too_long_prompt = few_tokens = 0
    for i, c in enumerate(conversations):
        _, mask = tokenizer.encode_chat(c["messages"], add_generation_prompt=False)
        kept = [False] + [bool(m) for m in mask[1:max_length]]  # position 0 is never predicted
        if sum(kept) >= min_loss_tokens:
            return i
        if not any(kept) and any(mask[max_length:]):
            too_long_prompt += 1
        else:
            few_tokens += 1
    raise ValueError(
        f"every one of the {len(conversations)} training conversations is filtered out: after the chat "
        f"template and truncation to data.max_length={max_length}, none keeps data.min_loss_tokens="
        f"{min_loss_tokens} assistant tokens ({too_long_prompt} have no answer token before position "
        f"{max_length}, {few_tokens} have fewer answer tokens than that). Raise data.max_length or lower "
        "data.min_loss_tokens.")


def make_dataset(
    conversations: Sequence[dict],
    tokenizer: ChatEncoder,
    *,
    max_length: int,
    per_host_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    min_loss_tokens: int = 1,
    num_threads: int = 2,
    prefetch_buffer_size: int = 16,
    num_workers: int = 0,
    pack: bool = False,
    pack_bins: int = 0,
    pack_length: int = 0,
) -> grain.IterDataset:
    """The grain graph over an in-memory list of normalised conversations (see module doc); ``pack_length``:
    packed rows' length (0 = ``max_length``; each conversation is truncated to ``max_length`` either way)."""
    if not conversations:
        raise ValueError("make_dataset: the conversation list is empty")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, process_count={process_count})")
    if per_host_batch_size < 1:
        raise ValueError(f"per_host_batch_size must be >= 1, got {per_host_batch_size}")
    check_some_row_usable(conversations, tokenizer, max_length, min_loss_tokens)
    row_length = check_pack_length(pack_length, max_length) if pack else max_length
    ds = grain.MapDataset.range(len(conversations))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs if num_epochs else None)
    ds = ds[process_index::process_count]
    ds = ds.map(_Encode(conversations, tokenizer, max_length, min_loss_tokens, pad=not pack))
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    it_ds = ds.to_iter_dataset(read)  # drops the None rows
    if pack:
        it_ds = pack_rows(it_ds, row_length, pack_bins or per_host_batch_size, extra_keys=("record_index",))
    it_ds = it_ds.batch(per_host_batch_size, drop_remainder=True)
    if num_workers > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags; outside an absl
            flags.FLAGS.mark_as_parsed()  # app (tests, notebooks) their defaults are what we want
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return it_ds


def make_train_iterator(
    config,
    tokenizer: ChatEncoder,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
    conversations: Sequence[dict] | None = None,
) -> grain.DatasetIterator:
    """This host's batch iterator; ``get_state()``/``set_state()`` checkpoint its exact position.

    ``config`` is the data config (``default_data_config()``) or a full config holding it as
    ``.data``. ``conversations`` skips reading ``config.train_files`` (already loaded).
    The returned object is grain's own ``DatasetIterator``, which orbax saves through
    ``grain.checkpoint.CheckpointSave`` / restores with ``CheckpointRestore``.
    """
    cfg = _data_cfg(config)
    if cfg.global_batch_size % process_count:
        raise ValueError(
            f"data.global_batch_size={cfg.global_batch_size} is not divisible by "
            f"process_count={process_count}"
        )
    if conversations is None:
        conversations, report = formats.load_conversations(
            train_files(cfg),
            on_bad_record=cfg.on_bad_record,
            max_records=cfg.max_records or None,
        )
        log.info("training data: %s", report.summary())
    ds = make_dataset(
        conversations,
        tokenizer,
        max_length=cfg.max_length,
        per_host_batch_size=cfg.global_batch_size // process_count,
        process_index=process_index,
        process_count=process_count,
        seed=seed,
        shuffle=cfg.shuffle,
        num_epochs=cfg.num_epochs or None,
        min_loss_tokens=cfg.min_loss_tokens,
        num_threads=cfg.num_threads,
        prefetch_buffer_size=cfg.prefetch_buffer_size,
        num_workers=cfg.num_workers,
        pack=bool(cfg.get("pack", False)),
        pack_bins=int(cfg.get("pack_bins", 0)),
        pack_length=int(cfg.get("pack_length", 0)),
    )
    return iter(ds)
