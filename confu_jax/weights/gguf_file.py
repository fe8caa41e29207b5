"""Fast GGUF container parsing (header, metadata, tensor directory) on one memory map.

``gguf.GGUFReader`` builds a numpy view per metadata array element, which takes ~10 s for the
98k strings of SmolLM2's vocabulary and merges; this reads them with ``struct`` in well under a
second. Tensor bytes stay memory-mapped and are dequantised by ``gguf.quants`` on request.
Format (v2/v3, little-endian): magic, version, tensor count, kv count, kv pairs, tensor infos,
padding to ``general.alignment``, tensor data.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

import numpy as np

from confu_jax.weights.errors import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class TensorInfo(NamedTuple):
    name: str
    dims: tuple  # GGUF order (fastest-varying first); numpy shape is reversed(dims)
    ggml_type: int
    offset: int  # absolute byte offset in the file


class GGUFContainer:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version}; expected 2 or 3 (little-endian)")
        try:
            self._parse(n_tensors, n_kv)
        except (struct.error, ValueError) as e:  # reads past the end: truncated or corrupt
            raise CheckpointError(f"{path}: corrupt or truncated GGUF header ({e})") from None

    def _parse(self, n_tensors: int, n_kv: int) -> None:
        path = self.path
        self._pos = 24
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = self._pos + (-self._pos % align)
        self.tensors = {n: TensorInfo(n, d, t, data_start + o) for n, d, t, o in infos}
        if len(self.tensors) != len(infos):
            raise CheckpointError(f"{path}: duplicate tensor names in the tensor directory")

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = self._mm[self._pos:self._pos + n].decode("utf-8", errors="surrogateescape")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._unpack("<IQ")
            if itype in _SCALARS:  # numeric arrays in one read
                fmt = _SCALARS[itype]
                arr = np.frombuffer(self._mm, np.dtype(fmt), count, self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """Tensor bytes as ``gguf.quants.dequantize`` expects them (typed for F32/F16, else uint8 rows)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

        qtype = Q(info.ggml_type)
        shape = tuple(reversed(info.dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64))
        if qtype == Q.F32:
            return np.frombuffer(self._mm, np.float32, n, info.offset).reshape(shape)
        if qtype == Q.F16:
            return np.frombuffer(self._mm, np.float16, n, info.offset).reshape(shape)
        row_bytes = shape[-1] // block * type_size
        return np.frombuffer(self._mm, np.uint8, n // block * type_size, info.offset).reshape(shape[:-1] + (row_bytes,))
