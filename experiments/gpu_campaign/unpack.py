"""Here again: check and extract what the calls brought back."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import tarfile

from experiments.gpu_campaign.common import read_json
from experiments.gpu_campaign.steps import rebuild_eagle3_checkpoint, rebuild_workdir


def cmd_unpack(args) -> int:
    """Check and extract the artifacts of every call's files (folders given in any order)."""
    pieces, statuses = {}, []
    for d in args.dirs:
        for p in glob.glob(os.path.join(d, "*")):
            base = os.path.basename(p)
            if base == "status.json":
                statuses.append(read_json(p))
            elif re.match(r".+\.tar\.\d{3}$", base):
                pieces[base] = p
    if not statuses:
        print("no status.json in the folders given", file=sys.stderr)
        return 1
    latest = max(statuses, key=lambda s: s["call"])
    os.makedirs(args.dest, exist_ok=True)
    report = {}
    for name, art in latest["artifacts"].items():
        missing = [p["file"] for p in art["pieces"] if p["file"] not in pieces]
        if missing:
            report[name] = f"incomplete: missing {missing}"
            continue
        h = hashlib.sha256()
        tar_path = os.path.join(args.dest, f"{name}.tar")
        with open(tar_path, "wb") as out:
            for p in art["pieces"]:
                data = open(pieces[p["file"]], "rb").read()
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    raise SystemExit(f"{pieces[p['file']]}: sha256 differs from status.json's")
                h.update(data)
                out.write(data)
        if h.hexdigest() != art["sha256"]:
            raise SystemExit(f"{name}: the reassembled tar's sha256 differs from status.json's")
        with tarfile.open(tar_path) as tar:
            tar.extractall(args.dest, filter="data")
        os.remove(tar_path)
        report[name] = "extracted"
    base = os.path.join(args.dest, "gpu_campaign")
    confu = os.path.join(base, "heads", "confu_bf16")
    if os.path.isdir(confu) and not args.no_rebuild:
        rebuild_workdir(confu, os.path.join(base, "heads", "confu_workdir"))
        report["confu_workdir"] = os.path.join(base, "heads", "confu_workdir")
        run = os.path.join(base, "runs", "confu")
        if os.path.isfile(os.path.join(run, "metrics.csv")):  # the run itself, for launch.release_head
            rebuild_workdir(confu, run)
            report["confu_run"] = run
    eagle3 = os.path.join(base, "heads", "eagle3_official")
    run = os.path.join(base, "runs", "eagle3")
    if os.path.isdir(eagle3) and os.path.isfile(os.path.join(run, "config.json")) and not args.no_rebuild:
        step = read_json(os.path.join(eagle3, "campaign_head.json"))["steps"]
        rebuild_eagle3_checkpoint(eagle3, run, step)
        report["eagle3_run"] = run
    print(json.dumps({"status": latest["status"], "call": latest["call"], "artifacts": report, "dest": base}, indent=1))
    for rel in sorted(glob.glob(os.path.join(base, "release", "*"))):
        print(f"data release: cp -r {rel} releases/data/  (then git add it: manifest and parts in one commit)")
    return 0
