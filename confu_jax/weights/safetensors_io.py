"""Minimal safetensors reader/writer on numpy memory maps.

Written here rather than through ``safetensors.numpy`` because that API has no bfloat16 (Llama-3
checkpoints are bf16) and because the loader wants each tensor's declared dtype and shape before
touching its bytes, to report a wrong dtype by tensor name. Format: u64 little-endian header size,
JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

from confu_jax import storage
from confu_jax.weights.errors import CheckpointError

# safetensors dtype tag -> numpy dtype (float types a Llama checkpoint may hold).
FLOAT_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NP_TO_TAG = {v: k for k, v in FLOAT_DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: header parsed at open, tensors mapped on demand
    (memory maps on a local disk, :class:`RemoteTensor` byte-range reads on an object store)."""

    def __init__(self, path: str):
        self.path = path
        raw = storage.read_range(path, 0, 8)  # ranged reads: an object store sends the header, not the file
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > storage.getsize(path):
            raise CheckpointError(f"{path}: header length {n} exceeds the file size; not a safetensors file")
        try:
            header = json.loads(storage.read_range(path, 8, n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header does not parse ({e}); a damaged file") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self.data_start = 8 + n  # byte offset of the tensors (their data_offsets count from here)
        need = self.data_start + max((int(h["data_offsets"][1]) for h in header.values()), default=0)
        size = storage.getsize(path)
        if size < need:
            # else a tensor past the end fails later as numpy's "mmap length is greater than file size"
            raise CheckpointError(f"{path}: truncated: its header describes {need} bytes, the file has {size} "
                                  "(an interrupted download or copy?)")

    def names(self) -> list:
        return list(self.header)

    def info(self, name: str) -> tuple:
        """(dtype tag, shape) as declared in the header."""
        h = self.header[name]
        return h["dtype"], tuple(h["shape"])

    def get(self, name: str) -> np.ndarray:
        tag, shape = self.info(name)
        if tag not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {tag}; expected one of {sorted(FLOAT_DTYPES)} "
                "(quantised or integer safetensors checkpoints are not supported)"
            )
        begin, end = self.header[name]["data_offsets"]
        dt = FLOAT_DTYPES[tag]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dt.itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} spans {end - begin} bytes; shape {shape} x {tag} needs "
                f"{count * dt.itemsize}"
            )
        if storage.is_remote(self.path):
            return RemoteTensor(self.path, dt, self.data_start + begin, shape)
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + begin, shape=shape)


class RemoteTensor:
    """A tensor of a safetensors file on an object store, read on indexing: ``x[a:b, ...]`` fetches
    rows ``a:b`` of the leading axis (one ranged GET) and cuts the other axes after, so a process
    loading its devices' slices of a row-sharded weight reads only those rows. What the sharded
    loader needs of a memory map: ``shape``, ``dtype``, indexing, ``.T`` and ``np.asarray``; it keeps
    the rows it fetched for the devices that split the other axis (``reads_whole_rows``)."""

    reads_whole_rows = True  # a slice of a later axis costs the whole rows it spans

    def __init__(self, path: str, dtype: np.dtype, offset: int, shape: tuple):
        self.path, self.dtype, self.offset, self.shape = path, np.dtype(dtype), int(offset), tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def T(self) -> np.ndarray:  # noqa: N802 (numpy's name)
        return np.asarray(self).T

    def _rows(self, a: int, b: int) -> np.ndarray:
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        raw = storage.read_range(self.path, self.offset + a * row, (b - a) * row)
        if len(raw) != (b - a) * row:
            raise CheckpointError(f"{self.path}: expected {(b - a) * row} bytes at {self.offset + a * row}, "
                                  f"got {len(raw)} (truncated file?)")
        return np.frombuffer(raw, self.dtype).reshape((b - a,) + self.shape[1:])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self._rows(0, self.shape[0]) if self.shape else self._rows(0, 1).reshape(())
        return arr if dtype is None else arr.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        if self.shape and isinstance(first, slice):
            a, b, step = first.indices(self.shape[0])
            if step == 1 and b > a:
                return self._rows(a, b)[(slice(None),) + tuple(index[1:])]
        if self.shape and isinstance(first, (int, np.integer)):
            i = int(first) % self.shape[0]
            return self._rows(i, i + 1)[0][tuple(index[1:])]
        return np.asarray(self)[index]


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Write float32/float16/bfloat16 numpy arrays; ``metadata`` defaults to ``{"format": "pt"}``
    because transformers refuses safetensors files without a format tag."""
    header, offset, order = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NP_TO_TAG:
            raise CheckpointError(f"save {path}: tensor {name!r} has dtype {arr.dtype}; expected float32/16 or bfloat16")
        header[name] = {"dtype": _NP_TO_TAG[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        order.append(arr)
    header["__metadata__"] = metadata if metadata is not None else {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned
    with storage.open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in order:
            f.write(arr.tobytes())
