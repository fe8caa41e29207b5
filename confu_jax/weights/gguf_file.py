"""Fast GGUF container parsing (header, metadata, tensor directory) on one memory map.

``gguf.GGUFReader`` builds a numpy view per metadata array element, which takes ~10 s for the
98k strings of SmolLM2's vocabulary and merges; this reads them with ``struct`` in well under a
second. Tensor bytes stay memory-mapped and are dequantised by ``gguf.quants`` on request.
Format (v2/v3, little-endian): magic, version, tensor count, kv count, kv pairs, tensor infos,
padding to ``general.alignment``, tensor data.

A damaged file fails in the constructor with a ``CheckpointError`` naming the file, the part being
read (metadata key, tensor info, tensor data), the byte range it needs and the file's size: every
read is bounds-checked before it happens, and every tensor's data range is checked against the
file size once the directory is read, so nothing later reads past the end of the map.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

import numpy as np

from confu_jax.weights.errors import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata kv count
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp rejects tensor infos with more


class TensorInfo(NamedTuple):
    name: str
    dims: tuple  # GGUF order (fastest-varying first); numpy shape is reversed(dims)
    ggml_type: int
    offset: int  # absolute byte offset in the file


def _min_size(vtype: int) -> int:
    """Fewest bytes a value of ``vtype`` can take (to reject absurd array counts before looping)."""
    if vtype in _SCALARS:
        return struct.calcsize(_SCALARS[vtype])
    return {_STRING: 8, _ARRAY: 12}.get(vtype, 1)


def tensor_nbytes(ggml_type: int, dims: tuple):
    """Bytes of a tensor's data, or None for a GGML type id ``gguf`` does not know.

    Raises ``ValueError`` when the row length (``dims[0]``) is not a multiple of the type's block.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in dims:
        n *= int(d)
    if dims and int(dims[0]) % block:
        raise ValueError(f"row length {dims[0]} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


class GGUFContainer:
    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        if self.size == 0:
            raise CheckpointError(f"{path}: file is empty (0 bytes); expected a GGUF file starting with b'GGUF'")
        with open(path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # e.g. emptied between the size check and the map
                raise CheckpointError(f"{path}: cannot memory-map the file ({e})") from e
        try:
            self._read_header()
        except BaseException:
            self._mm.close()
            raise

    def _read_header(self) -> None:
        path, buf, size = self.path, self._mm, self.size
        magic = bytes(buf[:4])
        if magic != b"GGUF":
            if size < 4 and b"GGUF".startswith(magic):
                raise CheckpointError(f"{path}: truncated GGUF: the file has {size} bytes, not even the 4-byte magic b'GGUF'")
            raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        if size < _HEADER.size:
            raise CheckpointError(
                f"{path}: truncated GGUF header: magic, version, tensor count and metadata count need "
                f"bytes [0, {_HEADER.size}) but the file has {size} bytes"
            )
        _, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version}; expected 2 or 3 (little-endian)")
        try:
            self._parse(n_tensors, n_kv)
        except struct.error as e:  # every read is bounds-checked first; this would be a bug here
            raise CheckpointError(f"{path}: corrupt GGUF while reading {self._where} at byte {self._pos} ({e})") from e
        self._check_tensor_data()

    def _parse(self, n_tensors: int, n_kv: int) -> None:
        path = self.path
        self._pos = _HEADER.size
        self.fields: dict = {}
        for i in range(n_kv):
            self._where = f"metadata entry {i + 1} of {n_kv}"
            key = self._string()
            self._where = f"metadata key {key!r} (entry {i + 1} of {n_kv})"
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        prev = None
        for i in range(n_tensors):
            self._where = f"tensor info {i + 1} of {n_tensors}" + (f" (after {prev!r})" if prev else "")
            name = self._string()
            self._where = f"tensor info for {name!r} ({i + 1} of {n_tensors})"
            (n_dims,) = self._unpack("<I")
            if n_dims > _MAX_DIMS:
                raise CheckpointError(
                    f"{path}: corrupt GGUF: {self._where} has {n_dims} dimensions; expected at most {_MAX_DIMS}"
                )
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
            prev = name
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise CheckpointError(f"{path}: general.alignment is {align!r}; expected a positive power of two")
        self.data_start = self._pos + (-self._pos % align)
        self.tensors = {n: TensorInfo(n, d, t, self.data_start + o) for n, d, t, o in infos}
        if len(self.tensors) != len(infos):
            raise CheckpointError(f"{path}: duplicate tensor names in the tensor directory")

    def _check_tensor_data(self) -> None:
        """Every tensor's bytes must lie inside the file (a cut file names the first tensor it cuts)."""
        from gguf import GGMLQuantizationType

        path, size = self.path, self.size
        past_end = []
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            shape = tuple(reversed(t.dims))
            try:
                nbytes = tensor_nbytes(t.ggml_type, t.dims)
            except ValueError as e:
                raise CheckpointError(f"{path}: tensor {t.name!r} with shape {shape}: {e}") from e
            if nbytes is None:  # unknown type: GGUFFile.tensor reports it if the tensor is used
                continue
            end = t.offset + nbytes
            if end > size:
                past_end.append((t, nbytes, end, shape))
        if past_end:
            t, nbytes, end, shape = past_end[0]
            kind = GGMLQuantizationType(t.ggml_type).name
            later = f"; {len(past_end) - 1} more tensor(s) lie past the end" if len(past_end) > 1 else ""
            raise CheckpointError(
                f"{path}: truncated GGUF: tensor {t.name!r} ({kind}, shape {shape}, {nbytes} bytes) needs bytes "
                f"[{t.offset}, {end}) but the file has {size} bytes{later}"
            )

    def _need(self, n: int) -> None:
        if n > self.size - self._pos:
            raise CheckpointError(
                f"{self.path}: truncated or corrupt GGUF: {self._where} needs bytes "
                f"[{self._pos}, {self._pos + n}) but the file has {self.size} bytes"
            )

    def _unpack(self, fmt: str) -> tuple:
        n = struct.calcsize(fmt)
        self._need(n)
        out = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += n
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        self._need(n)
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
            self._need(count * _min_size(itype))
            if itype in _SCALARS:  # numeric arrays in one read
                fmt = _SCALARS[itype]
                arr = np.frombuffer(self._mm, np.dtype(fmt), count, self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        raise CheckpointError(f"{self.path}: corrupt GGUF: {self._where} has unknown value type {vtype} at byte {self._pos}")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """Tensor bytes as ``gguf.quants.dequantize`` expects them (typed for F32/F16, else uint8 rows).

        The byte range was checked against the file size in the constructor."""
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
