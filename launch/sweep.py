"""Run a sweep of ``launch.train`` over a product / zip of config overrides, and collect the results.

    python -m launch.sweep --spec sweeps/smollm2_eagle3_lr.py --sweep_dir runs/lr_sweep            # local
    python -m launch.sweep --spec ... --sweep_dir ... --mode slurm     # writes an sbatch array script
    python -m launch.sweep --spec ... --sweep_dir ... --mode hosts --num_hosts 4   # one script per host
    python -m launch.sweep --spec ... --sweep_dir ... --mode collect   # only the table and the plot

The spec format, point numbering and directory layout: ``confu_jax/runs/sweep.py``. Locally the
points run one after another, each as its own ``launch.train`` process writing to
``POINT_DIR/train.log``; finished points (``DONE.json``) are skipped and unfinished ones resume
from their latest checkpoint, so re-running the same command after a kill continues the sweep. A
failed point is reported and the others still run (the exit status is 1 if any failed). At the
end: ``results.csv``, ``results.md`` (printed) and ``results.png`` in the sweep directory — each
point's last held-out metrics (``eval.csv``) and last train loss. ``--sweep_dir`` may be a ``gs://``
URL: the points' workdirs are there, and each point's ``train.log`` is written locally while it runs
and uploaded when it stops.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from confu_jax import storage

_SPEC = flags.DEFINE_string("spec", None, "Sweep spec: a Python file with get_sweep() (config, overrides, "
                            "product, zip, metric; see confu_jax/runs/sweep.py).")
_DIR = flags.DEFINE_string("sweep_dir", None, "Directory of the sweep: one sub-directory per point, the results.")
_MODE = flags.DEFINE_enum("mode", "local", ["local", "slurm", "hosts", "collect"],
                          "local: run the points here, in sequence; slurm: write an sbatch array script over the "
                          "unfinished points; hosts: write one shell script per host (--num_hosts); collect: only "
                          "gather the results table and plot.")
_POINTS = flags.DEFINE_list("points", None, "Run only these point numbers (what the slurm / hosts scripts call).")
_NUM_HOSTS = flags.DEFINE_integer("num_hosts", 1, "--mode=hosts: split the unfinished points round-robin over this "
                                  "many hosts.")
_TRAIN_FLAGS = flags.DEFINE_list("train_flags", [], "Extra flags for every launch.train process, e.g. "
                                 "--train_flags=--cpu_devices=8 (the config itself is changed only by the spec).")
_SLURM_HEADER = flags.DEFINE_list("slurm", ["--nodes=1", "--gpus-per-node=8", "--time=24:00:00"],
                                  "--mode=slurm: #SBATCH options of each array task.")
_METRIC = flags.DEFINE_string("metric", None, "Held-out metric to rank and plot (default: the spec's, else "
                              "acceptance_length, the simulated τ).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "--mode=local: print each point's command, run nothing.")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _run_point(sw, sweep, point, sweep_dir: str) -> int:
    """One point's launch.train, output appended to its train.log; SIGTERM/SIGINT are passed on (the run
    checkpoints and stops) and the sweep stops after it."""
    d = sw.claim_point_dir(sweep_dir, point)
    cmd = sw.train_command(sweep, point, d, ["--config.train.progress_bar=false", *_TRAIN_FLAGS.value])
    log_path = os.path.join(d, sw.LOG_FILE)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    with _local_log(log_path) as local_log, open(local_log, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repo, env=env)
        stop = []

        def forward(signum, _frame):
            stop.append(signum)
            child.send_signal(signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = child.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if stop:
        _say(f"  stopped by signal {stop[0]}: {point.name} keeps its checkpoints; re-run the same command to resume")
        sys.exit(128 + stop[0])
    if rc == 0:
        sw.mark_done(sweep_dir, point, rc)
    return rc


@contextlib.contextmanager
def _local_log(path: str):
    """A local file the child process's output can go to (a pipe needs a file descriptor): ``path``
    itself, or for a ``gs://`` sweep a temporary copy of the point's log (its earlier attempts
    first), uploaded whole when the run stops, whatever way it stops."""
    if not storage.is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="confu_sweep_log_") as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        storage.write_bytes(local, storage.read_bytes(path) if storage.isfile(path) else b"")
        try:
            yield local
        finally:
            storage.write_bytes(path, storage.read_bytes(local))


def _tail(path: str, n: int = 15) -> str:
    return "".join(storage.read_bytes(path).decode(errors="replace").splitlines(keepends=True)[-n:])


def _self_command(spec: str, sweep_dir: str, points: str) -> str:
    args = [sys.executable, "-m", "launch.sweep", "--spec", storage.absolute(spec), "--sweep_dir",
            storage.absolute(sweep_dir), "--points", points]
    if _TRAIN_FLAGS.value:
        args.append("--train_flags=" + ",".join(_TRAIN_FLAGS.value))
    return shlex.join(args)


def _collect(sw, sweep, sweep_dir: str) -> None:
    csv_path, md_path, rows = sw.write_table(sweep, sweep_dir)
    _say(storage.read_text(md_path).rstrip())
    png = sw.plot(sweep, rows, os.path.join(sweep_dir, "results.png"), _METRIC.value)
    _say(f"results: {csv_path}, {md_path}" + (f", {png}" if png else " (no plot: no point has held-out metrics yet)"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    if not _SPEC.value or not _DIR.value:
        raise app.UsageError("--spec and --sweep_dir are required")
    from confu_jax.runs import sweep as sw

    try:
        sweep = sw.load_sweep(_SPEC.value)
    except sw.SweepError as e:
        raise app.UsageError(str(e)) from None
    if _METRIC.value:
        import dataclasses

        sweep = dataclasses.replace(sweep, metric=_METRIC.value)
    sweep_dir = storage.absolute(_DIR.value)
    storage.makedirs(sweep_dir)
    by_index = {p.index: p for p in sweep.points}
    if _POINTS.value:
        try:
            chosen = [by_index[int(i)] for i in _POINTS.value]
        except (ValueError, KeyError):
            raise app.UsageError(f"--points {_POINTS.value}: expected numbers in 0..{len(sweep.points) - 1}") from None
    else:
        chosen = list(sweep.points)
    states = {p.index: sw.status(sweep_dir, p) for p in chosen}
    todo = [p for p in chosen if states[p.index] != "done"]
    _say(f"sweep: {len(sweep.points)} points over {', '.join(sweep.varied_keys) or '(nothing varied)'} "
         f"in {sweep_dir}; {len(chosen) - len(todo)} done, "
         f"{sum(states[p.index] == 'partial' for p in todo)} to resume, {sum(states[p.index] == 'new' for p in todo)} new")

    if _MODE.value == "collect":
        _collect(sw, sweep, sweep_dir)
        return
    if _MODE.value == "slurm":
        path = os.path.join(sweep_dir, "sweep.sbatch")
        ids = ",".join(str(p.index) for p in todo)
        if not ids:
            _say("nothing to submit: every point is done")
            return
        lines = ["#!/usr/bin/env bash", f"# {len(todo)} unfinished points of {_SPEC.value}; submit: sbatch {path}",
                 "#SBATCH --job-name=confu-sweep", f"#SBATCH --array={ids}", "#SBATCH --ntasks-per-node=1",
                 *[f"#SBATCH {o}" for o in _SLURM_HEADER.value], "#SBATCH --signal=TERM@120", "#SBATCH --requeue",
                 # slurm writes its own output locally: beside the sweep, or in the submit folder for gs://
                 f"#SBATCH --output={'' if storage.is_remote(sweep_dir) else sweep_dir + '/'}slurm-%A_%a.out",
                 "set -euo pipefail",
                 f"cd {shlex.quote(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}",
                 "[[ -f .venv/bin/activate ]] && . .venv/bin/activate",
                 "srun --kill-on-bad-exit=1 " + _self_command(_SPEC.value, sweep_dir, "PLACEHOLDER").replace(
                     "PLACEHOLDER", '"$SLURM_ARRAY_TASK_ID"')]
        storage.write_text(path, "\n".join(lines) + "\n")
        _say(f"wrote {path} (array {ids}); submit with: sbatch {path}; then --mode=collect")
        return
    if _MODE.value == "hosts":
        n = max(1, _NUM_HOSTS.value)
        storage.makedirs(os.path.join(sweep_dir, "hosts"))
        for h in range(n):
            mine = [p for i, p in enumerate(todo) if i % n == h]
            path = os.path.join(sweep_dir, "hosts", f"host_{h}.sh")
            script = "#!/usr/bin/env bash\nset -euo pipefail\n"
            if mine:
                script += _self_command(_SPEC.value, sweep_dir, ",".join(str(p.index) for p in mine)) + "\n"
            storage.write_text(path, script)
            if not storage.is_remote(path):  # an object has no mode bits: run it with bash
                os.chmod(path, 0o755)
            _say(f"host {h}: {path} ({len(mine)} points: {', '.join(str(p.index) for p in mine) or '-'})")
        return

    failed = []
    for i, p in enumerate(todo, 1):
        d = sw.point_dir(sweep_dir, p)
        if _DRY_RUN.value:
            _say(shlex.join(sw.train_command(sweep, p, d, _TRAIN_FLAGS.value)))
            continue
        what = "resuming" if states[p.index] == "partial" else "starting"
        _say(f"[{i}/{len(todo)}] {p.name}: {what} (log: {os.path.join(d, sw.LOG_FILE)})")
        t0 = time.time()
        rc = _run_point(sw, sweep, p, sweep_dir)
        if rc == 0:
            m = sw.collect_point(sweep_dir, p)
            key = f"eval/{sweep.metric}"
            _say(f"  done in {time.time() - t0:.0f}s at step {m.get('step', '?')}"
                 + (f", {key} = {m[key]:.4g}" if key in m else ""))
        else:
            failed.append(p)
            _say(f"  FAILED (exit {rc}) after {time.time() - t0:.0f}s; last lines of its log:\n"
                 + _tail(os.path.join(d, sw.LOG_FILE)))
    if _DRY_RUN.value:
        return
    _collect(sw, sweep, sweep_dir)
    if failed:
        _say(f"{len(failed)} point(s) failed: {', '.join(p.name for p in failed)}")
        sys.exit(1)


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.sweep", main)
