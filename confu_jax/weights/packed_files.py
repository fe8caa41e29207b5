"""Weight files stored xz-compressed (``model.safetensors.xz``), as head releases keep them in git.

Why: a call to a lent accelerator machine sends the whole working tree, 64 MiB at most
(releases/README.md, experiments/GPU_CAMPAIGN.md). Four bf16 heads of 15 MB each had filled it; xz
stores the same bytes in ~10.3 MB (bf16 weights: the exponent byte compresses, the mantissa byte does
not). The stream is plain xz (``xz -d model.safetensors.xz`` gives the file back, bit for bit); the
LZMA2 options ``lc=0, lp=1, pb=1`` tell the coder the data comes in 2-byte units.

Readers never see the packing: ``local(path)`` is ``path`` when the plain file is there and otherwise
the unpacked copy of ``path + ".xz"`` in a cache keyed by the packed file's sha256 (``~/.cache/
confu_jax/unpacked``, or ``CONFU_JAX_UNPACKED``), written once, atomically. Hash checks stay where they
were: a release manifest lists the packed file's sha256 and the unpacked file's (``runs.head_release``).
"""

from __future__ import annotations

import hashlib
import lzma
import os
import tempfile

from confu_jax import storage

SUFFIX = ".xz"
FILTERS = ({"id": lzma.FILTER_LZMA2, "preset": 9, "lc": 0, "lp": 1, "pb": 1},)
_CHUNK = 1 << 20


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("CONFU_JAX_UNPACKED") or "~/.cache/confu_jax/unpacked")


def pack(path: str) -> str:
    """Compress the local file ``path`` into ``path + ".xz"`` (atomic) and remove ``path`` -> the packed path."""
    out = path + SUFFIX
    with open(path, "rb") as f:
        data = lzma.compress(f.read(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=FILTERS)
    with open(out + ".tmp", "wb") as g:
        g.write(data)
    os.replace(out + ".tmp", out)
    os.remove(path)
    return out


def _unpacked_chunks(packed: str):
    """What ``packed`` (local or remote) decompresses to, a chunk at a time."""
    with storage.open(packed, "rb") as f, lzma.open(f, "rb") as z:
        while chunk := z.read(_CHUNK):
            yield chunk


def unpacked_digest(packed: str) -> tuple[str, int]:
    """sha256 and size of what ``packed`` decompresses to, streamed."""
    h, n = hashlib.sha256(), 0
    for chunk in _unpacked_chunks(packed):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def local(path: str) -> str:
    """``path`` if that file exists, else the unpacked cache copy of ``path + ".xz"`` where that exists,
    else ``path`` (the caller's own 'missing' error then names it)."""
    if storage.isfile(path) or not storage.isfile(path + SUFFIX):
        return path
    digest, _ = storage.sha256_file(path + SUFFIX)
    dest_dir = os.path.join(cache_root(), digest[:32])
    dest = os.path.join(dest_dir, os.path.basename(path))
    if os.path.isfile(dest):
        return dest
    os.makedirs(dest_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".unpacking-")
    try:
        with os.fdopen(fd, "wb") as g:
            for chunk in _unpacked_chunks(path + SUFFIX):
                g.write(chunk)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def exists(path: str) -> bool:
    """Whether ``path`` or its packed form is there."""
    return storage.isfile(path) or storage.isfile(path + SUFFIX)
