"""Tokens a trained head has seen: its own run's and those of every run it was initialised from.

A head continued from a release, or ConFu branched from an EAGLE-3 run (``init_from``), has seen what
its ancestors saw; release manifests (``launch.release_head``) and scaling curves
(``launch.scaling_curve``) count tokens this way. Two counts per run: ``tokens_seen``, the trained positions of TTT step 0
(``positions/step0`` of metrics.csv: answer tokens the loss reads, padding and prompts excluded — a
release manifest's count), and ``row_tokens``, the tokens of the batches (rows × length × steps),
the same for every head trained on the same batches (scaling curves compare families by it).
"""

from __future__ import annotations

import csv
import json
import os

from confu_jax import storage


def tokens_seen(workdir: str, step: int) -> int | None:
    """Trained positions (step 0 of TTT: the loss tokens a step sees) up to ``step``, from
    metrics.csv: their exact sum when every step up to ``step`` was logged (``train.log_every`` 1),
    else the mean over the logged steps scaled to ``step``. None without the file or the column."""
    path = os.path.join(workdir, "metrics.csv")
    if not storage.isfile(path):
        return None
    with storage.open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("step")]
    col = next((c for c in ("positions/step0", "loss_tokens") if rows and c in rows[0]), None)
    if not rows or col is None:
        return None
    upto = {int(float(r["step"])): float(r[col]) for r in rows if int(float(r["step"])) <= step}
    if len(upto) == step and step > 0:  # every step logged (a resumed run logs each step once)
        return int(round(sum(upto.values())))
    per_step = sum(float(r[col]) for r in rows) / len(rows)
    return int(per_step * step)


def row_tokens(workdir: str, step: int) -> int | None:
    """Tokens the run's batches held up to ``step``: rows × row length × steps (config.json's
    ``data.global_batch_size`` and ``data.max_length``; prompts, padding and answers alike — the
    token-steps of a GPU campaign). Runs trained on the same batches have the same count whatever
    their loss reads (ConFu trains sampled windows, EAGLE-3 every answer position). None without
    the config."""
    path = os.path.join(workdir, "config.json")
    if not storage.isfile(path):
        return None
    with storage.open(path) as f:
        data = json.load(f).get("data", {})
    try:
        return int(data["global_batch_size"]) * int(data["max_length"]) * int(step)
    except (KeyError, TypeError, ValueError):
        return None


def lineage(workdir: str, step: int, _depth: int = 0) -> list[dict]:
    """This run's tokens seen up to ``step`` and those of every run or released head it was
    initialised from (``init_from.json``, followed back), newest first: a head continued from a
    release, or pruned from another run, has seen what its ancestors saw.

    A run records its ancestors' lineage when it starts (``source_lineage``, ``train.loop``), so a
    release replaced afterwards (its manifest now describing a later head) does not change what
    this run descends from; older runs are followed through the sources as they are now."""
    out = [{"workdir": workdir, "step": step, "tokens_seen": tokens_seen(workdir, step),
            "row_tokens": row_tokens(workdir, step)}]
    path = os.path.join(workdir, "init_from.json")
    if _depth > 16 or not storage.isfile(path):
        return out
    with storage.open(path) as f:
        src = json.load(f)
    if "source_lineage" in src:
        return out + list(src["source_lineage"])
    return out + source_lineage(src.get("source") or "", int(src.get("step", 0) or 0), workdir, _depth)


def source_lineage(source: str, step: int, workdir: str = "", _depth: int = 0) -> list[dict]:
    """The lineage of what a run is initialised from (``train.checkpoint.init_from`` at ``step``):
    a released head's manifest (one entry: its tokens_seen already sums its own lineage), another run's
    checkpoints (that run's lineage up to ``step``), or [] (a head in another framework's format)."""
    source = storage.absolute(source)
    if workdir and not storage.exists(source) and os.path.basename(source.rstrip("/")) == "checkpoints":
        # a run moved from where it trained (a GPU campaign's runs, unpacked here): its ancestor
        # is the run of the same name beside it
        moved = os.path.join(os.path.dirname(storage.absolute(workdir)),
                             os.path.basename(os.path.dirname(source.rstrip("/"))), "checkpoints")
        source = moved if storage.isdir(os.path.dirname(moved)) else source
    manifest = os.path.join(source, "manifest.json")
    if storage.isfile(manifest):  # a released head (confu_jax.runs.head_release)
        with storage.open(manifest) as f:
            training = json.load(f).get("training", {})
        return [{"release": source, "step": training.get("step"), "tokens_seen": training.get("tokens_seen")}]
    if os.path.basename(source.rstrip("/")) == "checkpoints":  # another launch.train run
        return lineage(os.path.dirname(source.rstrip("/")), step, _depth + 1)
    return []
