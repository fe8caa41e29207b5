"""Released heads: a trained head kept in the repo, so no session retrains it (docs/DESIGN.md §8).

A head release is a folder ``releases/heads/<name>/`` with the head in the **official EAGLE-3
layout** (``config.json`` + ``model.safetensors``, bf16: what SGLang / SpecForge load and
``weights.eagle3_formats`` reads back, speculators' test path included) and ``manifest.json``:
format, name, sha256 and bytes of every file, the data release it was trained on (its manifest's
sha256 and totals), the training run (steps, tokens seen, command, commit), the target's
fingerprint and the τ it measured (held-out decode τ, MT-Bench τ). ``verify_head_release`` checks
the hashes; ``decode.loaded`` calls it before loading any folder that holds such a manifest.

A release is replaced only when it improves: ``better_than_released`` wants a τ gain of at least
``MIN_TAU_GAIN`` (0.05) on the same metric.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from confu_jax import storage

FORMAT = "confu_jax.head_release"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise HeadReleaseError(f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, found "
                               f"{manifest.get('format')!r} version {manifest.get('format_version')!r}")
    return manifest


def verify_head_release(directory: str) -> dict:
    """Check every file the manifest lists against its sha256 -> the manifest; raises
    ``HeadReleaseError`` naming the file, the expected and the found hash."""
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


def write_head_manifest(directory: str, *, name: str, files: list, data: Optional[dict], training: dict,
                        target: dict, tau: dict, command: str, commit: Optional[str]) -> dict:
    entries = []
    for fname in files:
        digest, n = storage.sha256_file(os.path.join(directory, fname))
        entries.append({"file": fname, "sha256": digest, "bytes": n})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "files": entries,
                "data": data, "training": training, "target": target, "tau": tau, "command": command,
                "commit": commit}
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

