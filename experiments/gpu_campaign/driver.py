"""There, every call: the stage driver (``python -m experiments.gpu_campaign run``)."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import time
from typing import Optional

from experiments.gpu_campaign import common
from experiments.gpu_campaign.common import (CampaignError, STAGES, kill_group, reap_leftover, format_row, now_iso,
                                             read_json, resolve_scale, sha256_file, write_json)
from experiments.gpu_campaign.stages_data import DataStages
from experiments.gpu_campaign.stages_train import TrainStages


class Campaign(DataStages, TrainStages):
    """One call's stage driver: the state directory, the time left, stage commands in their own process
    groups, and the artifacts delivered to ``$OUT``. The stages themselves are ``stages_data`` and
    ``stages_train``."""

    def __init__(self, state_dir: str, bundle_dir: str, out_dir: str, scale_name: str, env=None):
        self.t0 = time.time()
        self.dir = os.path.abspath(state_dir)
        self.bundle_dir = os.path.abspath(bundle_dir)
        self.out = os.path.abspath(out_dir)
        os.makedirs(self.dir, exist_ok=True)
        os.makedirs(self.out, exist_ok=True)
        self.state_path = os.path.join(self.dir, "state.json")
        self.state = read_json(self.state_path, {}) or {}
        first = not self.state
        self.scale = resolve_scale(self.state.get("scale_name", scale_name), env)
        if first:
            self.state = {"created": now_iso(), "first_call_t": self.t0, "scale_name": scale_name,
                          "scale": dataclasses.asdict(self.scale), "stages": {}, "calls": [], "artifacts": {}}
        self.call_index = len(self.state["calls"]) + 1
        self.state["calls"].append({"index": self.call_index, "started": now_iso(), "t": self.t0,
                                    "carried": self._carried()})
        self.log_path = os.path.join(self.dir, "logs", f"call-{self.call_index:02d}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.deadline = self.t0 + self.scale.call_s
        reap_leftover(self.state.pop("child", None), self.log)
        self.save()

    # -- bookkeeping
    def _carried(self) -> list[str]:
        return sorted(os.path.basename(d) for d in glob.glob(os.path.join(self.bundle_dir, "call*"))
                      if os.path.isdir(d))

    def save(self) -> None:
        write_json(self.state_path, self.state)

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def stage(self, name: str) -> dict:
        return self.state["stages"].setdefault(name, {"status": "pending", "seconds": 0.0})

    def left(self) -> float:
        """Seconds this call may still work (the delivery margin kept)."""
        return self.deadline - time.time() - self.scale.margin_s

    def campaign_left(self) -> float:
        return self.state["first_call_t"] + self.scale.total_s - time.time()

    def path(self, *p) -> str:
        return os.path.join(self.dir, *p)

    def bundle_meta(self) -> Optional[dict]:
        for d in sorted(glob.glob(os.path.join(self.bundle_dir, "call*"))):
            b = read_json(os.path.join(d, "bundle.json"))
            if b:
                self.state["bundle"] = b
                return b
        return self.state.get("bundle")

    def env(self, cpu: bool = False) -> dict:
        env = dict(os.environ)
        paths = [self.path("site"), self.path("assets"), common.ROOT]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cache = self.path("compile_cache")
        env.update(PYTHONUNBUFFERED="1", CONFU_JAX_COMPILE_CACHE=cache, JAX_COMPILATION_CACHE_DIR=cache,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", TF_CPP_MIN_LOG_LEVEL="1")
        if cpu:
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def run_cmd(self, name: str, cmd: list, timeout: float, cpu: bool = False, on_poll=None,
                extra_env: Optional[dict] = None) -> tuple[int, bool]:
        """Run ``cmd`` (output to logs/<name>.log) for at most ``timeout`` seconds; then SIGTERM
        (launch.train checkpoints and stops; generate_data loses only conversations in flight),
        SIGKILL 60 s later. ``on_poll(proc)`` runs every few seconds and may ask for a stop by
        returning True. Returns (exit code, stopped by us)."""
        log_file = self.path("logs", f"{name}.log")
        self.log(f"{name}: {' '.join(shlex.quote(str(c)) for c in cmd)}  (at most {timeout:.0f} s)")
        t = time.time()
        with open(log_file, "a") as lf:
            lf.write(f"\n===== call {self.call_index} {now_iso()}: {' '.join(map(str, cmd))}\n")
            lf.flush()
            # its own process group, so that its helpers (grain workers) go with it; recorded, so a
            # later call ends it if this driver was killed before it could
            proc = subprocess.Popen([str(c) for c in cmd], cwd=common.ROOT, env={**self.env(cpu), **(extra_env or {})},
                                    stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            self.state["child"] = {"pid": proc.pid, "name": name}
            self.save()
            stopped = False
            try:
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        pass
                    if proc.poll() is not None:
                        break
                    want_stop = on_poll(proc) if on_poll else False
                    if (want_stop or time.time() - t > timeout) and not stopped:
                        stopped = True
                        self.log(f"{name}: {'target reached' if want_stop else 'time box reached'}, stopping it "
                                 "(SIGTERM: training checkpoints at the next step)")
                        proc.send_signal(signal.SIGTERM)  # the main process only: it stops its own helpers
                        try:  # never past the call's 600 s: the tool kills the command there
                            proc.wait(timeout=max(5.0, min(90.0, self.t0 + 585 - time.time())))
                        except subprocess.TimeoutExpired:
                            self.log(f"{name}: still running, SIGKILL")
            finally:
                kill_group(proc.pid)  # whatever is left of it (or all of it, if this driver is interrupted)
                proc.wait()
                self.state.pop("child", None)
                self.save()
        rc = proc.returncode
        self.log(f"{name}: exit {rc} after {time.time() - t:.0f} s")
        if rc != 0:  # failed, or stopped by the time box: what it was doing goes into this call's log
            with open(log_file, errors="replace") as f:
                tail = f.read()[-3000 if not stopped else -1200:]
            self.log(f"{name}: {'stopped' if stopped else 'FAILED'}; the end of logs/{name}.log:\n{tail}")
        return rc, stopped

    # -- stages

    def add_artifact(self, name: str, members: list) -> None:
        """Queue ``members`` [(path here, name in the tar)] as artifact ``name`` (tar, split into pieces)."""
        os.makedirs(self.path("deliver"), exist_ok=True)
        tar_path = self.path("deliver", f"{name}.tar")
        with tarfile.open(tar_path + ".tmp", "w") as tar:
            for src, arc in members:
                if os.path.exists(src):
                    tar.add(src, arcname=f"gpu_campaign/{arc}")
        os.replace(tar_path + ".tmp", tar_path)
        size, digest = os.path.getsize(tar_path), sha256_file(tar_path)
        pieces = []
        with open(tar_path, "rb") as f:
            i = 0
            while True:
                data = f.read(common.PIECE_BYTES)
                if not data and i > 0:
                    break
                pname = f"{name}.tar.{i:03d}"
                with open(self.path("deliver", pname), "wb") as g:
                    g.write(data)
                pieces.append({"file": pname, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                               "delivered_call": None})
                i += 1
                if not data:
                    break
        os.remove(tar_path)
        self.state["artifacts"][name] = {"bytes": size, "sha256": digest, "pieces": pieces, "created_call": self.call_index}
        self.save()

    def results_artifact(self) -> None:
        members = [(self.path("bench"), "bench"), (self.path("data_summary.json"), "data_summary.json"),
                   (self.path("model_digest.json"), "model_digest.json")]
        members += [(f, f"data/{os.path.basename(f)}") for f in glob.glob(self.path("data", "*_summary.json"))]
        members += [(self.path("state.json"), "state.json"), (self.path("logs"), "logs")]
        for run in ("eagle3", "confu", *self.family_costs()):
            for f in ("config.json", "target.json", "metrics.csv", "eval.csv", "init_from.json", "bad_records.log"):
                members.append((self.path("runs", run, f), f"runs/{run}/{f}"))
        self.add_artifact("results", members)

    def deliver(self) -> list[str]:
        """Copy pending pieces into $OUT within the limits, status.json and this call's log first."""
        os.makedirs(self.out, exist_ok=True)
        budget_files, budget_bytes = common.OUT_FILES - 2, common.OUT_BYTES - 2 * 2**20
        sent = []
        order = ["results", "eagle3_head", "confu_head", "data_release"]
        for name in sorted(self.state["artifacts"], key=lambda n: order.index(n) if n in order else 99):
            for piece in self.state["artifacts"][name]["pieces"]:
                if piece["delivered_call"] is not None:
                    continue
                if budget_files < 1 or piece["bytes"] > budget_bytes:
                    break
                shutil.copyfile(self.path("deliver", piece["file"]), os.path.join(self.out, piece["file"]))
                piece["delivered_call"] = self.call_index
                budget_files -= 1
                budget_bytes -= piece["bytes"]
                sent.append(piece["file"])
        return sent

    def pending_pieces(self) -> int:
        return sum(1 for a in self.state["artifacts"].values() for p in a["pieces"] if p["delivered_call"] is None)


def _on_sigterm(signum, frame):
    raise CampaignError("the driver was told to stop (SIGTERM)")


def cmd_run(args) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop the stage's process and still write $OUT
    c = Campaign(args.state, args.bundle, args.out, args.scale)
    stop_after = os.environ.get("CAMPAIGN_STOP_AFTER", "")
    status, error = "running", None
    c.log(f"call {c.call_index}: carried {c.state['calls'][-1]['carried'] or 'nothing'}; "
          f"{c.left():.0f} s for work; campaign time left {c.campaign_left():.0f} s")
    try:
        for name in STAGES:
            st = c.stage(name)
            if st["status"] == "done":
                continue
            result = "later"
            while c.left() >= 20:
                st["status"] = "running"
                t = time.time()
                result = getattr(c, f"st_{name}")()
                st["seconds"] = st.get("seconds", 0.0) + time.time() - t
                c.save()
                if result != "again":
                    break
                result = "later"
            if result == "done":
                st.update(status="done", finished_call=c.call_index)
                c.save()
                if name == stop_after:
                    status = f"stopped after {name} (CAMPAIGN_STOP_AFTER)"
                    break
                continue
            st["status"] = "waiting" if result == "wait" else "partial"
            status = "waiting for the next call's bundle" if result == "wait" else f"{name} continues in the next call"
            break
        else:
            status = "complete"
    except CampaignError as e:
        status, error = "error", str(e)
        c.log(f"ERROR: {e}")
    except Exception as e:  # noqa: BLE001 - deliver what exists, then fail
        status, error = "error", f"{type(e).__name__}: {e}"
        c.log(f"ERROR: {error}")
    if status == "complete" and "results" not in c.state["artifacts"]:
        c.results_artifact()
    sent = c.deliver()
    pending = c.pending_pieces()
    if status == "complete" and pending:
        status = "complete; pieces left to deliver"
    c.state["calls"][-1].update(ended=now_iso(), seconds=round(time.time() - c.t0, 1), status=status,
                                delivered=sent, error=error)
    c.save()
    status_doc = {"status": status, "error": error, "call": c.call_index, "stages": c.state["stages"],
                  "plan": c.state.get("plan"), "artifacts": c.state["artifacts"], "calls": c.state["calls"],
                  "scale": c.state["scale"]}
    write_json(os.path.join(c.out, "status.json"), status_doc)
    shutil.copyfile(c.log_path, os.path.join(c.out, os.path.basename(c.log_path)))
    # the summary the lead reads in output_tail
    print("\n===== GPU campaign, call %d: %s" % (c.call_index, status))
    for name in STAGES:
        st = c.stage(name)
        print(f"  {name:8s} {st['status']:8s} {st.get('seconds', 0):7.0f} s")
    bench = c.stage("bench").get("info")
    if bench:
        for row in bench["rows"]:
            print("  " + format_row(row))
    print(f"  delivered this call: {sent or 'nothing'}; pieces still to deliver: {pending}")
    if error:
        print(f"ERROR: {error}")
        return 1
    if status == "complete":
        print("CAMPAIGN COMPLETE")
    elif status.startswith("waiting"):
        nxt = c.stage("model").get("info", {}).get("next_call", "call2")
        print(f"NEXT: the next call, carrying .gpu_bundle/{nxt}")
    else:
        print("NEXT: the same command again, carrying nothing (it resumes)")
    return 0
