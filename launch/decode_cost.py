"""What a decode step and a verification pass cost, against the memory floor.

    python -m launch.decode_cost [--models smollm2-135m,llama-3.2-3b,llama-3.1-8b] \\
        [--caches 1024,4096] [--tokens 1,30,60,120] [--measure] [--out runs/decode_cost.json]

Two parts:

1. **Bytes and FLOPs from XLA's cost analysis** of the compiled target forward (the layer-unrolled
   program the CPU decode loops run, per-layer cache buffers) for T new tokens against a cache of S
   slots, batch 1, compiled for shapes only (no weights needed: Llama-3.1-8B compiles in seconds).
   T = 1 is an AR step; EAGLE-3 verifies T tree nodes and ConFu 2T tokens (nodes + contemplates),
   so T = 30 / 60 / 120 cover the paper's budgets. The floor is what the hardware must move:
   every weight read once, the cache's S slots read once, the T new K/V entries written. The
   ratio ``bytes / floor`` is the table's point; the last line is ``max bytes/floor: X`` over the
   Llama-3.1-8B programs.

   Limits: these are XLA:CPU's compiled programs, a proxy for accelerator traffic. XLA:CPU computes
   bf16 dots in float32 (it converts the operands: ~5x the weight bytes), so by default every
   model is analysed in float32 (``--dtype model`` keeps each preset's dtype) and the ratio measures
   the program's structure, not the CPU's bf16 support; fusion decisions differ by backend, and a
   GPU runs verification attention in the Pallas kernel (scores stay on chip), not XLA's dots; cost analysis counts each
   fusion's operands and outputs once (cache effects invisible). Read ratios as "where bytes go",
   not as a GPU prediction.

2. ``--measure``: on this machine, SmolLM2 (fp32, batch 1, the embedded asset) — the measured stream
   bandwidth (an XLA sum over 1 GiB), the AR step's wall time, and the wall time of one speculative
   iteration (draft + verification + accept/commit) of EAGLE-3 and ConFu chain:3 with random heads
   (τ ≈ 1, so one iteration ≈ one emitted token: the cost of a pass, not a speed-up), each as a
   ratio to the AR step and to the floor. Per-step times are differences of two AOT-compiled runs
   (N tokens minus 1 token) over the extra steps, medians over repeats. Run it on an idle machine.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from confu_jax.bench.decode_cost import floor_bytes, forward_cost, stream_bandwidth

flags.DEFINE_string("models", "smollm2-135m,llama-3.2-3b,llama-3.1-8b", "model presets (comma-separated)")
flags.DEFINE_string("caches", "1024,4096", "cache lengths S (valid slots)")
flags.DEFINE_string("tokens", "1,30,60,120", "new tokens T per forward (1 = AR step)")
flags.DEFINE_string("dtype", "float32", "parameter/compute dtype of the analysed programs: 'float32' "
                    "(default: XLA:CPU computes bf16 dots in f32, so a bf16 program's bytes measure CPU "
                    "conversions) or 'model' (each preset's own dtype)")
flags.DEFINE_bool("measure", False, "also time SmolLM2 on this machine (AR step, EAGLE-3 / ConFu passes)")
flags.DEFINE_integer("prompt_len", 300, "--measure: prompt tokens")
flags.DEFINE_integer("new_tokens", 48, "--measure: tokens generated per timed run")
flags.DEFINE_integer("repeats", 3, "--measure: timed repeats (median)")
flags.DEFINE_string("out", "", "write the results JSON here too")
FLAGS = flags.FLAGS


def _ints(s: str) -> list:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise app.UsageError(f"expected comma-separated integers, got {s!r}")


def _median_time(run, params, args, repeats: int):
    import jax

    jax.block_until_ready(run(params, *args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(params, *args))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], out


def measure_smollm2(prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from confu_jax.decode.generate import compile_ar
    from confu_jax.decode.heads import random_head
    from confu_jax.decode.loop import compile_speculative
    from confu_jax.decode.plans import parse_plan
    from confu_jax.weights import load_model

    cfg, params = load_model("smollm2-135m-instruct")
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, cfg.vocab_size - 100, prompt_len)]
    max_len = prompt_len + new_tokens + 16
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    bw = stream_bandwidth()
    floor_s = floor_bytes(cfg, n_bytes, prompt_len + new_tokens // 2, 1) / bw
    res = {"bandwidth_gib_s": bw / 2 ** 30, "floor_ms": floor_s * 1e3, "prompt_len": prompt_len,
           "new_tokens": new_tokens}

    def per_step(compile_fn, count):
        long_run, long_args = compile_fn(new_tokens)
        short_run, short_args = compile_fn(1)
        t_long, out = _median_time(long_run, params_for[0], long_args, repeats)
        t_short, _ = _median_time(short_run, params_for[0], short_args, repeats)
        return (t_long - t_short) / max(1, count(out)), out

    params_for = [params]
    kw = dict(eos_ids=(), max_len=max_len)
    ar_s, _ = per_step(lambda n: compile_ar(params, cfg, [prompt], max_new_tokens=n, **kw),
                       lambda out: new_tokens - 1)
    res["ar_step_ms"] = ar_s * 1e3
    res["ar_step_over_floor"] = ar_s / floor_s
    print(f"SmolLM2 AR step: {ar_s * 1e3:.1f} ms = {ar_s / floor_s:.2f}x the floor "
          f"({floor_s * 1e3:.1f} ms at {bw / 2 ** 30:.1f} GiB/s)", flush=True)
    plan = parse_plan("chain:3")
    for method in ("eagle3", "confu"):
        head = random_head(method, cfg, params)
        params_for[0] = head.params

        def compile_fn(n, head=head):
            return compile_speculative(head.spec, head.params, plan, [prompt], max_new_tokens=n, **kw)

        it_s, out = per_step(compile_fn, lambda out: int(np.asarray(out.n_passes_b)[0]))
        res[f"{method}_pass_ms"] = it_s * 1e3
        res[f"{method}_pass_over_ar"] = it_s / ar_s
        print(f"SmolLM2 {method} chain:3 iteration (draft + verify + accept): {it_s * 1e3:.1f} ms = "
              f"{it_s / ar_s:.2f}x an AR step", flush=True)
    return res


def main(argv):
    del argv
    from confu_jax.models.presets import get_preset

    results = {"programs": {}, "dtype": FLAGS.dtype}
    worst = None
    print(f"{'model':<14} {'S':>5} {'T':>4} {'GB accessed':>12} {'GB floor':>9} {'bytes/floor':>11} {'GFLOP':>9}")
    for name in [m.strip() for m in FLAGS.models.split(",") if m.strip()]:
        try:
            cfg = get_preset(name)
        except KeyError as e:
            raise app.UsageError(str(e))
        if FLAGS.dtype != "model":
            cfg = cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
        rows = []
        for s_len in _ints(FLAGS.caches):
            for t in _ints(FLAGS.tokens):
                r = forward_cost(cfg, s_len, t)
                rows.append(r)
                print(f"{name:<14} {s_len:>5} {t:>4} {r['bytes_accessed'] / 1e9:>12.2f} {r['floor_bytes'] / 1e9:>9.2f} "
                      f"{r['bytes_over_floor']:>11.2f} {r['flops'] / 1e9:>9.1f}", flush=True)
                if name == "llama-3.1-8b":
                    worst = max(worst or 0.0, r["bytes_over_floor"])
        results["programs"][name] = rows
    if FLAGS.measure:
        results["measured_smollm2"] = measure_smollm2(FLAGS.prompt_len, FLAGS.new_tokens, FLAGS.repeats)
    if worst is not None:
        results["max_bytes_over_floor_8b"] = worst
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)
    if worst is not None:
        print(f"max bytes/floor: {worst:.2f}")


if __name__ == "__main__":
    app.run(main)
