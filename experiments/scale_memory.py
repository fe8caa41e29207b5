"""The scale table: per-device memory of the EAGLE-3 and ConFu train steps at 8B shapes, from nothing
downloaded (``launch.train --compile_only --config.model.source=abstract``), on fake CPU devices.

    python experiments/scale_memory.py --out docs/results/scale_memory.json

Grid: head (eagle3, confu) x target preset (llama-3.1-8b, qwen3-8b) x rows (2048, 4096, 8192) x
layout (8 and 32 devices; FSDP over all of them, or FSDP x tensor 4), one row of data per
data-parallel group (global batch = data x fsdp). Each point is its own process (the device count is
fixed when JAX starts); a point already in --out is not recompiled, so a killed run resumes. Prints
the table as markdown. A CPU compile of accelerator shapes overestimates (XLA:CPU converts bf16
matmul operands to float32 and schedules without an accelerator's memory pressure), see
docs/RESULTS.md "Does an 8B target fit?".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"fsdp": lambda n: (n, 1), "fsdp x tensor4": lambda n: (n // 4, 4)}


def point_key(p: dict) -> str:
    return f"{p['head']}|{p['target']}|{p['rows']}|{p['devices']}|{p['layout']}"


def run_point(head: str, target: str, rows: int, devices: int, layout: str, workdir: str, extra=()) -> dict:
    fsdp, tensor = LAYOUTS[layout](devices)
    config = f"configs/{head}.py"  # no preset of its own: --config.model.preset names the shapes
    args = [sys.executable, "-m", "launch.train", "--config", config, "--workdir", workdir, "--compile_only",
            "--cpu_devices", str(devices), "--config.model.source=abstract", f"--config.model.preset={target}",
            f"--config.data.max_length={rows}", f"--config.data.global_batch_size={fsdp}",
            "--config.train.mesh.data=1", f"--config.train.mesh.fsdp={fsdp}", f"--config.train.mesh.tensor={tensor}",
            "--config.train.progress_bar=False", *extra]
    t0 = time.time()
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    out = {"head": head, "target": target, "rows": rows, "devices": devices, "layout": layout,
           "fsdp": fsdp, "tensor": tensor, "batch": fsdp, "wall_s": round(time.time() - t0, 1)}
    if p.returncode != 0:
        return dict(out, error=(p.stderr.strip().splitlines() or ["?"])[-1][:300])
    rep = json.loads(open(os.path.join(workdir, "train_step_memory.json")).read())
    m = rep["memory_per_device"]
    return dict(out, peak_gib=round(m["peak_estimate"] / 2**30, 2), temp_gib=round(m["temp"] / 2**30, 2),
                arguments_gib=round(m["arguments"] / 2**30, 2), compile_s=rep["compile_s"],
                trainable_params=rep["trainable_params"])


def table(points: list) -> str:
    lines = ["| head | target | rows | devices | layout (fsdp x tensor) | rows / step | peak GiB / device | args GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        peak = p.get("peak_gib", "error: " + p.get("error", "?"))
        lines.append(f"| {p['head']} | {p['target']} | {p['rows']} | {p['devices']} | {p['fsdp']} x {p['tensor']} "
                     f"| {p['batch']} | {peak} | {p.get('arguments_gib', '')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/scale_memory.json")
    ap.add_argument("--heads", default="eagle3,confu")
    ap.add_argument("--targets", default="llama-3.1-8b,qwen3-8b")
    ap.add_argument("--rows", default="2048,4096,8192")
    ap.add_argument("--devices", default="8,32")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--workdir", default="/tmp/scale_memory")
    ap.add_argument("--extra", default="", help="more launch.train flags for every point, space-separated")
    a = ap.parse_args()
    done = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {point_key(p): p for p in json.load(f)["points"]}
    grid = itertools.product(a.heads.split(","), a.targets.split(","), [int(r) for r in a.rows.split(",")],
                             [int(d) for d in a.devices.split(",")], a.layouts.split(","))
    for head, target, rows, devices, layout in grid:
        key = point_key({"head": head, "target": target, "rows": rows, "devices": devices, "layout": layout})
        if key in done:
            continue
        p = run_point(head, target, rows, devices, layout, os.path.join(a.workdir, key.replace("|", "_").replace(" ", "")),
                      a.extra.split())
        done[key] = p
        print(json.dumps(p), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump({"command": "python experiments/scale_memory.py " + " ".join(sys.argv[1:]),
                       "points": list(done.values())}, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    print(table(list(done.values())))


if __name__ == "__main__":
    main()
