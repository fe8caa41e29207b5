"""Decode throughput: our jitted decoding vs Hugging Face ``transformers`` greedy ``generate``.

    python -m launch.decode_bench --method ar

Both sides decode the same chat prompts (one at a time, batch 1, greedy, the same
``--max_new_tokens`` and EOS ids) with the same weights: ours from ``confu_jax.weights.load_model``,
transformers' from the same GGUF via ``gguf_file=`` (torch CPU, float32). Prompts are interleaved
(ours, then theirs, per prompt) so background load hits both alike. Reported:

* ours: tokens/s of the compiled program (prefill + decode), compile time reported separately;
  also one batched call over all prompts (rows of different lengths in one while_loop);
* transformers: tokens/s of ``generate`` after one short warm-up call;
* the ratio, and whether the greedy tokens are identical prompt by prompt (first divergence if not).

Tokens/s = total emitted tokens / total wall time, summed over prompts (the Spec-Bench convention).

Speculative mode (``--methods``): AR, EAGLE-3 and ConFu over Spec-Bench-format prompts
(``confu_jax.bench.spec_bench``), every method × ``--temperatures`` × ``--budgets``:

    python -m launch.decode_bench --methods ar,eagle3,confu --heads eagle3=runs/e3,confu=runs/confu \
        --temperatures 0,0.7,1.0 --budgets chain:4,dynamic:6,8,30,dynamic:6,10,60,auto \
        --prompts mtbench --n_per_category 2 --turns 1 --max_new_tokens 128 --out results/bench.json

writes ``bench.json`` (report.write_results layout: τ, tokens/s, speed-up vs the same run's AR,
per-category τ / SR, losslessness at T=0, environment), ``bench.md`` (the paper's table plus the
per-row settings) and ``bench.png`` (τ per category); ``--out`` may be a ``gs://`` URL (the files and
``<out>.parts/`` are written there whole, docs/scale.md). A method without ``--heads`` runs a random
head, flagged ``trained: false`` in its rows.

``--chat_template_kwargs '{"enable_thinking": false}'`` (a JSON object) reaches the render of every
prompt (Qwen3 without reasoning: decode the way the head's data was generated); a kwarg the template
does not read is refused in one line.

Both modes take ``--attention_impl {xla,pallas}`` (the Pallas tree-attention kernel: a CUDA GPU only,
refused in one line elsewhere) and ``--mesh`` (decode over a device mesh, as ``launch.generate --mesh``).
"""

from __future__ import annotations

import json
import logging
import os

from absl import app, flags

from confu_jax import storage
from confu_jax.bench.cli_args import ATTENTION_CHOICES, ATTENTION_HELP, LAYER_SCHEDULES, LAYERS_HELP
from confu_jax.bench.ar_baseline import CompiledAR, first_divergence, hf_generate, load_hf_reference

# A handful of fixed chat prompts of varied length and kind (a later issue swaps in MT-Bench).
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail, step by step, how a bicycle's gears work and why cyclists shift them when "
    "riding uphill.",
    "What are the main differences between Python lists and tuples? Give examples.",
    "Summarize the causes of the French Revolution for a high-school student.",
]

flags.DEFINE_enum("method", "ar", ["ar"], "our decoding method to time ('ar': jitted autoregressive)")
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "asset name or .gguf file (transformers loads the same file with gguf_file=)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt (both sides)")
flags.DEFINE_integer("n_prompts", len(PROMPTS), f"use the first N of the {len(PROMPTS)} fixed prompts")
flags.DEFINE_integer("min_bucket", 64, "smallest prompt bucket of the jitted loop (see decode/generate.py)")
flags.DEFINE_integer("threads", 0,
                     "CPU cores for both sides (0 = all): pins the process to the first N cores, sets "
                     "torch's intra-op threads to N, and with N=1 turns off XLA's multi-threaded Eigen. "
                     "N=1 is the stable setting on a shared machine: torch's spinning OpenMP threads "
                     "slow down many-fold when another process takes one of their cores")
flags.DEFINE_bool("hf", True, "also time transformers generate (needs torch + transformers + accelerate)")
flags.DEFINE_bool("batched", True, "also time one batched call of ours over all prompts")
flags.DEFINE_bool("ar_again", False, "speculative mode: decode AR again after each temperature's last row (row "
                  "'ar_again', its speed-up against the first AR row: the machine's drift over the run)")
flags.DEFINE_bool("interleave", False, "speculative mode: decode every row question by question in turn (who goes "
                  "first rotating) instead of row after row, so a drift of the machine's speed falls on all rows "
                  "alike; all rows' programs stay compiled together (a few rows)")
flags.DEFINE_enum("layers", "auto", list(LAYER_SCHEDULES), LAYERS_HELP)
flags.DEFINE_enum("attention_impl", "xla", list(ATTENTION_CHOICES), ATTENTION_HELP)
flags.DEFINE_string("mesh", "", "decode over a device mesh, as launch.generate --mesh: e.g. tensor=8 (axes data, fsdp, "
                    "tensor with the training rules, confu_jax/sharding.py; one prompt is one row, so data × fsdp must "
                    "be 1). Empty = one device. On CPU the devices are faked: a layout check, not a speed-up. The "
                    "transformers side of the AR mode stays on one device")
flags.DEFINE_string("json_out", "", "write the figures to this JSON file as well")
flags.DEFINE_string("chat_template_kwargs", "", "JSON object of extra chat-template variables for every prompt, "
                    "e.g. '{\"enable_thinking\": false}' (Qwen3 without reasoning); a kwarg the template does "
                    "not read is refused")
# --- speculative mode (any --methods given)
flags.DEFINE_list("methods", [], "speculative benchmark mode: comma list of ar, eagle3, confu, confu_nomoe, "
                  "confu_nomoe_norep, lookup (model-free), hybrid (lookup + a head), draft_model (an independent "
                  "draft model, --heads draft_model=SOURCE), sd2 (the same, steered) (AR is always run as the "
                  "baseline); empty = the AR-vs-transformers mode above")
flags.DEFINE_list("temperatures", ["0"], "speculative mode: sampling temperatures (0 = greedy, with the "
                  "losslessness check)")
flags.DEFINE_string("budgets", "chain:4,dynamic:6,8,30", "speculative mode: draft plans, chain:K | "
                    "sampled_chain:K | dynamic:DEPTH,TOPK,NODES | lookup:K[,W[,NMIN,NMAX]] | auto (measured "
                    "choice, bench/budget.py); each method runs the plans its family reads")
flags.DEFINE_string("prompts", "mtbench", "speculative mode: mtbench | humaneval | grounded | a Spec-Bench "
                    "question.jsonl "
                    "(several joined with '+'; a named set takes :N for its first N, e.g. mtbench+humaneval:20)")
flags.DEFINE_string("calibration", "", "speculative mode, budget auto: prompt source to calibrate on "
                    "(same syntax as --prompts); its questions that are also measured are left out. Empty: "
                    "the questions of --prompts that this run does not measure")
flags.DEFINE_bool("resume", True, "speculative mode: keep every finished row in <out>.parts/ and, when the "
                  "same command is rerun after a kill, skip the rows found there (other settings are refused)")
flags.DEFINE_integer("n_calibration", 4, "speculative mode, budget auto: calibration prompts")
flags.DEFINE_string("auto_candidates", "", "speculative mode, budget auto: the candidate plans (same syntax as "
                    "--budgets; each method measures those its family reads, plus AR), or per family as "
                    "'head=chain:2,dynamic:4,4,8;lookup=chain:2,lookup:4,2'; empty / a family not named: the "
                    "family's defaults (confu_jax/decode/families.py)")
flags.DEFINE_integer("n_per_category", 2, "speculative mode: questions sampled per category (seeded; 0 = all)")
flags.DEFINE_integer("turns", 1, "speculative mode: conversation turns per question (MT-Bench has 2)")
flags.DEFINE_string("heads", "", "speculative mode: trained heads as METHOD=WORKDIR,... (launch.train "
                    "workdirs, their latest step; WORKDIR@STEP for one step of an EAGLE-3 / ConFu run; or for eagle3 an "
                    "EAGLE-3 head in the official / SGLang / SpecForge or "
                    "speculators format); a method without one uses a random head (flagged in the output). "
                    "draft_model / sd2 take their draft model here: draft_model=self:8 (the target's first 8 layers), "
                    "a GGUF / HF directory with the target's tokenizer, or sd2=<launch.train SD² workdir>")
flags.DEFINE_float("top_p", 1.0, "speculative mode: nucleus mass for T > 0")
flags.DEFINE_integer("seed", 0, "speculative mode: sampling seed, prompt sampling seed and random-head seed")
flags.DEFINE_string("out", "results/decode_bench.json", "speculative mode: results JSON (+ .md table, .png figure)")
FLAGS = flags.FLAGS


def _limit_cores(n: int):
    """Give both sides the same n cores (before JAX's backend starts: XLA_FLAGS is read then)."""
    if n <= 0:
        return
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise app.UsageError(f"--threads={n} but this process may use only {len(cores)} cores")
    os.sched_setaffinity(0, cores[:n])
    if n == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()


def _tokenizer():
    """The target's tokenizer with ``--chat_template_kwargs``: every prompt (measured, calibration,
    later turns) renders with them."""
    from confu_jax.data.chat import ChatTokenizer, parse_template_kwargs

    # a kwarg the template does not read: ValueError, one line and exit 2 (cli_main)
    return ChatTokenizer.load(FLAGS.model, template_kwargs=parse_template_kwargs(FLAGS.chat_template_kwargs))


def main_speculative(attention_impl: str, mesh):
    from tqdm import tqdm

    from confu_jax.bench import budget, cli_args, report, spec_bench
    from confu_jax.bench.prompts import first_turn_ids, load_prompts, sample_prompts
    from confu_jax.weights import load_model

    try:
        budgets = cli_args.parse_budgets(FLAGS.budgets)
        heads = cli_args.parse_heads(FLAGS.heads)
        temperatures = [float(t) for t in FLAGS.temperatures]
    except ValueError as e:
        raise app.UsageError(str(e))
    methods = list(dict.fromkeys(["ar"] + FLAGS.methods))
    from confu_jax.decode.families import METHODS as REGISTERED

    bad = [m for m in methods if m not in REGISTERED]
    if bad:
        raise app.UsageError(f"--methods: unknown {bad}; expected one of {', '.join(REGISTERED)}")
    stray = sorted(set(heads) - set(methods))
    if stray:
        raise app.UsageError(f"--heads names {stray}, which are not in --methods {methods}")
    prompts = sample_prompts(load_prompts(FLAGS.prompts), FLAGS.n_per_category, seed=FLAGS.seed)
    tok = _tokenizer()
    cfg, params = load_model(FLAGS.model)
    print(f"model {FLAGS.model}: {len(prompts)} questions from {FLAGS.prompts}, {FLAGS.turns} turn(s), "
          f"max_new_tokens={FLAGS.max_new_tokens}, methods {methods}, T {temperatures}, budgets {budgets}",
          flush=True)
    calibration = None
    # picked whenever --calibration names a source, auto or not: the prompts are part of the resume
    # settings, so runs of one benchmark split over several invocations share their parts
    if "auto" in budgets or FLAGS.calibration:
        measured = {(p.category, p.question_id) for p in prompts}
        pool = [p for p in load_prompts(FLAGS.calibration or FLAGS.prompts)
                if (p.category, p.question_id) not in measured]
        if pool:
            pool_ids = [first_turn_ids(tok, p) for p in pool]  # of the measured prompts' commonest width
            keep = budget.pick_calibration(pool_ids, [first_turn_ids(tok, p) for p in prompts],
                                           FLAGS.n_calibration, min_bucket=FLAGS.min_bucket)
            picked = [pool[i] for i in keep]
            calibration = tuple(pool_ids[i] for i in keep)
            print(f"budget auto calibrates on {len(calibration)} held-out questions "
                  f"({', '.join(str(p.question_id) for p in picked)})", flush=True)
    auto_candidates = cli_args.parse_auto_candidates(FLAGS.auto_candidates) if FLAGS.auto_candidates else None
    cfg = cfg.replace(attention_impl=attention_impl)
    setup = spec_bench.BenchSetup(cfg, params, tok, max_new_tokens=FLAGS.max_new_tokens, turns=FLAGS.turns,
                                  top_p=FLAGS.top_p, seed=FLAGS.seed, min_bucket=FLAGS.min_bucket,
                                  calibration=calibration, auto_candidates=auto_candidates, ar_again=FLAGS.ar_again,
                                  interleave=FLAGS.interleave, unroll_layers=LAYER_SCHEDULES[FLAGS.layers],
                                  mesh=mesh)
    parts = None
    if FLAGS.resume:
        settings = {"model": FLAGS.model, "questions": [[p.category, p.question_id] for p in prompts],
                    "max_new_tokens": FLAGS.max_new_tokens, "turns": FLAGS.turns, "top_p": FLAGS.top_p,
                    "seed": FLAGS.seed, "min_bucket": FLAGS.min_bucket, "heads": heads,
                    "calibration": [list(c) for c in calibration or ()]}
        if FLAGS.layers != "auto":  # only when given, as auto_candidates
            settings["layers"] = FLAGS.layers
        if attention_impl != "xla":  # only when given: earlier benchmarks' parts stay resumable
            settings["attention_impl"] = attention_impl
        if FLAGS.mesh:
            settings["mesh"] = FLAGS.mesh
        if tok.template_kwargs:  # only when given: a benchmark's parts share their prompts' rendering
            settings["chat_template_kwargs"] = tok.template_kwargs
        if auto_candidates:  # only when given: parts of benchmarks without it stay resumable
            settings["auto_candidates"] = {str(k): list(v) for k, v in auto_candidates.items()}
        try:
            parts = spec_bench.Parts(os.path.splitext(FLAGS.out)[0] + ".parts", settings)
        except ValueError as e:
            raise app.UsageError(str(e))
    rows = spec_bench.run_benchmark(setup, prompts, methods=methods, temperatures=temperatures, budgets=budgets,
                                    heads=heads, log=lambda m: print(m, flush=True),
                                    progress_factory=lambda **kw: tqdm(leave=False, dynamic_ncols=True, **kw),
                                    parts=parts)
    report.write_outputs(FLAGS.out, rows)
    print(storage.read_text(os.path.splitext(FLAGS.out)[0] + ".md"))
    print(f"wrote {FLAGS.out} (+ .md, .png)")
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from confu_jax.runs.quiet_logs import quiet_orbax_logs

    quiet_orbax_logs()  # no save-phase chatter or read-only warnings from orbax
    _limit_cores(FLAGS.threads)
    from confu_jax.bench.cli_args import decode_attention_impl
    from confu_jax.decode.sharded import fake_host_devices, parse_mesh

    fake_host_devices(FLAGS.mesh)  # before JAX starts its backends (decode_attention_impl asks for one)
    attention_impl = decode_attention_impl(FLAGS.attention_impl)  # refused here, before any model loads
    mesh = parse_mesh(FLAGS.mesh) if FLAGS.mesh else None
    if FLAGS.methods:
        return main_speculative(attention_impl, mesh)
    from confu_jax.assets import resolve_model_path
    from confu_jax.weights import load_model

    model_path = resolve_model_path(FLAGS.model)
    if FLAGS.hf and not model_path.endswith(".gguf"):
        raise app.UsageError(f"--model must be a GGUF (asset or file) for the transformers side; got "
                             f"{model_path!r} (or pass --nohf)")
    tok = _tokenizer()
    cfg, params = load_model(FLAGS.model)
    cfg = cfg.replace(attention_impl=attention_impl)
    texts = PROMPTS[: FLAGS.n_prompts]
    prompts = [tok.encode(tok.render([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in texts]
    eos_ids = tuple(tok.eos_ids)
    load_before = os.getloadavg()[0]
    print(f"model {FLAGS.model}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, "
          f"max_new_tokens={FLAGS.max_new_tokens}, greedy, eos={list(eos_ids)}", flush=True)

    ours_ar = CompiledAR(params, cfg, eos_ids, max_new_tokens=FLAGS.max_new_tokens, min_bucket=FLAGS.min_bucket,
                         unroll_layers=LAYER_SCHEDULES[FLAGS.layers], mesh=mesh)
    for p in prompts:
        ours_ar.program([p])  # compile every bucket up front
    ours_ar.run([prompts[0]])  # warm-up execution (first-run allocations), untimed
    compile_s = ours_ar.compile_s
    hf = None
    if FLAGS.hf:
        hf = load_hf_reference(model_path)
        hf_generate(hf, prompts[0], eos_ids, tok.pad_id, 8)  # warm-up, untimed

    rows = []
    for i, p in enumerate(prompts):
        (ours,), ours_s, ours_cpu = ours_ar.run([p])
        row = {"prompt": i, "prompt_tokens": len(p), "ours_tokens": len(ours), "ours_s": ours_s,
               "ours_cpu_s": ours_cpu}
        if hf is not None:
            theirs, hf_s, hf_cpu = hf_generate(hf, p, eos_ids, tok.pad_id, FLAGS.max_new_tokens)
            row.update(hf_tokens=len(theirs), hf_s=hf_s, hf_cpu_s=hf_cpu, identical=ours == theirs,
                       first_divergence=first_divergence(ours, theirs))
        rows.append(row)
        print(json.dumps(row), flush=True)

    n_ours = sum(r["ours_tokens"] for r in rows)
    s_ours = sum(r["ours_s"] for r in rows)
    summary = {"method": FLAGS.method, "model": FLAGS.model, "max_new_tokens": FLAGS.max_new_tokens,
               "n_prompts": len(rows), "ours_tokens_per_s": n_ours / s_ours, "ours_compile_s": compile_s,
               # process CPU time per token: less sensitive than wall time to other processes
               "ours_cpu_ms_per_token": 1e3 * sum(r["ours_cpu_s"] for r in rows) / n_ours,
               "attention_impl": attention_impl, "mesh": FLAGS.mesh or None,
               "cpu_count": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
               # other processes on the machine skew both sides (torch's threads suffer most)
               "loadavg_1min_before_after": [load_before, os.getloadavg()[0]]}
    if FLAGS.batched:
        outs, s_b, c_b = ours_ar.run(prompts)  # its compile is not part of s_b
        summary["ours_batched_tokens_per_s"] = sum(map(len, outs)) / s_b
        summary["ours_batched_cpu_ms_per_token"] = 1e3 * c_b / sum(map(len, outs))
        summary["ours_batch_size"] = len(prompts)
    if hf is not None:
        n_hf = sum(r["hf_tokens"] for r in rows)
        s_hf = sum(r["hf_s"] for r in rows)
        summary.update(hf_tokens_per_s=n_hf / s_hf,
                       hf_cpu_ms_per_token=1e3 * sum(r["hf_cpu_s"] for r in rows) / n_hf,
                       speedup_vs_hf=(n_ours / s_ours) / (n_hf / s_hf),
                       greedy_identical_prompts=f"{sum(r['identical'] for r in rows)}/{len(rows)}")

    print()
    print(f"ours ({FLAGS.method}, jitted, batch 1): {summary['ours_tokens_per_s']:.1f} tokens/s "
          f"({n_ours} tokens in {s_ours:.2f} s, {summary['ours_cpu_ms_per_token']:.0f} CPU-ms/token); "
          f"compile {compile_s:.1f} s (excluded)")
    if FLAGS.batched:
        print(f"ours ({FLAGS.method}, jitted, batch {len(prompts)}): "
              f"{summary['ours_batched_tokens_per_s']:.1f} tokens/s "
              f"({summary['ours_batched_cpu_ms_per_token']:.0f} CPU-ms/token)")
    if hf is not None:
        print(f"transformers generate (torch CPU fp32, greedy, batch 1): "
              f"{summary['hf_tokens_per_s']:.1f} tokens/s ({n_hf} tokens in {s_hf:.2f} s, "
              f"{summary['hf_cpu_ms_per_token']:.0f} CPU-ms/token)")
        print(f"ratio ours / transformers: {summary['speedup_vs_hf']:.2f}x")
        print(f"greedy tokens identical: {summary['greedy_identical_prompts']} prompts")
    print(f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs used; 1-min load average before/after: "
          f"{summary['loadavg_1min_before_after'][0]:.1f}/{summary['loadavg_1min_before_after'][1]:.1f}")
    if FLAGS.json_out:
        storage.write_text(FLAGS.json_out, json.dumps({"summary": summary, "per_prompt": rows}, indent=2))
    return 0


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.decode_bench", main)
