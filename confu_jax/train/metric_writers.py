"""Metric sinks: CSV (always, resume-safe) and TensorBoard when a writer library is installed.

Only process 0 writes. On resume the CSV keeps the rows up to the restored step and drops the
rest, so a run killed after its last checkpoint does not leave duplicate steps behind.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Optional

from confu_jax import storage


class CsvWriter:
    def __init__(self, path: str, resume_step: Optional[int] = None):
        self.path = path
        self.header: list = []
        self.rows: list = []
        if storage.exists(path):
            if resume_step is not None:
                with storage.open(path, newline="") as f:
                    reader = csv.DictReader(f)
                    self.header = list(reader.fieldnames or [])
                    self.rows = [r for r in reader if int(r["step"]) <= resume_step]
            self._rewrite()

    def _rewrite(self):
        """The whole file at once (a reader never sees half of it; an object store has no append)."""
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=self.header, restval="")
        if self.header:
            w.writeheader()
            w.writerows(self.rows)
        storage.write_text(self.path, buf.getvalue())

    def _append(self, row: dict) -> bool:
        """Append one row where the file system can; False where it cannot (rewrite instead)."""
        if storage.is_remote(self.path) or not os.path.exists(self.path):
            return False
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.header, restval="").writerow(row)
        return True

    def write(self, step: int, metrics: dict):
        row = {"step": int(step), **{k: _fmt(v) for k, v in metrics.items()}}
        new_keys = [k for k in row if k not in self.header]
        self.rows.append(row)
        if new_keys:
            self.header = ["step"] + sorted(set(self.header + new_keys) - {"step"})
        if new_keys or not self._append(row):
            self._rewrite()

    def close(self):
        pass


class RecordLog(CsvWriter):
    """``step,records``: the data records (``record_index``, their index in the loaded training data)
    this process trained on at each step, space-separated in row order (``train.log_records``). One
    file per process; a resume keeps the rows up to the restored step, as the metric CSVs do, so after
    any number of restarts the files say exactly which records the run's steps read."""

    def write(self, step: int, records) -> None:  # type: ignore[override]
        row = {"step": int(step), "records": " ".join(str(int(r)) for r in records)}
        self.rows.append(row)
        fresh = not self.header
        self.header = ["step", "records"]
        if fresh or not self._append(row):
            self._rewrite()


def read_record_logs(directory: str) -> dict:
    """``{step: [record, ...]}`` over every process's record log in ``directory`` (process order)."""
    out: dict = {}
    for name in sorted(storage.listdir(directory)):
        with storage.open(os.path.join(directory, name), newline="") as f:
            for r in csv.DictReader(f):
                out.setdefault(int(r["step"]), []).extend(int(x) for x in r["records"].split())
    return out


def _fmt(v) -> str:
    v = float(v)
    return repr(v) if math.isfinite(v) else str(v)


def read_csv(path: str) -> list[dict]:
    """Rows as dicts of floats (step as int) — for tests and plots."""
    with storage.open(path, newline="") as f:
        return [{k: (int(v) if k == "step" else float(v)) for k, v in r.items() if v != ""}
                for r in csv.DictReader(f)]


class TensorBoardWriter:
    """tensorboardX, or tf.summary; neither is a dependency of this project."""

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter  # type: ignore

            self._w = SummaryWriter(logdir)
            self._tf = None
        except ImportError:
            import tensorflow as tf  # type: ignore

            self._tf = tf
            self._w = tf.summary.create_file_writer(logdir)

    def write(self, step: int, metrics: dict):
        if self._tf is None:
            for k, v in metrics.items():
                self._w.add_scalar(k, float(v), int(step))
        else:
            with self._w.as_default():
                for k, v in metrics.items():
                    self._tf.summary.scalar(k, float(v), step=int(step))

    def close(self):
        if self._tf is None:
            self._w.close()
        else:
            self._w.flush()


def tensorboard_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("tensorboardX", "tensorflow"))


class MultiWriter:
    def __init__(self, writers):
        self.writers = list(writers)

    def write(self, step: int, metrics: dict):
        for w in self.writers:
            w.write(step, metrics)

    def close(self):
        for w in self.writers:
            w.close()


def make_writers(workdir: str, name: str, tensorboard: str, resume_step: Optional[int]) -> MultiWriter:
    """CSV at ``workdir/{name}.csv`` plus TensorBoard under ``workdir/tb/{name}`` per the mode."""
    writers = [CsvWriter(os.path.join(workdir, f"{name}.csv"), resume_step)]
    if tensorboard not in ("auto", "on", "off"):
        raise ValueError(f"config.train.tensorboard={tensorboard!r}: expected 'auto', 'on' or 'off'")
    if tensorboard == "on" or (tensorboard == "auto" and tensorboard_available()):
        if not tensorboard_available():
            raise ImportError("config.train.tensorboard='on' needs tensorboardX "
                              "(pip install tensorboardX) or tensorflow")
        writers.append(TensorBoardWriter(os.path.join(workdir, "tb", name)))
    return MultiWriter(writers)
