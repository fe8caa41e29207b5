"""Paths on a local disk or an object store (``gs://``, ``s3://``), one set of calls for both.

Why: TPU users keep checkpoints, data and run folders in Cloud Storage. Orbax already writes
checkpoints there (``etils.epath`` for files, TensorStore for arrays); everything else the package
reads or writes — a target's ``config.json`` and safetensors, conversation files, releases, a
workdir's ``config.json`` and metric CSVs — goes through these functions, which are the ``os`` /
``open`` calls on a local path (unchanged behaviour, no extra dependency on the hot path) and
``etils.epath`` (fsspec's ``gcsfs`` for ``gs://``) on a remote one.

What an object store lacks, and what is done instead:
  * no append: :func:`open` refuses ``'a'``; callers that append small files (metric CSVs) rewrite the
    object, which is atomic there (no ``.tmp`` + rename needed); a growing output (self-distilled
    JSONL) appends through :func:`append_text`, a server-side compose on ``gs://``;
  * no rename: a folder of several files (an exported head, a release) is written locally and
    published by :func:`staged_dir`, the file that says "complete" (manifest, config) last;
  * no ``flock``: ``runs.lock`` says so in one line and runs unlocked;
  * no memory map: ``weights.safetensors_io`` reads byte ranges (:func:`read_range`) instead.

Emulators (tests, local development): ``STORAGE_EMULATOR_HOST`` points ``gcsfs`` at one and
``TENSORSTORE_GCS_HTTP_URL`` (+ ``GOOGLE_AUTH_TOKEN_FOR_TESTING``) points TensorStore at it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import os
import re
import shutil
import tempfile
import uuid
from typing import IO, Iterator, Sequence

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


def require_backend(path) -> None:
    """Raise :class:`StorageError` (one line naming ``path`` and the install command) for a ``gs://``
    path on a machine without the cloud extra. Every remote call checks it; the CLIs check every
    ``gs://`` value on their command line before doing any work (:func:`remote_paths_in`), so a
    missing extra never leaves half an output behind."""
    if str(path).startswith("gs://") and not _gcs_backend_installed():
        raise StorageError(f"{path}: gs:// paths need gcsfs, which is not installed "
                           "(pip install -r requirements-cloud.txt)")


_REMOTE_IN_TEXT = re.compile(r"(?:gs|s3)://[^,;\s]*")


def remote_paths_in(args: Sequence[str]) -> list:
    """Every object-store URL in command-line words, wherever it sits in one: ``--out=gs://b/x``,
    ``gs://b/x`` after ``--out``, list items (``a.jsonl,gs://b/c``) and ``NAME=gs://...`` pairs."""
    return [m for a in args for m in _REMOTE_IN_TEXT.findall(str(a))]


def _epath(path):
    from etils import epath  # imported on first remote use: local runs never load gcsfs

    require_backend(path)
    return epath.Path(str(path))


def _fs(path):
    """(fsspec filesystem, key) of a remote path, for what ``epath`` does not offer (compose, ranges)."""
    import fsspec

    require_backend(path)
    return fsspec.core.url_to_fs(str(path))


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


def read_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_text(path, text: str) -> None:
    """The whole file at once: on a local disk through a temporary file and a rename, so a reader
    never sees half of it; an object store's write is atomic already."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path, data: bytes) -> None:
    """:func:`write_text` for bytes (a figure, a compressed part): durable (fsynced) before the
    rename on a local disk, one upload on an object store."""
    if is_remote(path):
        with open(path, "wb") as f:
            f.write(data)
        return
    makedirs(os.path.dirname(os.path.abspath(path)))
    tmp = f"{path}.{os.getpid()}.tmp"
    with builtins.open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_figure(path, fig, **savefig_kw) -> None:
    """A matplotlib figure as a PNG at ``path``, local or remote: rendered in memory, then written
    whole (:func:`write_bytes`), so a reader never finds half a figure. ``savefig_kw``: ``dpi``, ..."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kw)
    write_bytes(path, buf.getvalue())


def append_text(path, text: str) -> None:
    """Append ``text`` to ``path`` (created if absent) and make it durable before returning.

    Locally an ``'a'`` write and an fsync. An object cannot grow, and rewriting a 200 MB output for
    every conversation added would move 200 MB per conversation; on ``gs://`` the text is uploaded
    as its own object and composed onto the end of ``path`` (one server-side request that reads no
    byte back), then removed: a reader sees the object before or after the append, never a torn
    line. Other stores rewrite the object."""
    if not is_remote(path):
        with builtins.open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return
    data = text.encode("utf-8")

    def append():
        fs, key = _fs(path)
        if not fs.exists(key):
            fs.pipe_file(key, data)
        elif not str(path).startswith("gs://"):
            fs.pipe_file(key, fs.cat_file(key) + data)
        else:
            piece = f"{key}.append-{uuid.uuid4().hex}"
            fs.pipe_file(piece, data)
            try:
                fs.merge(key, [key, piece])
            finally:
                fs.rm_file(piece)
        fs.invalidate_cache(key)

    _guarded(path, "append", append)


def truncate(path, size: int) -> None:
    """Cut ``path`` to its first ``size`` bytes (a torn last line): locally in place, on an object
    store by rewriting the object."""
    if not is_remote(path):
        with builtins.open(path, "r+b") as f:
            f.truncate(size)
        return
    with open(path, "rb") as f:
        data = f.read(size)
    write_bytes(path, data)


def remove(path) -> None:
    """Delete the file ``path`` (absent already: nothing to do)."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return

    def rm():
        fs, key = _fs(path)
        if fs.exists(key):
            fs.rm_file(key)

    _guarded(path, "delete", rm)


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
        fs, key = _fs(path)
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


def sha256_file(path) -> tuple[str, int]:
    """(sha256 hex digest, bytes) of a file, read in 1 MiB blocks (releases' and manifests' hash checks)."""
    import hashlib

    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def getsize(path) -> int:
    return _guarded(path, "stat", lambda: _epath(path).stat().length) if is_remote(path) else os.path.getsize(path)


def files_under(path) -> list:
    """Paths of every file under the folder ``path``, relative to it (``/``-separated)."""
    if not is_remote(path):
        return sorted(os.path.relpath(os.path.join(d, n), path).replace(os.sep, "/")
                      for d, _, names in os.walk(path) for n in names)

    def walk():
        fs, key = _fs(path)
        root = key.rstrip("/") + "/"
        return sorted(k[len(root):] for k in fs.find(root) if k.startswith(root))

    return _guarded(path, "list", walk)


@contextlib.contextmanager
def staged_dir(dst, *, last: Sequence[str] = ("manifest.json", "config.json"), replace: bool = False
               ) -> Iterator[str]:
    """A local folder to write the folder ``dst`` into; what was written is published there when the
    block ends without an error, and nothing is published when it raises.

    Why: writers of a folder of files (an exported head, a release) use ``os`` / safetensors on a
    local path, and a folder of several objects cannot be renamed into place on a store. Publishing
    puts the other files first and the ``last`` ones (the file that says the folder is complete: a
    manifest, a config) after them, so a reader that finds those finds every file they name; the
    old ``last`` files of ``dst`` are deleted before anything else is written. ``replace``: files of
    ``dst`` that the new folder lacks are removed too (a release replaced as a whole). Locally the
    staging folder sits beside ``dst`` (same disk: files are moved by rename)."""
    if is_remote(dst):
        require_backend(dst)
        stage = tempfile.mkdtemp(prefix="confu_stage_")
    else:
        parent = os.path.dirname(os.path.abspath(dst))
        os.makedirs(parent, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dst))}.stage-", dir=parent)
    try:
        yield stage
        new = files_under(stage)
        order = [f for f in new if f not in last] + [f for f in last if f in new]
        old = files_under(dst) if isdir(dst) else []
        for name in last:
            if name in old:
                remove(os.path.join(dst, name))
        for name in order:
            src, out = os.path.join(stage, name), os.path.join(dst, name)
            if is_remote(dst):
                with builtins.open(src, "rb") as fi, open(out, "wb") as fo:
                    shutil.copyfileobj(fi, fo)
            else:
                os.makedirs(os.path.dirname(out), exist_ok=True)
                os.replace(src, out)
        if replace:
            for name in sorted(set(old) - set(new)):
                remove(os.path.join(dst, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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
