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

2. ``--measure``: on this machine, a target at batch 1 — SmolLM2 (fp32, the embedded asset) by default,
   or ``--measure_model random:<preset>`` (the preset's shapes with random weights made on the device,
   ``--measure_dtype model`` for its own bf16: ``random:llama-3.1-8b`` on one GPU; a step's cost does
   not depend on the values) — the measured stream
   bandwidth (best of 7 XLA sums over 1 GiB), the AR step's wall time, and the wall time of one
   speculative iteration (draft + verification + accept/commit) of EAGLE-3 and ConFu chain:3 with
   random heads of ``--draft_vocab`` rows (τ ≈ 1, so one iteration ≈ one emitted token: the cost of
   a pass, not a speed-up), each as a ratio to the AR step and to the floor. Per-step times are
   differences of two AOT-compiled runs (N tokens minus 1 token) over the extra steps; all programs
   are timed round-robin, medians over ``--repeats`` rounds. Then (``--measure_split``, default on)
   one iteration alone, split into draft / verify / accept+commit (differences of three programs on
   the same state), at T = 0 and T = 0.7 (the sampled rule's extra cost). Run it on an idle machine.

3. ``--mesh tensor=8`` (any ``data=D,fsdp=F,tensor=T``): what each device holds when the decode loops
   run sharded (``confu_jax.decode.sharded``, the training table's rules): per model, the target's
   parameter bytes and those of the target with an EAGLE-3 / ConFu head (``--mesh_head_vocab``
   draft rows), in the preset's own dtype — total, sharded, replicated, and the largest per-device
   share (from the shardings' index maps) — then the AR and speculative (ConFu, ``--mesh_plan``)
   programs are lowered on the mesh with scanned layers, and for TPU (``lowering_platforms``) when
   this JAX can. Shape-only: no weights, nothing compiled. On CPU the mesh's devices are faked
   (``--xla_force_host_platform_device_count``).
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from confu_jax import storage
from confu_jax.bench.decode_cost import floor_bytes, forward_cost, split_iteration, stream_bandwidth

flags.DEFINE_string("models", "smollm2-135m,llama-3.2-3b,llama-3.1-8b", "model presets (comma-separated)")
flags.DEFINE_string("caches", "1024,4096", "cache lengths S (valid slots)")
flags.DEFINE_string("tokens", "1,30,60,120", "new tokens T per forward (1 = AR step)")
flags.DEFINE_string("dtype", "float32", "parameter/compute dtype of the analysed programs: 'float32' "
                    "(default: XLA:CPU computes bf16 dots in f32, so a bf16 program's bytes measure CPU "
                    "conversions) or 'model' (each preset's own dtype)")
flags.DEFINE_bool("measure", False, "also time a target on this machine (AR step, EAGLE-3 / ConFu passes)")
flags.DEFINE_string("measure_model", "smollm2-135m-instruct", "--measure: the target timed: a model source "
                    "(the embedded asset, a .gguf, a checkpoint directory) or 'random:<preset>' — the preset's "
                    "shapes filled with random weights on the device (a step's cost does not depend on the "
                    "values; no download: e.g. random:llama-3.1-8b on one GPU)")
flags.DEFINE_enum("measure_dtype", "float32", ["float32", "model"], "--measure with random:<preset>: float32 "
                  "(as the CPU recipe) or the preset's own dtype (bfloat16 for the 8B presets)")
flags.DEFINE_bool("measure_split", True, "--measure: also time one iteration split into draft / verify / "
                  "accept+commit at T = 0 and 0.7 (twelve more programs to compile)")
flags.DEFINE_integer("prompt_len", 300, "--measure: prompt tokens")
flags.DEFINE_integer("new_tokens", 96, "--measure: tokens generated per timed run")
flags.DEFINE_integer("repeats", 5, "--measure: timed rounds (every program once per round; medians)")
flags.DEFINE_integer("draft_vocab", 4096, "--measure: draft vocabulary of the random heads (the CPU "
                     "recipe's 4096; the draft LM head's rows are part of every draft step)")
flags.DEFINE_string("mesh", "", "also report per-device parameter bytes and lower the decode loops on this "
                    "mesh, e.g. tensor=8 or data=2,tensor=4 (axes data, fsdp, tensor; empty = skip)")
flags.DEFINE_string("mesh_plan", "dynamic:6,8,30", "--mesh: draft plan of the lowered speculative loop")
flags.DEFINE_integer("mesh_head_vocab", 32000, "--mesh: draft vocabulary rows of the heads counted")
flags.DEFINE_bool("mesh_lower", True, "--mesh: also lower the AR / speculative loops (and for TPU)")
flags.DEFINE_string("topology", "", "compile the decode programs for this hardware with its own compiler, "
                    "from any machine, instead of the CPU cost table: a TPU topology as JAX names it (v5e:2x2, "
                    "v6e:2x2, v5p:2x2x2) or h100:N / h200:N. Per model: the AR loop and the speculative loop "
                    "(EAGLE-3 head, --topology_plan), one device unsharded, or over --mesh's sizes of the "
                    "topology's devices; per-device memory against the device's, and the custom calls in "
                    "each program (no CPU one may reach a TPU or GPU program)")
flags.DEFINE_string("topology_plan", "chain:3", "--topology: the speculative loop's draft plan")
flags.DEFINE_string("topology_heads", "eagle3", "--topology: the heads whose speculative loop is compiled "
                    "(comma-separated: eagle3, confu; ConFu's adds its contemplate tokens and soft prompts)")
flags.DEFINE_integer("topology_max_len", 128, "--topology: cache slots of the compiled loops (the decode "
                     "memory table uses 4096; the default keeps the compile lane's programs small)")
flags.DEFINE_string("out", "", "write the results JSON here too")
FLAGS = flags.FLAGS


def _ints(s: str) -> list:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise app.UsageError(f"expected comma-separated integers, got {s!r}")


def measure_target(source: str):
    """``(cfg, params)`` of the target ``--measure`` times: ``random:<preset>`` fills the preset's
    shapes with random values on the default device (``--measure_dtype``), anything else loads."""
    import jax

    if source.startswith("random:"):
        from confu_jax.models.llama import init_params
        from confu_jax.models.presets import get_preset

        try:
            cfg = get_preset(source[len("random:"):])
        except KeyError as e:
            raise app.UsageError(f"--measure_model: {e}")
        if FLAGS.measure_dtype == "float32":
            cfg = cfg.replace(dtype="float32", param_dtype="float32")
        return cfg, jax.jit(lambda r: init_params(cfg, r))(jax.random.PRNGKey(0))
    from confu_jax.weights import load_model

    return load_model(source)


def measure(source: str, prompt_len: int, new_tokens: int, repeats: int, draft_vocab: int = 4096,
            split: bool = True) -> dict:
    import jax
    import numpy as np

    from confu_jax.decode.generate import compile_ar
    from confu_jax.decode.drafting import random_head
    from confu_jax.decode.drafting import HeadDrafter
    from confu_jax.decode.loop import compile_speculative
    from confu_jax.decode.plans import parse_plan

    cfg, params = measure_target(source)
    name = source.split(":", 1)[-1] if source.startswith("random:") else "SmolLM2" if source == "smollm2-135m-instruct" \
        else source
    rng = np.random.default_rng(0)
    lo = min(100, cfg.vocab_size // 4)  # clear of the special ids at either end
    prompt = [int(x) for x in rng.integers(lo, cfg.vocab_size - lo, prompt_len)]
    max_len = prompt_len + new_tokens + 16
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    bw = stream_bandwidth()
    floor_s = floor_bytes(cfg, n_bytes, prompt_len + new_tokens // 2, 1) / bw
    res = {"model": source, "dtype": str(jax.tree_util.tree_leaves(params)[0].dtype),
           "device": jax.devices()[0].device_kind, "bandwidth_gib_s": bw / 2 ** 30, "floor_ms": floor_s * 1e3,
           "prompt_len": prompt_len, "new_tokens": new_tokens}

    # Every program is compiled first, then all are timed round-robin (one call each per round,
    # medians over rounds), so a slow spell of the machine hits every figure alike.
    kw = dict(eos_ids=(), max_len=max_len)
    plan = HeadDrafter(parse_plan("chain:3"))
    heads = {m: random_head(m, cfg, params, draft_vocab_size=draft_vocab) for m in ("eagle3", "confu")}
    progs = {}  # name -> (compiled, its parameter arguments, args)
    for n in (new_tokens, 1):
        run, args = compile_ar(params, cfg, [prompt], max_new_tokens=n, **kw)
        progs[("ar", n)] = (run, (params,), args)
        for m, head in heads.items():
            run, args = compile_speculative(head.target, plan, head.drafter_params, [prompt], max_new_tokens=n, **kw)
            progs[(m, n)] = (run, (head.target, head.drafter_params), args)
    times = {k: [] for k in progs}
    outs = {}
    for k, (run, p, args) in progs.items():  # warm-up
        outs[k] = jax.block_until_ready(run(*p, *args))
    for _ in range(repeats):
        for k, (run, p, args) in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(*p, *args))
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}

    def per_step(name, count):
        return (med[(name, new_tokens)] - med[(name, 1)]) / max(1, count)

    ar_s = per_step("ar", new_tokens - 1)
    res["ar_step_ms"] = ar_s * 1e3
    res["ar_step_over_floor"] = ar_s / floor_s
    print(f"{name} AR step: {ar_s * 1e3:.1f} ms = {ar_s / floor_s:.2f}x the floor "
          f"({floor_s * 1e3:.1f} ms at {bw / 2 ** 30:.1f} GiB/s)", flush=True)
    for method, head in heads.items():
        passes = int(np.asarray(outs[(method, new_tokens)].n_passes_b)[0]) - int(
            np.asarray(outs[(method, 1)].n_passes_b)[0])
        it_s = per_step(method, passes)
        res[f"{method}_pass_ms"] = it_s * 1e3
        res[f"{method}_pass_over_ar"] = it_s / ar_s
        print(f"{name} {method} chain:3 iteration (draft + verify + accept): {it_s * 1e3:.1f} ms = "
              f"{it_s / ar_s:.2f}x an AR step", flush=True)
    for method, head in (heads.items() if split else ()):
        for temp in (0.0, 0.7):
            sp = split_iteration(head, plan, prompt, max_len, max(repeats, 15), temperature=temp)
            res[f"{method}_split_T{temp:g}"] = sp
            print(f"  one {method} iteration alone, T={temp:g} ({sp['rule']}): {sp['iteration_ms']:.1f} ms = "
                  f"draft {sp['draft_ms']:.1f} + verify {sp['verify_ms']:.1f} + accept/commit "
                  f"{sp['accept_commit_ms']:.1f} ms", flush=True)
        ratio = res[f"{method}_split_T0.7"]["iteration_ms"] / res[f"{method}_split_T0"]["iteration_ms"]
        res[f"{method}_sampled_over_greedy"] = ratio
        print(f"  {method}: a T=0.7 iteration costs {ratio:.2f}x a T=0 iteration", flush=True)
    return res


def sharded_report(name: str, mesh, plan_text: str, head_vocab: int, lower: bool) -> dict:
    """Per-device parameter bytes of ``name`` (target alone, + EAGLE-3 head, + ConFu head) on
    ``mesh``, and whether its decode loops lower there and for TPU."""
    import jax

    from confu_jax.decode import sharded, tracing
    from confu_jax.decode.drafting import HeadDrafter
    from confu_jax.decode.plans import parse_plan
    from confu_jax.models.presets import get_preset
    from confu_jax.models.spec import HeadConfig, ModelSpec

    cfg = get_preset(name)
    res = {"mesh": dict(mesh.shape), "dtype": cfg.dtype, "params": {}}
    for label, variant in (("target", None), ("target+eagle3", "eagle3"), ("target+confu", "confu")):
        spec = ModelSpec(cfg, HeadConfig(variant=variant or "eagle3", draft_vocab_size=min(head_vocab, cfg.vocab_size)))
        params = sharded.abstract_params(spec, mesh)
        tree = params[0].params if variant is None else params
        r = sharded.bytes_report(tree, jax.tree_util.tree_map(lambda x: x.sharding, tree))
        n_dev = len(r["per_device"])
        row = {k: r[k] for k in ("total", "sharded", "replicated", "max_per_device")}
        row["min_per_device"] = min(r["per_device"].values())
        res["params"][label] = row
        print(f"{name:<14} {label:<14} {r['total'] / 2**30:>9.3f} {r['sharded'] / 2**30:>9.3f} "
              f"{r['replicated'] / 2**20:>11.2f} {r['max_per_device'] / 2**30:>12.3f} "
              f"{(r['sharded'] / n_dev + r['replicated']) / 2**30:>15.3f}", flush=True)
    fb = sharded.explain_fallbacks(sharded.abstract_params(
        ModelSpec(cfg, HeadConfig(variant="confu", draft_vocab_size=min(head_vocab, cfg.vocab_size))), mesh), cfg, mesh)
    res["replicated_fallbacks"] = [f"{r['path']} {r['shape']}" for r in fb]
    for f in res["replicated_fallbacks"]:
        print(f"  {name}: not divisible on this mesh, replicated: {f}")
    if lower:
        spec = ModelSpec(cfg, HeadConfig(variant="confu", draft_vocab_size=min(head_vocab, cfg.vocab_size)))
        traced = tracing.trace_loops(spec, mesh, HeadDrafter(parse_plan(plan_text)))
        for prog, tr in traced.items():
            tr.lower()
            res[f"lowers_{prog}"] = True
            try:
                tr.lower(lowering_platforms=("tpu",))
                res[f"lowers_{prog}_tpu"] = True
            except Exception as e:  # noqa: BLE001 - report why this JAX cannot lower for TPU
                res[f"lowers_{prog}_tpu"] = f"{type(e).__name__}: {e}"[:300]
            tpu = res[f"lowers_{prog}_tpu"]
            print(f"  {name}: {prog} loop lowers on the mesh: yes; for TPU: "
                  f"{'yes' if tpu is True else 'no (' + tpu + ')'}", flush=True)
    return res


def _presets():
    """``(name, config)`` of each ``--models`` preset, in ``--dtype`` (or its own with 'model')."""
    from confu_jax.models.presets import get_preset

    for name in [m.strip() for m in FLAGS.models.split(",") if m.strip()]:
        try:
            cfg = get_preset(name)
        except KeyError as e:
            raise app.UsageError(str(e))
        yield name, cfg if FLAGS.dtype == "model" else cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)


def custom_calls(hlo_text: str) -> list:
    """The distinct custom-call targets of a compiled program's HLO text."""
    import re

    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def topology_report(topology_name: str) -> dict:
    """``--topology``: each model's AR and speculative loops compiled for that hardware (module docstring)."""
    from confu_jax import topology as tp
    from confu_jax.decode import tracing
    from confu_jax.decode.drafting import HeadDrafter
    from confu_jax.decode.plans import parse_plan
    from confu_jax.decode.sharded import parse_mesh
    from confu_jax.models.spec import HeadConfig, ModelSpec

    try:
        topo = tp.get_topology(topology_name)
    except ValueError as e:
        raise app.UsageError(str(e))
    mesh = None
    if FLAGS.mesh:
        try:
            mesh = parse_mesh(FLAGS.mesh, devices=topo.devices)
        except ValueError as e:
            raise app.UsageError(str(e))
    res = dict(topo.summary(), mesh=dict(mesh.shape) if mesh is not None else None, plan=FLAGS.topology_plan,
               max_len=FLAGS.topology_max_len, programs=[])
    print(f"{'model':<14} {'dtype':<9} {'program':<12} {'per-device peak':>16} {'device':>10}  fits  custom calls")
    heads = [h.strip() for h in FLAGS.topology_heads.split(",") if h.strip()]
    if not heads or set(heads) - {"eagle3", "confu"}:
        raise app.UsageError(f"--topology_heads takes eagle3 and/or confu, got {FLAGS.topology_heads!r}")
    for name, cfg in _presets():
        programs = {}
        for head in heads:
            spec = ModelSpec(cfg, HeadConfig(variant=head, draft_vocab_size=min(FLAGS.mesh_head_vocab, cfg.vocab_size)))
            traced = tracing.trace_loops(spec, mesh, HeadDrafter(parse_plan(FLAGS.topology_plan)), unroll_layers=None,
                                         device=None if mesh is not None else topo.devices[0],
                                         max_len=FLAGS.topology_max_len)
            if "ar" not in programs:
                programs["ar"] = traced["ar"]
            programs["speculative" if len(heads) == 1 else f"spec_{head}"] = traced["speculative"]
        for prog, tr in programs.items():
            try:
                compiled = tracing.compile_traced({prog: tr}, topo.platform)[prog]
                row = dict(model=name, dtype=cfg.dtype, program=prog,
                           **tp.memory_report(compiled, topo.device_memory_bytes),
                           custom_calls=custom_calls(compiled.as_text()))
            except Exception as e:  # noqa: BLE001 - XLA:TPU's "does not fit" is a row; anything else is not
                oom = tp.out_of_memory(e, topo.device_memory_bytes)
                if oom is None:
                    hint = tp.untuned_tiling(e)
                    if hint is not None:
                        raise hint from e
                    raise
                row = dict(model=name, dtype=cfg.dtype, program=prog, **oom, custom_calls=[])
            res["programs"].append(row)
            print(f"{name:<14} {cfg.dtype:<9} {prog:<12} {(row['per_device_peak_bytes'] or 0) / 2**30:>12.3f} GiB "
                  f"{(row['device_memory_bytes'] or 0) / 2**30:>6.1f} GiB  {str(row['fits']):<5} "
                  f"{', '.join(row['custom_calls']) or '-'}", flush=True)
    return res


def main(argv):
    del argv
    if FLAGS.topology:
        from confu_jax.topology import cpu_host

        cpu_host()
        results = {"topology": topology_report(FLAGS.topology), "dtype": FLAGS.dtype}
        if FLAGS.out:
            storage.write_text(FLAGS.out, json.dumps(results, indent=2))
        return
    if FLAGS.mesh:
        from confu_jax.decode.sharded import fake_host_devices

        fake_host_devices(FLAGS.mesh)

    results = {"programs": {}, "dtype": FLAGS.dtype}
    worst = None
    print(f"{'model':<14} {'S':>5} {'T':>4} {'GB accessed':>12} {'GB floor':>9} {'bytes/floor':>11} {'GFLOP':>9}")
    for name, cfg in _presets():
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
    if FLAGS.mesh:
        from confu_jax.decode.sharded import parse_mesh

        try:
            mesh = parse_mesh(FLAGS.mesh)
        except ValueError as e:
            raise app.UsageError(str(e))
        print(f"\nper-device parameter bytes on mesh {dict(mesh.shape)} (each preset's dtype; GiB, replicated MiB)")
        print(f"{'model':<14} {'params':<14} {'total':>9} {'sharded':>9} {'replicated':>11} "
              f"{'max/device':>12} {'sharded/n+rep':>15}")
        results["sharded"] = {}
        for name in [m.strip() for m in FLAGS.models.split(",") if m.strip()]:
            results["sharded"][name] = sharded_report(name, mesh, FLAGS.mesh_plan, FLAGS.mesh_head_vocab,
                                                      FLAGS.mesh_lower)
    if FLAGS.measure:
        key = "measured_smollm2" if FLAGS.measure_model == "smollm2-135m-instruct" else "measured"
        results[key] = measure(FLAGS.measure_model, FLAGS.prompt_len, FLAGS.new_tokens, FLAGS.repeats,
                               FLAGS.draft_vocab, FLAGS.measure_split)
    if worst is not None:
        results["max_bytes_over_floor_8b"] = worst
    if FLAGS.out:
        storage.write_text(FLAGS.out, json.dumps(results, indent=2))
    if worst is not None:
        print(f"max bytes/floor: {worst:.2f}")


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.decode_cost", main)
