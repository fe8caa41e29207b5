"""The 8B table from the real compilers: train steps and decode programs at Llama-3.1-8B / Qwen3-8B
shapes compiled for TPU v5p / v5e / v6e and H100 / H200 by XLA:TPU (libtpu) and XLA:GPU (the CUDA
plugin) on this CPU host, nothing downloaded (``--config.model.source=abstract``).

    python experiments/compile_8b.py --out runs/compile_8b [--phases base,bisect,families,decode]
    python experiments/compile_8b.py --out runs/compile_8b --table      # the markdown tables
    python experiments/compile_8b.py --phases families:gpu --families dflash2,domino   # some families only

Phases, in the order they run by default — ``base,families:gpu,bisect:gpu,decode,families:tpu,bisect:tpu``,
the cheap answers first: XLA:GPU compiles an 8B step in ~25 s on 2 cores, XLA:TPU in 2-9 min (each
point is its own process; a point already in ``<out>/points.jsonl`` is not recompiled, so a killed
run resumes; the whole grid takes hours):

- ``base``: EAGLE-3 and ConFu train steps, rows of 4096, global batch 8, FSDP over the 8 chips of
  v5p-8 (``v5p:2x2x2``), v5e-8 (``v5e:2x4``), v6e-8 (``v6e:2x4``) and 8×H100 (``h100:8``): per-chip peak
  and ``fits`` (``launch.train --compile_only --topology``).
- ``bisect``: for each family's base point, the largest global batch that fits at rows of 4096 (in
  steps of the 8 data-parallel rows), or where batch 8 does not fit, the largest row length (steps of
  256) at batch 8. The search draws the line through the two measured peaks nearest the chip's memory
  and compiles the size it predicts and the next one (2-4 compiles where doubling and halving take
  6-9), falling back to the midpoint when one bound keeps moving.
- ``families``: the other families' train steps (their SmolLM2 config at the 8B preset's shapes) at the
  base point.
- ``decode``: the AR loop and EAGLE-3 / ConFu speculative loops (``chain:3`` and the tree plan
  ``dynamic:6,8,30``), 4096 cache slots, bf16, on v5e-4 and v6e-4 (a 4-way tensor mesh), one H100 and
  one H200 (unsharded) (``launch.decode_cost --topology``).

What the figures are: XLA's own memory analysis of the program compiled for that chip (per-device
peak = max(XLA's peak, arguments + outputs − donated + temporaries)), against the chip's HBM; a
program XLA:TPU refuses at compile time for memory is ``fits: false`` with the bytes it named. No
device executed anything: the step's time is not here (``experiments/accelerator_scale.sh`` on a
lent GPU). XLA:GPU compiles without autotuning (no device to tune on): the figures are for its
default tilings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_TOPOLOGIES = ("v5p:2x2x2", "v5e:2x4", "v6e:2x4", "h100:8")
DECODE_TOPOLOGIES = {"v5e:2x2": "tensor=4", "v6e:2x2": "tensor=4", "h100:1": "", "h200:1": ""}
MODELS = ("llama-3.1-8b", "qwen3-8b")
HEADS = {"eagle3": "configs/eagle3.py", "confu": "configs/confu.py"}
def _families() -> dict:
    """The other families' train steps: each training family's SmolLM2 config (``confu_jax.catalog``, so a family
    added there joins the grid), at the 8B preset's shapes; EAGLE-3.1 is a variant of the heads' entry. SD² is
    left out: it trains a separate draft model, whose size is its own config's, not a head on the 8B target."""
    if REPO not in sys.path:  # run as a script (python experiments/compile_8b.py): the package is the repo's
        sys.path.insert(0, REPO)
    from confu_jax import catalog

    fams = {"eagle31": "configs/smollm2_eagle31.py"}
    for e in catalog.training():
        if e.name not in ("head", "sd2"):
            fams[e.name] = next(c for c in e.configs if "smollm2_" in c)
    return fams


FAMILIES = _families()
PLANS = ("chain:3", "dynamic:6,8,30")
GIB = 2**30


def _key(p: dict) -> str:
    return "|".join(str(p[k]) for k in ("kind", "family", "model", "topology", "rows", "batch", "plan"))


def load(out: str) -> dict:
    path = os.path.join(out, "points.jsonl")
    if not os.path.exists(path):
        return {}
    pts = {}
    for line in open(path):
        if line.strip():
            p = json.loads(line)
            pts[_key(p)] = p
    return pts


def _append(out: str, p: dict) -> None:
    with open(os.path.join(out, "points.jsonl"), "a") as f:
        f.write(json.dumps(p) + "\n")


TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"  # confu_jax.topology.TRITON_GEMM_OFF


def _env(xla_flags: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    if xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    return env


def _error_line(stderr: str) -> str:
    """The line that says what went wrong: the CLI's one-line error or the exception's, not the
    traceback's last frame."""
    lines = stderr.strip().splitlines() or ["?"]
    said = [ln for ln in lines if re.match(r"^(launch\.\w+: |[\w.]*(Error|Exception): )", ln)]
    return (said or lines)[-1][:400]


def _report(args: list, p: dict) -> Optional[dict]:
    """Run a CLI that writes its report to ``--out``: the report, or None with ``p["error"]`` what went
    wrong; ``p["wall_s"]`` the run's seconds. Where XLA:GPU, compiling without a device, finds no valid
    default Triton tiling for a GEMM (``topology.untuned_tiling``), the point is compiled again with
    those GEMMs through cuBLAS, and ``p["xla_flags"]`` says so."""
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "r.json")
        t0 = time.time()
        r = subprocess.run([*args, "--out", rep], cwd=REPO, capture_output=True, text=True, env=_env())
        if r.returncode != 0 and "no valid default Triton tiling" in r.stderr:
            p["xla_flags"] = TRITON_GEMM_OFF
            r = subprocess.run([*args, "--out", rep], cwd=REPO, capture_output=True, text=True,
                               env=_env(TRITON_GEMM_OFF))
        p["wall_s"] = round(time.time() - t0, 1)
        if r.returncode != 0 or not os.path.exists(rep):
            p["error"] = _error_line(r.stderr)
            return None
        return json.loads(open(rep).read())


def _record(out: str, done: dict, p: dict) -> dict:
    print(json.dumps(p), flush=True)
    _append(out, p)
    done[_key(p)] = p
    return p


def train_point(out: str, done: dict, family: str, config: str, model: str, topology: str, rows: int,
                batch: int) -> dict:
    p = dict(kind="train", family=family, model=model, topology=topology, rows=rows, batch=batch, plan="-")
    if _key(p) in done:
        return done[_key(p)]
    rr = _report([sys.executable, "-m", "launch.train", "--config", config, "--compile_only", "--topology", topology,
                  "--config.model.source=abstract", f"--config.model.preset={model}", "--config.model.dtype=bfloat16",
                  f"--config.data.max_length={rows}", f"--config.data.global_batch_size={batch}",
                  "--config.train.mesh.data=1", "--config.train.mesh.fsdp=8", "--config.train.mesh.tensor=1",
                  "--config.train.progress_bar=False"], p)
    if rr is not None:
        p.update({k: rr.get(k) for k in ("platform", "device_kind", "devices", "mesh", "per_device_peak_bytes",
                                         "device_memory_bytes", "fits", "compile_s", "trainable_params")})
    return _record(out, done, p)


def _fits(p: dict) -> bool:
    return p.get("fits") is True


def _next_probe(pts: dict, lo: int, hi: Optional[int], step: int, cap: int) -> int:
    """The next size to compile between ``lo`` (fits) and ``hi`` (does not; None: not found yet): the
    straight line through the two measured peaks nearest the chip's memory, rounded down to ``step``
    and kept strictly inside (lo, hi) — a step's memory grows nearly linearly in its rows, so this
    lands in 2-4 compiles where doubling and halving take 6-9 (XLA:TPU: minutes each). Falls back to
    the midpoint when the line says nothing new."""
    meas = sorted((n, p["per_device_peak_bytes"]) for n, p in pts.items() if p.get("per_device_peak_bytes"))
    top = hi - step if hi is not None else cap
    mem = pts[lo].get("device_memory_bytes")
    guess = None
    if mem and len(meas) >= 2:
        (n0, b0), (n1, b1) = sorted(meas, key=lambda nb: abs(nb[1] - mem))[:2]
        if b1 != b0 and n1 != n0:
            slope = (b1 - b0) / (n1 - n0)
            if slope > 0:
                guess = int((n0 + (mem - b0) / slope) // step * step)
    if guess is None:
        guess = lo * 2 if hi is None else (lo + hi) // 2 // step * step
    return max(lo + step, min(top, guess))


def _search(probe, known: dict, step: int, cap: int) -> None:
    """Largest n in multiples of ``step`` with ``probe(n)`` fitting, from ``known`` (size → point, at
    least one fitting; points already compiled are reused): alternates the line's guess with the
    midpoint when one bound keeps moving (so a bend in the memory curve cannot make it crawl)."""
    pts = dict(known)
    lo = max(n for n, p in pts.items() if _fits(p))
    over = [n for n, p in pts.items() if p.get("fits") is False and n > lo]
    hi = min(over) if over else None
    last_moved, runs = None, 0
    while (hi is None or hi - lo > step) and lo < cap:
        n = _next_probe(pts, lo, hi, step, cap)
        if runs >= 2 and hi is not None:
            n = max(lo + step, min(hi - step, (lo + hi) // 2 // step * step))
        pts[n] = probe(n)
        moved = "lo" if _fits(pts[n]) else "hi"
        if moved == "lo":
            lo = n
        else:
            hi = n
        runs = runs + 1 if moved == last_moved else 1
        last_moved = moved


def _known(done: dict, family, model, topology, rows=None, batch=None) -> dict:
    """The points already compiled along one axis (batch at fixed rows, or rows at fixed batch)."""
    return {(p["batch"] if rows is not None else p["rows"]): p for p in done.values()
            if p["kind"] == "train" and (p["family"], p["model"], p["topology"]) == (family, model, topology)
            and (p["rows"] == rows if rows is not None else p["batch"] == batch)}


def bisect_batch(out, done, family, config, model, topology, rows=4096, cap=512) -> None:
    _search(lambda b: train_point(out, done, family, config, model, topology, rows, b),
            _known(done, family, model, topology, rows=rows), 8, cap)


def bisect_rows(out, done, family, config, model, topology, batch=8) -> None:
    """Where batch 8 at 4096 does not fit: halve the rows until one fits, then search up in steps of 256."""
    for r in (2048, 1024, 512, 256):
        if _fits(train_point(out, done, family, config, model, topology, r, batch)):
            break
    else:
        return
    _search(lambda r: train_point(out, done, family, config, model, topology, r, batch),
            _known(done, family, model, topology, batch=batch), 256, 4096 - 256)


def decode_points(out: str, done: dict, model: str, topology: str, plan: str) -> None:
    p = dict(kind="decode", family="eagle3,confu", model=model, topology=topology, rows=4096, batch=1, plan=plan)
    if _key(p) in done:
        return
    args = [sys.executable, "-m", "launch.decode_cost", "--models", model, "--dtype", "model", "--topology",
            topology, "--topology_plan", plan, "--topology_heads", "eagle3,confu", "--topology_max_len", "4096",
            "--mesh_head_vocab", "32000"]
    if DECODE_TOPOLOGIES[topology]:
        args += ["--mesh", DECODE_TOPOLOGIES[topology]]
    rr = _report(args, p)
    if rr is not None:
        t = rr["topology"]
        p.update(device_kind=t["device_kind"], mesh=t["mesh"], programs=[
            {k: q.get(k) for k in ("program", "per_device_peak_bytes", "device_memory_bytes", "fits",
                                   "custom_calls")} for q in t["programs"]])
    _record(out, done, p)


def _gib(b) -> str:
    return "—" if b is None else f"{b / GIB:.1f}"


def table(done: dict) -> str:
    pts = list(done.values())
    lines = ["| family | target | topology | rows × batch | per-chip peak GiB | HBM GiB | fits | largest batch at 4096 "
             "(or rows at batch 8) |", "|---|---|---|---|---|---|---|---|"]
    for p in pts:
        if p["kind"] != "train" or (p["rows"], p["batch"]) != (4096, 8):
            continue
        same = [q for q in pts if q["kind"] == "train" and all(q[k] == p[k] for k in ("family", "model", "topology"))]
        if _fits(p):
            ok = [q["batch"] for q in same if q["rows"] == 4096 and _fits(q)]
            bad = [q["batch"] for q in same if q["rows"] == 4096 and q.get("fits") is False]
            big = max(ok)
            largest = f"{big}" + (f" (not {min(b for b in bad if b > big)})" if any(b > big for b in bad) else
                                  " (≥; cap)" if big >= 512 else " (bisection not run)" if big == 8 else " (≥, so far)")
        else:
            ok = [q["rows"] for q in same if q["batch"] == 8 and _fits(q)]
            largest = f"rows {max(ok)} at batch 8" if ok else "—"
        peak = "error: " + p["error"][:80] if "error" in p else _gib(p.get("per_device_peak_bytes"))
        if p.get("xla_flags"):
            peak += " (cuBLAS GEMMs†)"
        if any(q.get("xla_flags") for q in same if q is not p):
            largest += " †"
        lines.append(f"| {p['family']} | {p['model']} | {p['topology']} | 4096 × 8 | {peak} | "
                     f"{_gib(p.get('device_memory_bytes'))} | {p.get('fits')} | {largest} |")
    lines += ["", f"† some of the search's points compiled with XLA_FLAGS={TRITON_GEMM_OFF}: XLA:GPU without a "
              "device found no valid default Triton tiling for one of their GEMMs (topology.untuned_tiling)."]
    lines += ["", "| target | device | mesh | plan | program | per-chip GiB | HBM GiB | fits |", "|---|---|---|---|---|---|---|---|"]
    for p in pts:
        if p["kind"] != "decode":
            continue
        if "error" in p:
            lines.append(f"| {p['model']} | {p['topology']} | — | {p['plan']} | error: {p['error'][:80]} | | | |")
            continue
        for q in p["programs"]:
            lines.append(f"| {p['model']} | {p['topology']} | {p['mesh'] or 'one device'} | {p['plan']} | {q['program']} "
                         f"| {_gib(q['per_device_peak_bytes'])} | {_gib(q['device_memory_bytes'])} | {q['fits']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/compile_8b")
    ap.add_argument("--phases", default="base,families:gpu,bisect:gpu,decode,families:tpu,bisect:tpu",
                    help="in order; bisect / families take :gpu or :tpu (XLA:GPU compiles an 8B step in ~25 s "
                         "here, XLA:TPU in 2-9 min, so the cheap answers come first)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--families", default="", help="families / bisect: only these (comma-separated names of "
                    f"{sorted({**HEADS, **FAMILIES})}); '' = all")
    ap.add_argument("--topologies", default="", help="base / families / bisect: only these of "
                    f"{list(TRAIN_TOPOLOGIES)} (comma-separated); '' = all (after a phase's :gpu / :tpu)")
    ap.add_argument("--table", action="store_true", help="print the tables from what is done, compile nothing")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    done = load(a.out)
    if a.table:
        print(table(done))
        return
    models = [m for m in a.models.split(",") if m]
    only_families = {f for f in a.families.split(",") if f}
    if only_families - set({**HEADS, **FAMILIES}):
        raise SystemExit(f"--families {sorted(only_families - set({**HEADS, **FAMILIES}))}: unknown; expected some "
                         f"of {sorted({**HEADS, **FAMILIES})}")
    only_topologies = {t for t in a.topologies.split(",") if t}
    if only_topologies - set(TRAIN_TOPOLOGIES):
        raise SystemExit(f"--topologies {sorted(only_topologies - set(TRAIN_TOPOLOGIES))}: unknown; expected some of "
                         f"{list(TRAIN_TOPOLOGIES)}")
    chosen = {f: c for f, c in {**HEADS, **FAMILIES}.items() if not only_families or f in only_families}
    for phase in a.phases.split(","):
        phase, _, only = phase.partition(":")
        topologies = [t for t in TRAIN_TOPOLOGIES if (not only or (t.startswith("h") == (only == "gpu")))
                      and (not only_topologies or t in only_topologies)]
        if phase == "base":
            for model in models:
                for topo in topologies:
                    for fam, cfg in HEADS.items():
                        train_point(a.out, done, fam, cfg, model, topo, 4096, 8)
        elif phase == "decode":
            for plan in PLANS:
                for topo in DECODE_TOPOLOGIES:
                    for model in models:
                        decode_points(a.out, done, model, topo, plan)
        elif phase == "bisect":
            for model in models:
                for topo in topologies:
                    for fam, cfg in chosen.items():
                        if _fits(train_point(a.out, done, fam, cfg, model, topo, 4096, 8)):
                            bisect_batch(a.out, done, fam, cfg, model, topo)
                        else:
                            bisect_rows(a.out, done, fam, cfg, model, topo)
        elif phase == "families":
            for model in models:
                for topo in topologies:
                    for fam, cfg in FAMILIES.items():
                        if fam in chosen:
                            train_point(a.out, done, fam, cfg, model, topo, 4096, 8)
        else:
            raise SystemExit(f"unknown phase {phase!r}: expected base, decode, bisect[:gpu|:tpu], families[:gpu|:tpu]")
    print(table(done))


if __name__ == "__main__":
    main()
