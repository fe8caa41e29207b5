"""Offline target features: what EAGLE-3's objective reads from the frozen target, stored on disk.

EAGLE-3 training needs from the target only, per token, the three feature taps h_cat and the
teacher over the draft vocabulary (docs/DESIGN.md §4 "Training objective"). Computing them is one
target forward per step; storing them once (as SpecForge's and speculators' offline modes do) lets
every epoch skip it. ``launch.target_features`` writes a store; :class:`FeatureStore` is a grain
random-access source over it; ``confu_loss`` uses a batch's stored features instead of the target
pass when the batch carries them (``config.data.target_features``).

Layout of a store directory::

    index.json                 format version, the settings the rows were made with, the shards
    draft_vocab.npz            d2t / t2d: the teacher is renormalised over exactly this vocabulary
    shard_00000.safetensors    rows r0..r1-1, token-major (one row = one conversation, unpadded)
    ...

A shard holds, for its T tokens (rows concatenated) and R rows (``safetensors``, read lazily with
``safe_open``, so a row costs only its own bytes):

    ==================  ==========  ==============  ==========================================
    tensor              shape       dtype           meaning
    ==================  ==========  ==============  ==========================================
    tokens              [T]         int32           the conversation's tokens
    loss_mask           [T]         uint8           answer tokens to predict
    h_cat               [T, 3d]     bfloat16 (1)    hidden states entering the tapped layers
    teacher_topk_logp   [T, k]      bfloat16 (1)    top-k log p_teacher over the draft vocab
    teacher_topk_ids    [T, k]      uint16 (2)      their draft ids
    teacher_argmax      [T]         int32           target's full-vocabulary argmax
    teacher_lse_draft   [T]         float32         log-sum-exp of the logits at the d2t columns
    teacher_lse_full    [T]         float32         log-sum-exp of the full-vocabulary logits
    row_offsets         [R+1]       int64           row i = tokens row_offsets[i]:row_offsets[i+1]
    ==================  ==========  ==============  ==========================================

(1) ``--dtype`` (bfloat16 default; float32 for bit-level checks). (2) int32 when V_draft > 65536.

**Bytes per token** (:func:`bytes_per_token`), with s = bytes of the stored float dtype (2 for
bf16) and i = bytes of a draft id (2 for V_draft <= 65536):

    3d·s + k·(s + i) + 4 (argmax) + 8 (two log-sum-exps) + 4 (token) + 1 (loss mask)

SmolLM2-135M (d = 576), k = 64, bf16: 3456 + 256 + 17 = 3729 B/token = 3.73 GB per million tokens;
Llama-3.1-8B (d = 4096): 24576 + 256 + 17 = 24849 B/token = 24.8 GB per million tokens (plus
8·(R+1) bytes of row offsets per shard). The taps dominate; the teacher's top-k is < 10 %.

Writing is resumable: a shard is written to a temporary name and renamed, then the index is
rewritten (also atomically), so a store is always a prefix of its rows and a re-run with the same
settings continues after the last complete shard; different settings are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from confu_jax import storage

FORMAT = "confu_jax.target_features"
FORMAT_VERSION = 1
INDEX = "index.json"
VOCAB = "draft_vocab.npz"
ROW_KEYS = ("tokens", "loss_mask", "h_cat", "teacher_topk_logp", "teacher_topk_ids", "teacher_argmax",
            "teacher_lse_draft", "teacher_lse_full")
STORED_DTYPES = ("bfloat16", "float32")


def float_dtype(name: str) -> np.dtype:
    """numpy dtype of a stored float name; bfloat16 is the ml_dtypes type jax itself uses."""
    if name == "bfloat16":
        import jax.numpy as jnp

        return np.dtype(jnp.bfloat16)
    if name == "float32":
        return np.dtype(np.float32)
    raise ValueError(f"target features dtype must be one of {STORED_DTYPES}, got {name!r}")


def id_dtype(draft_vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if draft_vocab_size <= 65536 else np.int32)


def bytes_per_token(d_model: int, top_k: int, draft_vocab_size: int, dtype: str = "bfloat16",
                    n_taps: int = 3) -> int:
    """Exact stored bytes per token (module doc formula; row offsets excluded)."""
    s = float_dtype(dtype).itemsize
    i = id_dtype(draft_vocab_size).itemsize
    return n_taps * d_model * s + top_k * (s + i) + 4 + 8 + 4 + 1


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes per token of the target's per-layer K and V (what ConFu's contemplates attend), if stored."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What the rows were made with; a resumed or reused store must match it exactly."""

    target_fingerprint: str
    source: str
    max_length: int
    top_k: int
    dtype: str
    d_model: int
    taps: tuple
    draft_vocab_size: int
    vocab_size: int

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), taps=list(self.taps))


def _atomic_write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _local_store(directory: str) -> None:
    """A store lives on a local disk: training memory-maps its shards (safetensors' ``safe_open``) and
    reads rows at random, which an object store cannot serve; refused in one line, before any work."""
    if storage.is_remote(directory):
        raise ValueError(f"{directory}: a target-features store must be on a local disk (training memory-maps "
                         "its shards); write it locally, and copy the folder to keep it (gcloud storage cp -r)")


def _read_index(directory: str) -> dict:
    _local_store(directory)
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no target-feature index (write one with python -m launch.target_features)")
    with open(path) as f:
        idx = json.load(f)
    if idx.get("format") != FORMAT or idx.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, found "
                         f"{idx.get('format')!r} version {idx.get('version')}")
    return idx


class FeatureWriter:
    """Appends rows to a store, one shard per ``rows_per_shard`` rows; resumes a matching store."""

    def __init__(self, directory: str, settings: StoreSettings, vocab, rows_per_shard: int = 256):
        """``vocab``: the ``DraftVocab`` the teacher is renormalised over (saved beside the shards)."""
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        _local_store(directory)
        self.directory, self.settings, self.rows_per_shard = directory, settings, int(rows_per_shard)
        os.makedirs(directory, exist_ok=True)
        vocab_path = os.path.join(directory, VOCAB)
        if os.path.exists(os.path.join(directory, INDEX)):
            idx = _read_index(directory)
            if idx["settings"] != settings.to_json():
                diff = {k: (idx["settings"].get(k), v) for k, v in settings.to_json().items()
                        if idx["settings"].get(k) != v}
                raise ValueError(f"{os.path.join(directory, INDEX)}: the store was written with other settings "
                                 f"(stored, requested): {diff}; use a new directory")
            with np.load(vocab_path) as z:
                if not np.array_equal(z["d2t"], vocab.d2t):
                    raise ValueError(f"{vocab_path}: the stored draft vocabulary differs from this run's")
            self.shards = list(idx["shards"])
        else:
            vocab.save(vocab_path)
            self.shards = []
            self._write_index()
        self._pending: list[dict] = []

    @property
    def rows_done(self) -> int:
        """Rows in complete shards (a resumed run skips this many)."""
        return sum(s["rows"] for s in self.shards)

    def _write_index(self) -> None:
        _atomic_write_json(os.path.join(self.directory, INDEX), {
            "format": FORMAT, "version": FORMAT_VERSION, "settings": self.settings.to_json(),
            "rows": self.rows_done, "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards,
            "bytes_per_token": bytes_per_token(self.settings.d_model, self.settings.top_k,
                                               self.settings.draft_vocab_size, self.settings.dtype,
                                               len(self.settings.taps))})

    def add(self, row: dict) -> None:
        """One unpadded row: every :data:`ROW_KEYS` array with the same leading length."""
        n = len(row["tokens"])
        for k in ROW_KEYS:
            if k not in row or len(row[k]) != n:
                raise ValueError(f"target-feature row: {k!r} missing or not of length {n} "
                                 f"(keys {sorted(row)})")
        self._pending.append(row)
        if len(self._pending) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        """Write the pending rows as one shard (atomic) and update the index."""
        if not self._pending:
            return
        from safetensors.numpy import save_file

        fd, i = float_dtype(self.settings.dtype), id_dtype(self.settings.draft_vocab_size)
        casts = {"tokens": np.int32, "loss_mask": np.uint8, "h_cat": fd, "teacher_topk_logp": fd,
                 "teacher_topk_ids": i, "teacher_argmax": np.int32, "teacher_lse_draft": np.float32,
                 "teacher_lse_full": np.float32}
        arrays = {k: np.ascontiguousarray(np.concatenate([np.asarray(r[k]) for r in self._pending]).astype(casts[k]))
                  for k in ROW_KEYS}
        lengths = [len(r["tokens"]) for r in self._pending]
        arrays["row_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        name = f"shard_{len(self.shards):05d}.safetensors"
        path = os.path.join(self.directory, name)
        save_file(arrays, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.shards.append({"file": name, "rows": len(lengths), "tokens": int(sum(lengths))})
        self._pending = []
        self._write_index()


class FeatureStore:
    """Random-access rows of a store, padded to ``max_length`` (a grain data source).

    ``store[i]`` is the i-th row as the batch dict ``confu_loss`` reads: 'tokens', 'loss_mask',
    'attention_mask' and the offline keys ('h_cat', 'teacher_*'), padded to the store's
    ``max_length``. Shards are opened lazily per process (the object pickles to grain workers).
    """

    def __init__(self, directory: str):
        self.directory = directory
        idx = _read_index(directory)
        self.settings = StoreSettings(**dict(idx["settings"], taps=tuple(idx["settings"]["taps"])))
        self.shards = idx["shards"]
        self._starts = np.concatenate([[0], np.cumsum([s["rows"] for s in self.shards])]).astype(np.int64)
        self._open: dict = {}

    def __getstate__(self):
        return dict(self.__dict__, _open={})

    @property
    def max_length(self) -> int:
        return self.settings.max_length

    def __len__(self) -> int:
        return int(self._starts[-1])

    def draft_vocab(self):
        """The draft vocabulary the teacher was renormalised over (training must use this one)."""
        from confu_jax.data.draft_vocab import DraftVocab

        return DraftVocab.load(os.path.join(self.directory, VOCAB))

    def _shard(self, s: int):
        if s not in self._open:
            from safetensors import safe_open

            self._open[s] = safe_open(os.path.join(self.directory, self.shards[s]["file"]), framework="numpy")
        return self._open[s]

    def row(self, i: int) -> dict:
        """Row i unpadded (its true length)."""
        if not 0 <= i < len(self):
            raise IndexError(f"target-feature row {i} outside [0, {len(self)}) in {self.directory}")
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        f = self._shard(s)
        offsets = f.get_slice("row_offsets")
        j = i - int(self._starts[s])
        lo, hi = (int(x) for x in offsets[j:j + 2])
        return {k: f.get_slice(k)[lo:hi] for k in ROW_KEYS}

    def unpadded(self, i) -> dict:
        """Row i at its own length with the batch's dtypes (tokens and ids int32, loss mask bool)."""
        r = self.row(int(i))
        casts = {"tokens": np.int32, "loss_mask": bool, "teacher_topk_ids": np.int32}
        return {k: np.asarray(v).astype(casts[k]) if k in casts else np.asarray(v) for k, v in r.items()}

    def __getitem__(self, i) -> dict:
        r = self.unpadded(i)
        n, pad = len(r["tokens"]), self.max_length - len(r["tokens"])
        out = {k: np.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) for k, v in r.items()}
        out["attention_mask"] = np.arange(self.max_length) < n
        out["record_index"] = np.int32(i)  # the store row: audits of what a run read (train.log_records)
        return out


class UnpaddedRows:
    """The store's rows at their own lengths (a grain source for the packer): ``store.unpadded(i)``."""

    def __init__(self, store: FeatureStore):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i) -> dict:
        r = self.store.unpadded(i)
        r["record_index"] = np.full(len(r["tokens"]), int(i), np.int32)  # packed with the tokens
        return r


def feature_dataset(store: FeatureStore, *, per_host_batch_size: int, process_index: int = 0,
                    process_count: int = 1, seed: int = 0, shuffle: bool = True,
                    rows: Optional[range] = None, pack: bool = False, pack_bins: int = 0, pack_length: int = 0):
    """The grain graph over a store: shuffle (seeded), repeat, host slice, [pack,] batch — the same
    shape as ``data.pipeline.make_dataset``, so its iterator state checkpoints the same way.

    ``pack``: several stored conversations per row of ``pack_length`` (0: the store's ``max_length``;
    grain's first-fit packer, ``pack_bins`` rows in flight, 0 = the batch size), every stored feature packed with its tokens,
    plus ``segment_ids`` and ``positions``. A conversation's features were computed on it alone,
    which is what the target computes for it inside a packed row (attention within its segment,
    positions restarting at 0), so packing changes no trained value, only the padding skipped."""
    import grain

    from confu_jax.data import pipeline

    ds = grain.MapDataset.source(UnpaddedRows(store) if pack else store)
    if rows is not None:
        ds = ds[rows.start:rows.stop]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None)[process_index::process_count].to_iter_dataset()
    if pack:
        ds = pipeline.pack_rows(ds, pipeline.check_pack_length(pack_length, store.max_length),
                                pack_bins or per_host_batch_size,
                                extra_keys=ROW_KEYS[2:] + ("record_index",))
    return ds.batch(per_host_batch_size, drop_remainder=True)
