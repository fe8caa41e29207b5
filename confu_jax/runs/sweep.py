"""Sweeps: one config file, a product (and/or zip) of overrides, one ``launch.train`` run per point.

A *sweep spec* is a Python file with ``get_sweep()`` returning a dict (or ConfigDict)::

    def get_sweep():
        return dict(
            config="configs/smollm2_eagle3.py",          # relative to the spec file, else the cwd
            overrides={"train.steps": 400},              # every point
            product={"train.optim.lr": [1e-4, 3e-4],     # the Cartesian product of these ...
                     "objective.k_train": [32, 64]},
            zip={},                                      # ... times these, varied together
            metric="acceptance_length",                  # the table's sort key and the plot's y
        )

Points are numbered in a fixed order (the zip rows vary slowest, then the product keys in the order
given, the last fastest), so a point's number and directory name (``003-lr=0.0003,k_train=64``) are
the same on every host and in every mode. Each point's directory holds ``point.json`` (its
overrides; a directory whose ``point.json`` disagrees with the spec is refused, naming both),
the run's own files (checkpoints, ``metrics.csv``, ``eval.csv``, written by ``launch.train``),
``train.log`` (the run's output, appended on every attempt) and ``DONE.json`` once it finished.
The sweep directory may be a ``gs://`` URL (``confu_jax.storage``; the spec stays a local file).
Running a point again resumes it (``launch.train`` restores the latest checkpoint); a point with
``DONE.json`` is skipped. The results table collects each run's last held-out row (``eval.csv``)
and its last train loss.

Every override key is checked against the config before anything runs: a misspelt key stops the
sweep with the key and the nearest existing ones.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import importlib.util
import io
import itertools
import json
import os
import re
import sys
from typing import Any, Optional, Sequence

from confu_jax import storage

SPEC_KEYS = ("config", "overrides", "product", "zip", "metric")
DONE_FILE, POINT_FILE, LOG_FILE = "DONE.json", "point.json", "train.log"


class SweepError(ValueError):
    """A sweep spec or sweep directory that cannot be used as it is (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    overrides: dict  # dotted key -> value, the spec's common overrides included
    varied: dict  # only the keys this sweep varies

    @property
    def name(self) -> str:
        parts = [f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in self.varied.items()]
        slug = re.sub(r"[^A-Za-z0-9=.,_+-]", "_", ",".join(parts))[:120]
        return f"{self.index:03d}-{slug}" if slug else f"{self.index:03d}"


@dataclasses.dataclass(frozen=True)
class Sweep:
    spec_path: str
    config_path: str  # the config file (with an optional ':param' suffix), resolved
    points: tuple
    varied_keys: tuple
    metric: str


def _short(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _load_module(path: str, what: str):
    if storage.is_remote(path):  # Python code is imported from a file on this machine
        raise SweepError(f"{what} {path!r} is on an object store; a {what} is Python code imported from a local "
                         "file: copy it here (the sweep directory may be on gs://)")
    if not os.path.isfile(path):
        raise SweepError(f"{what} {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_confu_sweep_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if repo not in sys.path:  # config files import confu_jax / tests helpers
        sys.path.insert(0, repo)
    spec.loader.exec_module(module)
    return module


def load_config(config_path: str):
    """The ConfigDict of ``FILE[:param]`` (what ``--config FILE[:param]`` gives launch.train)."""
    path, _, param = config_path.partition(":")
    module = _load_module(path, "config file")
    if not hasattr(module, "get_config"):
        raise SweepError(f"config file {path!r} has no get_config()")
    return module.get_config(param) if param else module.get_config()


def _config_value(config, key: str):
    node = config
    done = []
    for part in key.split("."):
        keys = list(node.keys()) if hasattr(node, "keys") else []
        if part not in keys:
            near = difflib.get_close_matches(part, keys, n=3)
            where = ".".join(done) or "the config"
            raise SweepError(f"override key {key!r}: {where} has no field {part!r}"
                             + (f" (did you mean {', '.join(near)}?)" if near else f" (fields: {', '.join(keys)})"))
        node = node[part]
        done.append(part)
    return node


def load_sweep(spec_path: str) -> Sweep:
    """Read and check a sweep spec (see module doc) -> its points."""
    module = _load_module(spec_path, "sweep spec")
    if not hasattr(module, "get_sweep"):
        raise SweepError(f"sweep spec {spec_path!r} has no get_sweep()")
    raw = dict(module.get_sweep())
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise SweepError(f"sweep spec {spec_path!r}: unknown keys {unknown}; expected some of {list(SPEC_KEYS)}")
    if not raw.get("config"):
        raise SweepError(f"sweep spec {spec_path!r}: 'config' (the config file to sweep) is required")
    cfg_file, sep, param = str(raw["config"]).partition(":")
    if not os.path.isabs(cfg_file):
        beside = os.path.join(os.path.dirname(os.path.abspath(spec_path)), cfg_file)
        cfg_file = beside if os.path.isfile(beside) else os.path.abspath(cfg_file)
    config_path = os.path.normpath(cfg_file) + sep + param
    common = dict(raw.get("overrides") or {})
    product = dict(raw.get("product") or {})
    zipped = dict(raw.get("zip") or {})
    for name, axes in (("product", product), ("zip", zipped)):
        for k, vs in axes.items():
            if not isinstance(vs, (list, tuple)) or not vs:
                raise SweepError(f"sweep spec {spec_path!r}: {name}[{k!r}] must be a non-empty list, got {vs!r}")
    lengths = {k: len(v) for k, v in zipped.items()}
    if len(set(lengths.values())) > 1:
        raise SweepError(f"sweep spec {spec_path!r}: zip lists must have equal lengths, got {lengths}")
    both = (set(product) | set(zipped)) & set(common) | set(product) & set(zipped)
    if both:
        raise SweepError(f"sweep spec {spec_path!r}: keys {sorted(both)} are given more than once "
                         "(overrides / product / zip)")
    config = load_config(config_path)
    for k in [*common, *product, *zipped]:
        _config_value(config, k)
    zip_rows = [dict(zip(zipped, vals)) for vals in zip(*zipped.values())] if zipped else [{}]
    prod_rows = [dict(zip(product, vals)) for vals in itertools.product(*product.values())]
    points = []
    for z in zip_rows:
        for p in prod_rows:
            varied = {**z, **p}
            points.append(Point(len(points), {**common, **varied}, varied))
    return Sweep(os.path.abspath(spec_path), config_path, tuple(points), tuple([*zipped, *product]),
                 str(raw.get("metric") or "acceptance_length"))


def flag_value(v) -> str:
    """A Python value as ml_collections' ``--config.KEY=VALUE`` parses it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return repr(tuple(v))
    return str(v)


def train_command(sweep: Sweep, point: Point, workdir: str, extra: Sequence[str] = ()) -> list:
    """The ``launch.train`` command of one point (argv, python first)."""
    return [sys.executable, "-m", "launch.train", "--config", sweep.config_path, "--workdir", workdir,
            *[f"--config.{k}={flag_value(v)}" for k, v in point.overrides.items()], *extra]


def point_dir(sweep_dir: str, point: Point) -> str:
    return os.path.join(sweep_dir, point.name)


def status(sweep_dir: str, point: Point) -> str:
    """'done', 'partial' (started, not finished: a re-run resumes it) or 'new'."""
    d = point_dir(sweep_dir, point)
    if storage.isfile(os.path.join(d, DONE_FILE)):
        return "done"
    return "partial" if storage.isdir(os.path.join(d, "checkpoints")) else "new"


def claim_point_dir(sweep_dir: str, point: Point) -> str:
    """The point's directory, created with its ``point.json``; refuses one made by another spec."""
    d = point_dir(sweep_dir, point)
    storage.makedirs(d)
    path = os.path.join(d, POINT_FILE)
    record = {"index": point.index, "overrides": point.overrides}
    if storage.isfile(path):
        saved = json.loads(storage.read_text(path))
        if saved.get("overrides") != json.loads(json.dumps(point.overrides)):
            raise SweepError(f"{path} was written for overrides {saved.get('overrides')}, but the spec now gives "
                             f"point {point.index} {point.overrides}; use a new sweep directory")
    else:
        storage.write_text(path, json.dumps(record, indent=2))
    return d


def mark_done(sweep_dir: str, point: Point, returncode: int) -> None:
    d = point_dir(sweep_dir, point)
    row = collect_point(sweep_dir, point)
    storage.write_text(os.path.join(d, DONE_FILE),
                       json.dumps({"returncode": returncode, "step": row.get("step"), "metrics": row}, indent=2))


# ----------------------------------------------------------------------------- results

def _last_row(path: str) -> dict:
    if not storage.isfile(path):
        return {}
    last = {}
    with storage.open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("step") not in (None, "") and int(float(row["step"])) >= int(float(last.get("step", -1))):
                last = row
    return {k: float(v) for k, v in last.items() if v not in ("", None)}


def collect_point(sweep_dir: str, point: Point) -> dict:
    """{'step': last held-out step, 'eval/<metric>': ..., 'train/loss': last train loss} ({} if none)."""
    d = point_dir(sweep_dir, point)
    ev, tr = _last_row(os.path.join(d, "eval.csv")), _last_row(os.path.join(d, "metrics.csv"))
    out: dict[str, Any] = {}
    if ev:
        out["step"] = int(ev.pop("step"))
        out.update({f"eval/{k}": v for k, v in sorted(ev.items())})
    if tr:
        out.setdefault("step", int(tr["step"]))
        out["train/step"] = int(tr.pop("step"))
        if "loss" in tr:
            out["train/loss"] = tr["loss"]
    return out


def collect(sweep: Sweep, sweep_dir: str) -> tuple[list, list]:
    """(header, rows): one row per point — index, name, status, the varied values, final metrics."""
    rows, metric_keys = [], []
    for p in sweep.points:
        m = collect_point(sweep_dir, p)
        for k in m:
            if k not in metric_keys and k != "step":
                metric_keys.append(k)
        rows.append({"point": p.index, "dir": p.name, "status": status(sweep_dir, p), **p.varied,
                     "step": m.get("step", ""), **m})
    header = ["point", "dir", "status", *sweep.varied_keys, "step",
              *sorted(metric_keys, key=lambda k: (not k.startswith("eval/"), k))]
    return header, rows


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_table(sweep: Sweep, sweep_dir: str, out_prefix: Optional[str] = None) -> tuple[str, str, list]:
    """results.csv and results.md in the sweep directory -> (csv path, md path, rows)."""
    header, rows = collect(sweep, sweep_dir)
    prefix = out_prefix or os.path.join(sweep_dir, "results")
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=header, restval="")
    w.writeheader()
    w.writerows(rows)
    storage.write_text(prefix + ".csv", buf.getvalue())
    key = f"eval/{sweep.metric}"
    shown = ["point", *sweep.varied_keys, "status", "step"] + [k for k in header if k.startswith("eval/")
                                                               or k == "train/loss"]
    ranked = sorted(rows, key=lambda r: -r[key] if isinstance(r.get(key), float) else float("inf"))
    lines = [f"Sweep `{os.path.relpath(sweep.spec_path)}` over `{os.path.relpath(sweep.config_path.split(':')[0])}`"
             f" ({len(rows)} points, best `{key}` first)", "",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in shown) + " |" for r in ranked]
    storage.write_text(prefix + ".md", "\n".join(lines) + "\n")
    return prefix + ".csv", prefix + ".md", rows


def plot(sweep: Sweep, rows: list, path: str, metric: Optional[str] = None) -> Optional[str]:
    """The metric against the first varied key, one line per combination of the others."""
    key = f"eval/{metric or sweep.metric}"
    have = [r for r in rows if isinstance(r.get(key), float)]
    if not have or not sweep.varied_keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, rest = sweep.varied_keys[0], sweep.varied_keys[1:]
    xs = list(dict.fromkeys(r[x_key] for r in rows))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict = {}
    for r in have:
        groups.setdefault(tuple(r[k] for k in rest), []).append(r)
    for g, rs in groups.items():
        rs = sorted(rs, key=lambda r: xs.index(r[x_key]))
        x = [r[x_key] if numeric else xs.index(r[x_key]) for r in rs]
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in zip(rest, g)) or None
        ax.plot(x, [r[key] for r in rs], marker="o", label=label)
    if numeric:
        if all(x > 0 for x in xs) and max(xs) / min(xs) >= 3:
            ax.set_xscale("log")
        ax.set_xticks(xs, [_short(x) for x in xs])
        ax.minorticks_off()
    else:
        ax.set_xticks(range(len(xs)), [_short(x) for x in xs])
    ax.set_xlabel(x_key)
    ax.set_ylabel(key)
    if len(groups) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=120)
    plt.close(fig)
    return path
