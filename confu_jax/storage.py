"""Paths on a local disk or an object store (``gs://``, ``s3://``), one set of calls for both.

Why: TPU users keep checkpoints, data and run folders in Cloud Storage. Orbax already writes
checkpoints there (``etils.epath`` for files, TensorStore for arrays); everything else the package
reads or writes — a target's ``config.json`` and safetensors, conversation files, releases, a
workdir's ``config.json`` and metric CSVs — goes through these functions, which are the ``os`` /
``open`` calls on a local path (unchanged behaviour, no extra dependency on the hot path) and
``etils.epath`` (fsspec's ``gcsfs`` for ``gs://``) on a remote one.

What an object store lacks, and what is done instead:
  * no append: :func:`open` refuses ``'a'``; callers that append (metric CSVs) rewrite the object,
    which is atomic there (no ``.tmp`` + rename needed);
  * no ``flock``: ``runs.lock`` says so in one line and runs unlocked;
  * no memory map: ``weights.safetensors_io`` reads byte ranges (:func:`read_range`) instead.

Emulators (tests, local development): ``STORAGE_EMULATOR_HOST`` points ``gcsfs`` at one and
``TENSORSTORE_GCS_HTTP_URL`` (+ ``GOOGLE_AUTH_TOKEN_FOR_TESTING``) points TensorStore at it.
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import os
import shutil
from typing import IO

REMOTE_SCHEMES = ("gs://", "s3://")


class StorageError(OSError):
    """An object store that cannot be reached or read (wrong bucket, no credentials, no network):
    one line naming the path, reported as a user's error by the CLIs."""


def _guarded(path, what: str, fn):
    """``fn()`` for the remote ``path``, its transport errors as one :class:`StorageError`."""
    try:
        return fn()
    except (FileNotFoundError, ValueError, StorageError):
        raise
    except Exception as e:  # gcsfs / aiohttp / google-auth errors: many types, one meaning here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StorageError(f"{path}: cannot {what} on the object store ({type(e).__name__}: {first}); check "
                           "the bucket name, the credentials (gcloud auth application-default login) and "
                           "the network") from e


def is_remote(path) -> bool:
    """True for an object-store URL (``gs://bucket/...``, ``s3://...``)."""
    return str(path).startswith(REMOTE_SCHEMES)


@functools.lru_cache(maxsize=None)
def _gcs_backend_installed() -> bool:
    return any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow"))


def _require_backend(path) -> None:
    if str(path).startswith("gs://") and not _gcs_backend_installed():
        raise StorageError(f"{path}: gs:// paths need gcsfs (pip install -r requirements-cloud.txt)")


def _epath(path):
    from etils import epath  # imported on first remote use: local runs never load gcsfs

    _require_backend(path)
    return epath.Path(str(path))


def absolute(path: str) -> str:
    """``os.path.abspath`` for a local path; a remote URL as given."""
    return str(path) if is_remote(path) else os.path.abspath(path)


def open(path, mode: str = "r", *, encoding: str | None = None, newline: str | None = None) -> IO:  # noqa: A001
    """``open``; on an object store text is UTF-8 and ``mode`` 'r' / 'w' (+ 'b') — an object has no
    append (rewrite it) and no other encodings."""
    if not is_remote(path):
        kw = {} if "b" in mode else {"encoding": encoding, "newline": newline}
        return builtins.open(path, mode, **kw)
    if "a" in mode or "+" in mode:
        raise ValueError(f"{path}: mode {mode!r}: an object store cannot append or update in place; "
                         "expected 'r', 'w', 'rb' or 'wb' (rewrite the whole object)")
    return _guarded(path, f"open ({mode!r})", lambda: _epath(path).open(mode))


def read_text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_text(path, text: str) -> None:
    """The whole file at once: on a local disk through a temporary file and a rename, so a reader
    never sees half of it; an object store's write is atomic already."""
    if is_remote(path):
        with open(path, "w") as f:
            f.write(text)
        return
    makedirs(os.path.dirname(os.path.abspath(path)))
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_range(path, start: int, length: int) -> bytes:
    """``length`` bytes of ``path`` from byte ``start``: on an object store one ranged GET of exactly
    those bytes. (Not through ``open``: a gcsfs file stats the object first and reads ahead a block of
    several MB on every read, so reading a checkpoint's slices through it fetched the file many times over.)"""
    if not is_remote(path):
        with builtins.open(path, "rb") as f:
            f.seek(start)
            return f.read(length)
    if length <= 0:
        return b""

    def fetch():
        import fsspec

        _require_backend(path)
        fs, key = fsspec.core.url_to_fs(str(path))
        return fs.cat_file(key, start=start, end=start + length)

    return _guarded(path, "read", fetch)


def exists(path) -> bool:
    return _guarded(path, "look", _epath(path).exists) if is_remote(path) else os.path.exists(path)


def isfile(path) -> bool:
    return _guarded(path, "look", _epath(path).is_file) if is_remote(path) else os.path.isfile(path)


def isdir(path) -> bool:
    """On an object store: some object lies under ``path/`` (its "folders" are prefixes)."""
    return _guarded(path, "look", _epath(path).is_dir) if is_remote(path) else os.path.isdir(path)


def listdir(path) -> list:
    """Entry names (not paths) in ``path``, as ``os.listdir``."""
    if not is_remote(path):
        return os.listdir(path)
    return _guarded(path, "list", lambda: [p.name for p in _epath(path).iterdir()])


def makedirs(path) -> None:
    """``os.makedirs(exist_ok=True)``; nothing to do on an object store (prefixes need no creation)."""
    if is_remote(path):
        return
    os.makedirs(path, exist_ok=True)


def getsize(path) -> int:
    return _guarded(path, "stat", lambda: _epath(path).stat().length) if is_remote(path) else os.path.getsize(path)


def copy_tree(src, dst) -> None:
    """Copy a folder (local or remote) to another (local or remote), file by file."""
    if not (is_remote(src) or is_remote(dst)):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        return
    makedirs(dst)
    for name in listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if isdir(s):
            copy_tree(s, d)
        else:
            with open(s, "rb") as fi, open(d, "wb") as fo:
                shutil.copyfileobj(fi, fo)
