"""Released heads: a trained head kept in the repo, so no session retrains it (docs/DESIGN.md §8).

A head release is a folder ``releases/heads/<name>/`` with the head in the **official EAGLE-3
layout** (``config.json`` + ``model.safetensors``, bf16: what SGLang / SpecForge load and
``weights.eagle3_formats`` reads back, speculators' test path included) and ``manifest.json``:
format, name, sha256 and bytes of every file, the data release it was trained on (its manifest's
sha256 and totals), the training run (steps, tokens seen, command, commit), the target's
fingerprint and the τ it measured (held-out decode τ, MT-Bench τ). ``verify_head_release`` checks
the hashes; ``decode.loaded`` calls it before loading any folder that holds such a manifest.

Format version 2 stores the weights file xz-packed (``model.safetensors.xz``, ``weights.packed_files``:
the repository's working tree must stay small enough to travel to a device machine); its manifest
entry also names what it unpacks to (``unpacks_to``: file, sha256, bytes), and the check covers both.
Readers find the packed file wherever they look for ``model.safetensors``. Version 1 (plain files)
is still read.

A release is replaced only when it improves: ``better_than_released`` wants a τ gain of at least
``MIN_TAU_GAIN`` (0.05) on the same metric.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from confu_jax import storage
from confu_jax.weights import packed_files

FORMAT = "confu_jax.head_release"
FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
PACKED_FILES = ("model.safetensors",)  # what a release stores xz-packed
MIN_TAU_GAIN = 0.05


class HeadReleaseError(ValueError):
    """A head release folder that is incomplete, altered or not a head release."""


def declared_format(path: str) -> Optional[str]:
    """The ``format`` field of the JSON file at ``path``; None when the file is missing, unreadable
    or not a JSON object (how a folder says what it holds: a release, an export)."""
    if not storage.isfile(path):
        return None
    try:
        with storage.open(path, encoding="utf-8") as f:
            return json.load(f).get("format")
    except (json.JSONDecodeError, OSError, AttributeError):
        return None


def is_head_release(directory: str) -> bool:
    """Whether ``directory`` is a head release, so that its files must be hash-checked before use.

    A ``manifest.json`` that does not parse (or is not a JSON object) raises ``HeadReleaseError``: a
    damaged manifest must not turn the check off (a copy with a flipped weight byte and a broken
    manifest would otherwise load unverified). A manifest listing ``files`` counts as a release
    whatever its ``format`` says (a damaged format field is refused by the check, not skipped)."""
    path = os.path.join(directory, MANIFEST)
    if not storage.isfile(path):
        return False
    try:
        with storage.open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadReleaseError(f"{path}: the manifest does not parse ({e}), so the folder's files cannot be "
                               f"hash-checked and it is refused; restore it (git checkout -- {directory})") from e
    if not isinstance(manifest, dict):
        raise HeadReleaseError(f"{path}: expected a JSON object (a release manifest), found "
                               f"{type(manifest).__name__}; the folder's files cannot be hash-checked")
    return manifest.get("format") == FORMAT or isinstance(manifest.get("files"), list)


def read_head_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with storage.open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise HeadReleaseError(f"{path}: cannot read the head release manifest ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in READS_VERSIONS:
        versions = " or ".join(map(str, READS_VERSIONS))
        raise HeadReleaseError(f"{path}: expected format {FORMAT!r} version {versions}, found "
                               f"{manifest.get('format')!r} version {manifest.get('format_version')!r}")
    return manifest


def verify_head_release(directory: str) -> dict:
    """Check every file the manifest lists against its sha256 (a packed file: also what it unpacks to,
    in the cache readers load from) -> the manifest; raises ``HeadReleaseError`` naming the file, the
    expected and the found hash."""
    manifest = read_head_manifest(directory)
    for entry in manifest["files"]:
        path = os.path.join(directory, entry["file"])
        if not storage.isfile(path):
            raise HeadReleaseError(f"{path}: missing (the manifest expects sha256 {entry['sha256']})")
        found, n = storage.sha256_file(path)
        if found != entry["sha256"]:
            raise HeadReleaseError(f"{path}: sha256 mismatch: the manifest expects {entry['sha256']}, found "
                                   f"{found} ({n} bytes, expected {entry['bytes']}); restore it (git checkout -- "
                                   f"{path})")
        unpacked = entry.get("unpacks_to")
        if unpacked:
            plain = packed_files.local(os.path.join(directory, unpacked["file"]))
            found, n = storage.sha256_file(plain)
            if found != unpacked["sha256"]:
                raise HeadReleaseError(f"{plain} (unpacked from {path}): sha256 mismatch: the manifest expects "
                                       f"{unpacked['sha256']}, found {found} ({n} bytes); remove it (it is unpacked "
                                       "again from the checked file)")
    return manifest


def better_than_released(directory: str, tau: dict) -> tuple[bool, str]:
    """Whether a head with measured ``tau`` ({metric: value}) may replace the release in
    ``directory``: no release yet, or a gain >= MIN_TAU_GAIN on a metric both report."""
    if not is_head_release(directory):
        return True, "no release yet"
    old = read_head_manifest(directory).get("tau", {})
    shared = [k for k in tau if k in old and tau[k] is not None and old[k] is not None]
    if not shared:
        return False, f"the release reports {sorted(old)}, the new head {sorted(tau)}: no metric to compare"
    gains = {k: tau[k] - old[k] for k in shared}
    best = max(gains, key=gains.get)
    if gains[best] >= MIN_TAU_GAIN:
        return True, f"{best} {old[best]:.3f} -> {tau[best]:.3f}"
    return False, f"no metric improves by >= {MIN_TAU_GAIN}: " + ", ".join(
        f"{k} {old[k]:.3f} -> {tau[k]:.3f}" for k in shared)


def pack_release_files(directory: str) -> list:
    """xz-pack the files of ``PACKED_FILES`` in the local staging folder ``directory`` (before its
    manifest is written) -> the packed names."""
    return [os.path.basename(packed_files.pack(os.path.join(directory, f))) for f in PACKED_FILES
            if os.path.isfile(os.path.join(directory, f))]


def file_entry(directory: str, fname: str) -> dict:
    """A manifest's record of one file: sha256 and bytes; a packed file also ``unpacks_to``."""
    path = os.path.join(directory, fname)
    digest, n = storage.sha256_file(path)
    entry = {"file": fname, "sha256": digest, "bytes": n}
    if fname.endswith(packed_files.SUFFIX):
        u_digest, u_n = packed_files.unpacked_digest(path)
        entry["unpacks_to"] = {"file": fname[: -len(packed_files.SUFFIX)], "sha256": u_digest, "bytes": u_n}
    return entry


def write_head_manifest(directory: str, *, name: str, files: list, data: Optional[dict], training: dict,
                        target: dict, tau: dict, command: str, commit: Optional[str]) -> dict:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name,
                "files": [file_entry(directory, f) for f in files], "data": data, "training": training,
                "target": target, "tau": tau, "command": command, "commit": commit}
    storage.write_text(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def unpacked_release(directory: str) -> str:
    """A folder holding the release's files as an engine reads them (vLLM, SGLang: ``model.safetensors``,
    not its packed form), after ``verify_head_release``: the release itself when nothing is packed, else
    a cache folder (``weights.packed_files.cache_root()``) keyed by the manifest's hash, without the
    manifest (it is the published layout, not a release); a cached folder whose files no longer have the
    manifest's hashes is written again."""
    import hashlib
    import shutil

    manifest = verify_head_release(directory)
    if not any(e.get("unpacks_to") for e in manifest["files"]):
        return directory
    want = {(e.get("unpacks_to") or e)["file"]: (e.get("unpacks_to") or e)["sha256"] for e in manifest["files"]}
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]
    out = os.path.join(packed_files.cache_root(), f"release-{key}")
    if os.path.isdir(out):
        if sorted(os.listdir(out)) == sorted(want) and all(
                storage.sha256_file(os.path.join(out, f))[0] == h for f, h in want.items()):
            return out
        shutil.rmtree(out, ignore_errors=True)
    stage = f"{out}.stage-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    for plain in want:
        with storage.open(packed_files.local(os.path.join(directory, plain)), "rb") as f, \
                open(os.path.join(stage, plain), "wb") as g:
            shutil.copyfileobj(f, g)
    try:
        os.replace(stage, out)
    except OSError:  # another process put it there first
        shutil.rmtree(stage, ignore_errors=True)
    return out


def repack_release(directory: str) -> dict:
    """Store a version-1 release (plain files) as version 2: its ``PACKED_FILES`` xz-packed, the rest
    as they are. The content is unchanged and checked: each packed file unpacks to the sha256 the old
    manifest listed, which its entry keeps as ``unpacks_to``; the manifest records the repacking."""
    manifest = verify_head_release(directory)
    if manifest["format_version"] == FORMAT_VERSION:
        return manifest
    entries = []
    for entry in manifest["files"]:
        if entry["file"] in PACKED_FILES:
            packed = packed_files.pack(os.path.join(directory, entry["file"]))
            new = file_entry(directory, os.path.basename(packed))
            if new["unpacks_to"]["sha256"] != entry["sha256"]:
                raise HeadReleaseError(f"{packed}: unpacks to sha256 {new['unpacks_to']['sha256']}, not the "
                                       f"{entry['sha256']} of the file it packed")
            entries.append(new)
        else:
            entries.append(entry)
    manifest = dict(manifest, format_version=FORMAT_VERSION, files=entries,
                    repacked={"from_version": manifest["format_version"],
                              "why": "weights stored xz-packed (weights.packed_files); content unchanged"})
    storage.write_text(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def find_released_heads(root: str, variants, prefix: str = "smollm2_") -> dict:
    """{variant: (folder, manifest)} of the head releases ``<root>/<prefix><variant>`` present, each
    hash-checked (``verify_head_release``: an altered file is refused, naming it). Variants without
    a release folder are left out."""
    out = {}
    for v in variants:
        path = os.path.join(root, f"{prefix}{v}")
        if is_head_release(path):
            out[v] = (path, verify_head_release(path))
    return out

