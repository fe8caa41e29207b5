"""Minimal safetensors reader/writer on numpy memory maps.

Written here rather than through ``safetensors.numpy`` because that API has no bfloat16 (Llama-3
checkpoints are bf16) and because the loader wants each tensor's declared dtype and shape before
touching its bytes, to report a wrong dtype by tensor name. Format: u64 little-endian header size,
JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from confu_jax.weights.errors import CheckpointError

# safetensors dtype tag -> numpy dtype (float types a Llama checkpoint may hold).
FLOAT_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NP_TO_TAG = {v: k for k, v in FLOAT_DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: header parsed at open, tensors mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > os.path.getsize(path):
                raise CheckpointError(f"{path}: header length {n} exceeds the file size; not a safetensors file")
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._data_start = 8 + n

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
        return np.memmap(self.path, dtype=dt, mode="r", offset=self._data_start + begin, shape=shape)


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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in order:
            f.write(arr.tobytes())
