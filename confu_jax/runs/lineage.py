"""Tokens a trained head has seen: its own run's and those of every run it was initialised from.

A head continued from a release, or ConFu branched from an EAGLE-3 run (``init_from``), has seen what
its ancestors saw; release manifests (``launch.release_head``) and scaling curves
(``launch.scaling_curve``) count tokens this way. A token seen is a trained position of TTT step 0
(``positions/step0`` of metrics.csv): an answer token the loss reads, padding and prompts excluded.
"""

from __future__ import annotations

import csv
import json
import os


def tokens_seen(workdir: str, step: int) -> int | None:
    """Trained positions (step 0 of TTT: the loss tokens a step sees) up to ``step``, from
    metrics.csv: their exact sum when every step up to ``step`` was logged (``train.log_every`` 1),
    else the mean over the logged steps scaled to ``step``. None without the file or the column."""
    path = os.path.join(workdir, "metrics.csv")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("step")]
    col = next((c for c in ("positions/step0", "loss_tokens") if rows and c in rows[0]), None)
    if not rows or col is None:
        return None
    upto = {int(float(r["step"])): float(r[col]) for r in rows if int(float(r["step"])) <= step}
    if len(upto) == step and step > 0:  # every step logged (a resumed run logs each step once)
        return int(round(sum(upto.values())))
    per_step = sum(float(r[col]) for r in rows) / len(rows)
    return int(per_step * step)


def lineage(workdir: str, step: int, _depth: int = 0) -> list[dict]:
    """This run's tokens seen up to ``step`` and those of every run or released head it was
    initialised from (``init_from.json``, followed back), newest first: a head continued from a
    release, or pruned from another run, has seen what its ancestors saw."""
    out = [{"workdir": workdir, "step": step, "tokens_seen": tokens_seen(workdir, step)}]
    path = os.path.join(workdir, "init_from.json")
    if _depth > 16 or not os.path.isfile(path):
        return out
    with open(path) as f:
        src = json.load(f)
    source = os.path.abspath(src.get("source") or "")
    manifest = os.path.join(source, "manifest.json")
    if os.path.isfile(manifest):  # a released head (confu_jax.runs.head_release)
        with open(manifest) as f:
            training = json.load(f).get("training", {})
        out.append({"release": source, "step": training.get("step"), "tokens_seen": training.get("tokens_seen")})
    elif os.path.basename(source.rstrip("/")) == "checkpoints":  # another launch.train run
        out += lineage(os.path.dirname(source.rstrip("/")), int(src.get("step", 0)), _depth + 1)
    return out
