"""Released datasets: conversations kept in the repository as append-only, hashed, compressed parts.

A release is a folder (``releases/data/<name>/``)::

    manifest.json          what the parts are, how they were made, and their hashes
    part-00000.jsonl.zst   zstandard-compressed JSON lines, one conversation a line, as
    part-00001.jsonl.zst   ``launch.generate_data`` writes them: {"id", "conversations": [{"role", "content"}]}
    ...

Why: machine state outside git is lost between sessions (twice a restart erased hours of
self-distilled data), so data that took hours of generation lives in the repository. Each part is at
most ``part_bytes`` compressed (10 MB by default: small enough for any git host), and a part is
never rewritten once released, so git stores every byte once and a clone can check what it got.

* **Append-only.** :func:`append_release` writes the conversations not yet released as new parts
  after the existing ones and then replaces the manifest atomically (tmp file + ``os.replace``; on
  ``gs://`` each object's upload is atomic, and the append runs unlocked, with a warning); an
  id already released is never added again, and existing parts are never opened for writing. A
  crash between a part and the manifest leaves a part the manifest does not list: it is not
  released, is ignored by readers and is overwritten by the next append.
* **Verified.** :func:`load_release` (and :func:`released_ids`, and training through
  ``data.formats``) first checks every part's sha256 against the manifest; a missing or changed part
  raises :class:`ReleaseHashError` naming the part, the expected and the found hash.
* **One recipe per release.** The manifest records the target (source and weights fingerprint,
  ``runs.heads.target_fingerprint``), the tokenizer, and the generation settings (temperature,
  top-p, max_new_tokens, max_prompt_len, max_turns, the chat template's kwargs and sha256, the
  generating command); appending data made
  with other settings or another target is refused (that is another release). Each part records its
  own generating command, the git commit at packing time and when it was written.

Manifest fields (``format_version`` 1)::

    format, format_version, name, conversations, answer_tokens, bytes, n_parts,   # totals at top
    target {model, fingerprint}, tokenizer, generation {command, settings...},
    created, updated,
    parts [{file, sha256, bytes, conversations, answer_tokens, first_id, last_id,
            git_commit, generation_command, created}]

``answer_tokens`` counts what training's loss sees: the assistant-mask tokens of the target's chat
template (each assistant turn's text and its end-of-turn token), ``launch.release_data`` counts
them with ``ChatTokenizer.encode_chat`` under the template kwargs the data was generated with.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import logging
import os
import subprocess
from typing import Callable, Iterable, Iterator, Optional

from confu_jax import storage

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "confu_jax.data_release"
FORMAT_VERSION = 1
PART_TEMPLATE = "part-{:05d}.jsonl.zst"
DEFAULT_PART_BYTES = 10 * 1000 * 1000  # 10 MB compressed
DEFAULT_LEVEL = 19
# Settings that define what the text is: appending data generated with other values is refused.
RECIPE_KEYS = ("model", "tokenizer", "dtype", "temperature", "top_p", "max_new_tokens", "max_prompt_len",
               "max_turns", "chat_template_kwargs", "chat_template_sha256")
# Recipe keys recorded only by later versions: what a release or run written before them used. The
# kwargs were none; the template was not hashed, so a missing hash matches any (None: not compared).
_RECIPE_DEFAULTS = {"chat_template_kwargs": {}, "chat_template_sha256": None}


def recipe_differences(a: dict, b: dict, keys=RECIPE_KEYS) -> dict:
    """``{key: (a's, b's)}`` for the recipe ``keys`` whose values differ (a key missing from a
    record written before it existed counts as its default; a missing template hash as any)."""
    out = {}
    for k in keys:
        x, y = a.get(k), b.get(k)
        if k in _RECIPE_DEFAULTS:
            x = _RECIPE_DEFAULTS[k] if x is None else x
            y = _RECIPE_DEFAULTS[k] if y is None else y
            if x is None or y is None:
                continue
        if x != y:
            out[k] = (x, y)
    return out
_ZSTD_BLOCK = 128 * 1024


class ReleaseError(ValueError):
    """A release folder that cannot be read or appended to as asked."""


class ReleaseHashError(ReleaseError):
    """A part listed in the manifest is missing or its bytes do not hash to the manifest's sha256."""


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - requirements.txt pins it
        raise ImportError("data releases need zstandard: pip install zstandard (pinned in requirements.txt)") from e
    return zstandard


# ----------------------------------------------------------------------------------------------
# Reading


def is_release(path: str) -> bool:
    """Whether ``path`` is a release folder (a directory holding ``manifest.json``)."""
    return storage.isfile(os.path.join(path, MANIFEST))


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not storage.isfile(path):
        raise ReleaseError(f"{directory}: not a data release (no {MANIFEST})")
    with storage.open(path, encoding="utf-8") as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise ReleaseError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ReleaseError(f"{path}: expected format {FORMAT!r}, found {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ReleaseError(f"{path}: format_version {manifest.get('format_version')!r}; this code reads {FORMAT_VERSION}")
    return manifest


def verify_release(directory: str, manifest: Optional[dict] = None) -> dict:
    """Check every part the manifest lists against its sha256 (and size); returns the manifest.

    Raises :class:`ReleaseHashError` naming the first part that is missing or differs, with the
    expected and the found hash.
    """
    manifest = manifest if manifest is not None else read_manifest(directory)
    for part in manifest["parts"]:
        path = os.path.join(directory, part["file"])
        if not storage.isfile(path):
            raise ReleaseHashError(
                f"{path}: part missing (the manifest expects sha256 {part['sha256']}, found no file)")
        found, n = storage.sha256_file(path)
        if found != part["sha256"]:
            raise ReleaseHashError(
                f"{path}: sha256 mismatch: the manifest expects {part['sha256']}, found {found} "
                f"({n} bytes, expected {part['bytes']}); released parts are never rewritten: restore it "
                f"(git checkout -- {path}) or re-fetch the release")
    return manifest


def _part_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line bytes without the newline) of one compressed part, streamed."""
    zstd = _zstd()
    with storage.open(path, "rb") as raw:
        reader = zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        text = io.BufferedReader(reader, buffer_size=1 << 20)
        for lineno, line in enumerate(text, start=1):
            if line.strip():
                yield lineno, line.rstrip(b"\n")


def iter_release_records(directory: str, verify: bool = True) -> Iterator[tuple[str, int, object, Optional[str]]]:
    """``(part path, line, record, error)`` for every line of every part, in release order.

    ``error`` is None for a decoded line, else why it failed (``record`` is then None); parts are
    written by :func:`append_release`, so an error means a part that was not. With ``verify``
    every part is checked against the manifest before the first line is read.
    """
    manifest = verify_release(directory) if verify else read_manifest(directory)
    for part in manifest["parts"]:
        path = os.path.join(directory, part["file"])
        if not storage.isfile(path):
            raise ReleaseHashError(f"{path}: part missing (the manifest expects sha256 {part['sha256']}, found no file)")
        n = 0
        for lineno, line in _part_lines(path):
            n += 1
            try:
                yield path, lineno, json.loads(line), None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield path, lineno, None, f"invalid JSON: {e}"
        if n != part["conversations"]:
            raise ReleaseError(f"{path}: {n} lines, the manifest says {part['conversations']} conversations")


def load_release(directory: str, verify: bool = True) -> Iterator[dict]:
    """The released conversations (records as generated: ``{"id", "conversations": [...]}``), in
    order, after checking every part's hash (``verify``). An undecodable line raises."""
    for path, lineno, record, error in iter_release_records(directory, verify=verify):
        if error is not None:
            raise ReleaseError(f"{path}:{lineno}: {error}")
        yield record


def released_ids(directory: str, verify: bool = True) -> set[str]:
    """Ids of every released conversation (empty for a folder with no manifest yet)."""
    if not is_release(directory):
        return set()
    return {str(rec["id"]) for rec in load_release(directory, verify=verify)}


# ----------------------------------------------------------------------------------------------
# Writing


def git_commit(path: Optional[str] = None) -> Optional[str]:
    """HEAD of the git checkout holding ``path`` (default: this package), or None outside git."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _write_atomic(path: str, data: bytes) -> None:
    """Durable and whole (``storage.write_bytes``: tmp file + fsync + rename locally, one upload on a store)."""
    storage.write_bytes(path, data)


def _fsync_dir(directory: str) -> None:
    if storage.is_remote(directory):  # an object store has no directory entries to make durable
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(directory: str):
    """One appender per release at a time (flock on the folder itself: no lock file to commit). An
    object store has no lock: the append says so and runs unlocked (as a ``gs://`` workdir does)."""
    if storage.is_remote(directory):
        log.warning("%s is on an object store, which cannot be locked: make sure no other process appends "
                    "to this release now", directory)
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise ReleaseError(f"{directory}: another process is appending to this release") from e
        yield
    finally:
        os.close(fd)  # releases the lock


def _frame_overhead(raw: int) -> int:
    """An upper bound on what zstd adds to ``raw`` bytes stored uncompressed: 3 bytes a block
    (<= 128 KiB each), the frame header and checksum, and an empty last block."""
    return 3 * (raw // _ZSTD_BLOCK + 2) + 32


def pack_parts(lines: list[bytes], part_bytes: int, level: int = DEFAULT_LEVEL) -> Iterator[tuple[bytes, int, int]]:
    """Split newline-terminated ``lines`` into zstd frames of at most ``part_bytes`` bytes each.

    Yields ``(frame, start, end)``: the frame holds ``lines[start:end]``. Streaming: the bytes a
    frame has emitted plus the raw bytes fed since the last flush bound its final size from above
    (zstd never stores a block larger than raw + its header); only when that bound would pass the
    limit is the pending data flushed as a block to learn the exact size, so a part is cut only
    where it is full. A single line that cannot fit in a part raises.
    """
    zstd = _zstd()
    cctx = zstd.ZstdCompressor(level=level, write_checksum=True)
    i = 0
    while i < len(lines):
        cobj = cctx.compressobj()
        out = bytearray()
        pending = 0  # raw bytes fed since the last flush
        start = i
        while i < len(lines):
            line = lines[i]
            bound = len(out) + pending + len(line) + _frame_overhead(pending + len(line))
            if bound > part_bytes and pending:
                out += cobj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK)
                pending = 0
                bound = len(out) + len(line) + _frame_overhead(len(line))
            if bound > part_bytes:
                if i == start:
                    raise ReleaseError(
                        f"one conversation ({len(line)} bytes of JSON) does not fit in a part of {part_bytes} "
                        "bytes; raise the part size")
                break
            out += cobj.compress(line)
            pending += len(line)
            i += 1
        out += cobj.flush()
        if len(out) > part_bytes:  # pragma: no cover - the bound above guarantees it
            raise AssertionError(f"part of {len(out)} bytes exceeds {part_bytes}")
        yield bytes(out), start, i


def new_manifest(name: str, *, target: dict, tokenizer: str, generation: dict) -> dict:
    now = _now()
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "name": name,
        "conversations": 0, "answer_tokens": 0, "bytes": 0, "n_parts": 0,
        "target": dict(target), "tokenizer": tokenizer, "generation": dict(generation),
        "created": now, "updated": now, "parts": [],
    }


def check_recipe(manifest: dict, *, target: dict, tokenizer: str, generation: dict) -> None:
    """Refuse data made by another target or with other generation settings than the release's."""
    problems = []
    have_fp, want_fp = manifest["target"].get("fingerprint"), target.get("fingerprint")
    if have_fp and want_fp and have_fp != want_fp:
        problems.append(f"target fingerprint {want_fp[:16]}... (release: {have_fp[:16]}...)")
    if not (have_fp and want_fp) and manifest["target"].get("model") != target.get("model"):
        problems.append(f"target {target.get('model')!r} (release: {manifest['target'].get('model')!r})")
    if manifest.get("tokenizer") != tokenizer:
        problems.append(f"tokenizer {tokenizer!r} (release: {manifest.get('tokenizer')!r})")
    keys = [k for k in RECIPE_KEYS if k not in ("model", "tokenizer")]
    for key, (a, b) in recipe_differences(manifest["generation"], generation, keys).items():
        problems.append(f"{key}={b!r} (release: {a!r})")
    if problems:
        raise ReleaseError(
            f"{manifest['name']}: the new data was made differently from the release: " + "; ".join(problems)
            + ". A release holds one recipe: pack it as another release")


def _recount(manifest: dict) -> None:
    parts = manifest["parts"]
    manifest["conversations"] = sum(p["conversations"] for p in parts)
    manifest["answer_tokens"] = sum(p["answer_tokens"] for p in parts)
    manifest["bytes"] = sum(p["bytes"] for p in parts)
    manifest["n_parts"] = len(parts)


def append_release(
    directory: str,
    records: Iterable[dict],
    *,
    count_tokens: Callable[[dict], int],
    target: dict,
    tokenizer: str,
    generation: dict,
    name: Optional[str] = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    level: int = DEFAULT_LEVEL,
    commit: Optional[str] = None,
) -> dict:
    """Append the ``records`` whose ids the release does not hold yet, as new parts.

    ``records``: ``{"id", "conversations"}`` dicts (what ``launch.generate_data`` writes), kept in
    order; a repeated id is kept once (its first occurrence). ``count_tokens(record)`` gives a
    record's answer tokens. ``target`` = ``{"model", "fingerprint"}``, ``tokenizer`` and
    ``generation`` (``RECIPE_KEYS`` plus ``command``) describe how the records were made: they start
    a new release's manifest and must match an existing one's (:func:`check_recipe`). Existing parts
    are verified first and never written; the manifest is replaced atomically after the new parts
    are durable. Returns counts: ``added``, ``already_released``, ``duplicates``, ``new_parts``.
    """
    storage.makedirs(directory)
    with _locked(directory):
        if is_release(directory):
            manifest = verify_release(directory)
            check_recipe(manifest, target=target, tokenizer=tokenizer, generation=generation)
            if not manifest["target"].get("fingerprint") and target.get("fingerprint"):
                manifest["target"]["fingerprint"] = target["fingerprint"]
            done = released_ids(directory, verify=False)  # verified just above
        else:
            manifest = new_manifest(name or os.path.basename(os.path.normpath(directory)), target=target,
                                    tokenizer=tokenizer, generation=generation)
            done = set()
        stats = {"added": 0, "already_released": 0, "duplicates": 0, "new_parts": []}
        new, seen = [], set()
        for rec in records:
            rid = str(rec["id"])
            if rid in done:
                stats["already_released"] += 1
            elif rid in seen:
                stats["duplicates"] += 1
            else:
                seen.add(rid)
                new.append(rec)
        if not new:
            return stats
        lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in new]
        commit = commit if commit is not None else git_commit()
        index = len(manifest["parts"])
        for frame, start, end in pack_parts(lines, part_bytes, level):
            fname = PART_TEMPLATE.format(index)
            path = os.path.join(directory, fname)
            if storage.exists(path):  # left by an append that died before its manifest: not released
                log.warning("%s: not in the manifest (an interrupted append); overwriting it", path)
            _write_atomic(path, frame)
            chunk = new[start:end]
            manifest["parts"].append({
                "file": fname,
                "sha256": hashlib.sha256(frame).hexdigest(),
                "bytes": len(frame),
                "conversations": len(chunk),
                "answer_tokens": int(sum(count_tokens(r) for r in chunk)),
                "first_id": str(chunk[0]["id"]),
                "last_id": str(chunk[-1]["id"]),
                "git_commit": commit,
                "generation_command": generation.get("command"),
                "created": _now(),
            })
            stats["new_parts"].append(fname)
            stats["added"] += len(chunk)
            index += 1
        _fsync_dir(directory)
        _recount(manifest)
        manifest["updated"] = _now()
        _write_atomic(os.path.join(directory, MANIFEST),
                      (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        _fsync_dir(directory)
        return stats
