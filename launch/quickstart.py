"""The main job on a fresh machine: SmolLM2 + EAGLE-3 and ConFu heads + speculative decoding.

    python -m launch.quickstart                       # < 20 min on 2 CPU cores (training dominates)
    python -m launch.quickstart --train_steps 20 --n_prompts 2 --max_new_tokens 32   # a few minutes

1. Heads: ``$CONFU_JAX_CACHE/heads/smollm2_{eagle3,confu}`` (default ``~/.cache/confu_jax``) if it
   holds a finished ``launch.train`` run; otherwise that directory is trained now with
   ``launch.train``'s machinery (``configs/smollm2_{eagle3,confu}.py``) on a slice of ShareGPT,
   shrunk to fit a CPU (``--train_steps``, ``--train_records``, short rows, small batches). Equal
   budgets, as in the paper: EAGLE-3 trains ``--train_steps`` steps; ConFu starts from EAGLE-3's
   checkpoint at half of them and trains the other half. An interrupted training resumes from its
   last checkpoint on the next run. Heads this short are far from converged: τ reflects minutes of
   CPU training, not the paper's setting. Timings: see docs/RESULTS.md ("The main job").
2. Decoding: AR, EAGLE-3 and ConFu on ``--n_prompts`` MT-Bench questions (one per category first),
   greedy, ``--tree`` draft plan; prints the τ / SR table (``confu_jax.bench``) and whether every
   speculative output equals AR's token for token (the lossless check). Results also go to
   ``--out`` (JSON + .md + .png).
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from absl import logging as absl_logging

flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name or .gguf (must match the configs' preset)")
flags.DEFINE_integer("train_steps", 60, "training budget per head (optimizer steps) when heads must be trained: "
                     "EAGLE-3 trains this many; ConFu starts from EAGLE-3 at half of them and trains the rest")
flags.DEFINE_integer("train_records", 600, "ShareGPT conversations read for training (draft vocab + rows)")
flags.DEFINE_integer("train_batch", 4, "rows per training step")
flags.DEFINE_integer("train_max_length", 128, "tokens per training row (chat template applied, truncated)")
flags.DEFINE_integer("n_prompts", 8, "MT-Bench questions decoded (at most one per category, then more)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per question")
flags.DEFINE_string("tree", "chain:3", "draft plan for EAGLE-3 and ConFu (chain:K | dynamic:DEPTH,TOPK,NODES)")
flags.DEFINE_string("cache", "", "head cache root (default $CONFU_JAX_CACHE or ~/.cache/confu_jax)")
flags.DEFINE_string("out", "results/quickstart.json", "results JSON (+ .md table, .png figure)")
FLAGS = flags.FLAGS

VARIANTS = ("eagle3", "confu")


def cache_root() -> str:
    root = FLAGS.cache or os.environ.get("CONFU_JAX_CACHE") or os.path.join("~", ".cache", "confu_jax")
    return os.path.abspath(os.path.expanduser(root))


def head_ready(workdir: str) -> bool:
    """A finished run: config.json and a checkpoint at the ``train.steps`` that config asked for.

    An interrupted run (checkpoints short of its own budget) is not ready: training it again
    resumes from its last checkpoint.
    """
    import json

    ck = os.path.join(workdir, "checkpoints")
    config_path = os.path.join(workdir, "config.json")
    if not (os.path.isfile(config_path) and os.path.isdir(ck)):
        return False
    with open(config_path) as f:
        steps = int(json.load(f)["train"]["steps"])
    done = checkpoint_steps(ck)
    return bool(done) and max(done) >= steps


def checkpoint_steps(directory: str) -> list[int]:
    """The steps saved in a ``launch.train`` checkpoint directory (read-only; nothing is cleaned up)."""
    from confu_jax.runs.checkpoint import Checkpointer

    c = Checkpointer(directory, read_only=True)
    try:
        return c.all_steps()
    finally:
        c.close()


def half_budget() -> int:
    return max(1, FLAGS.train_steps // 2)


def eagle3_start_step() -> int:
    """ConFu's starting point: EAGLE-3 at half the budget, or its latest step if a cached run lacks it."""
    steps = checkpoint_steps(os.path.join(head_dir("eagle3"), "checkpoints"))
    if half_budget() in steps:
        return half_budget()
    print(f"[confu] the cached EAGLE-3 run has no step {half_budget()} (has {sorted(steps)}): starting from "
          f"its step {max(steps)} instead", flush=True)
    return max(steps)


def head_dir(variant: str) -> str:
    return os.path.join(cache_root(), "heads", f"smollm2_{variant}")


def head_config(variant: str):
    """configs/smollm2_<variant>.py shrunk for a CPU run of a few minutes."""
    import importlib

    config = importlib.import_module(f"configs.smollm2_{variant}").get_config()
    config.train.steps = FLAGS.train_steps
    config.train.optim.lr = 1e-3  # short run: EAGLE's 1e-4 barely moves in a few dozen steps
    config.train.optim.warmup_steps = max(1, FLAGS.train_steps // 20)
    if variant == "eagle3":
        # a checkpoint at half the budget is ConFu's starting point (kept beside the final one)
        config.train.checkpoint.every = half_budget()
        config.train.checkpoint.keep = 2
    else:
        config.train.steps = FLAGS.train_steps - half_budget()
        config.train.checkpoint.every = max(1, config.train.steps // 2)  # resumable if interrupted
        config.train.checkpoint.keep = 1
        config.train.checkpoint.init_from = os.path.join(head_dir("eagle3"), "checkpoints")
        config.train.checkpoint.init_from_step = eagle3_start_step()
    config.train.eval_every = 0
    config.train.log_every = max(1, FLAGS.train_steps // 20)
    config.data.max_records = FLAGS.train_records
    config.data.global_batch_size = FLAGS.train_batch
    config.data.max_length = FLAGS.train_max_length
    config.data.num_threads = 1
    # TTT over 3 draft steps (the decode chain's depth) instead of 7: the step costs ~linear in it
    config.draft.ttt_steps = 3
    config.confu.max_lag = 4  # contemplate lag = depth + 1 (configs/common.py)
    # sparse anchors, so that the replication window (l = 3) is what trains indices between them
    config.objective.k_train = max(1, (FLAGS.train_max_length - 2) // (2 * (config.confu.replication + 1)))
    config.objective.eval_records = 0
    config.objective.eval_batches = 0
    return config


def ensure_head(variant: str) -> str:
    workdir = head_dir(variant)
    if head_ready(workdir):
        print(f"[{variant}] using the cached head in {workdir}", flush=True)
        return workdir
    from confu_jax.train.loop import disallowed_changes, train

    config = head_config(variant)
    # an interrupted run resumes only if it trains the same thing
    changed = disallowed_changes(workdir, config) if os.path.isdir(os.path.join(workdir, "checkpoints")) else {}
    if changed:
        import time

        stale = f"{workdir}.stale-{int(time.time())}"
        os.rename(workdir, stale)
        print(f"[{variant}] the unfinished cached run was made with other settings ({sorted(changed)}); moved it "
              f"to {stale} and training afresh", flush=True)
    start = (f"from EAGLE-3 step {config.train.checkpoint.init_from_step}, " if variant != "eagle3" else "")
    print(f"[{variant}] no cached head: training {start}{config.train.steps} steps on {FLAGS.train_records} "
          f"ShareGPT conversations into {workdir}", flush=True)
    res = train(config, workdir)
    m = res.last_metrics
    print(f"[{variant}] trained to step {res.step}: loss {m.get('loss', float('nan')):.3f}, "
          f"top-1 acc step0 {m.get('acc/step0', float('nan')):.3f}", flush=True)
    return workdir


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    from confu_jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # a second run loads the compiled programs (CONFU_JAX_COMPILE_CACHE)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    from confu_jax.runs.quiet_logs import quiet_orbax_logs

    quiet_orbax_logs()  # no save-phase chatter or read-only warnings from orbax
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint operation at INFO
    from tqdm import tqdm

    from confu_jax.bench import report, spec_bench
    from confu_jax.bench.prompts import load_mtbench
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model

    heads = {v: ensure_head(v) for v in VARIANTS}
    tok = ChatTokenizer.load(FLAGS.model)
    cfg, params = load_model(FLAGS.model)
    questions = load_mtbench()
    firsts, seen = [], set()  # the first question of each category, then the rest in file order
    for q in questions:
        if q.category not in seen:
            seen.add(q.category)
            firsts.append(q)
    rest = [q for q in questions if q not in firsts]
    prompts = (firsts + rest)[: FLAGS.n_prompts]
    setup = spec_bench.BenchSetup(cfg, params, tok, max_new_tokens=FLAGS.max_new_tokens, turns=1)
    rows = spec_bench.run_benchmark(setup, prompts, methods=["ar", *VARIANTS], temperatures=[0.0],
                                    budgets=[FLAGS.tree], heads=heads, log=lambda m: print(m, flush=True),
                                    progress_factory=lambda **kw: tqdm(dynamic_ncols=True, **kw))
    report.write_outputs(FLAGS.out, rows)
    print()
    print(open(os.path.splitext(FLAGS.out)[0] + ".md").read())
    ok = all(r["lossless_greedy"] for r in rows if r["method"] != "ar")
    ties = sum(r.get("n_numerical_ties") or 0 for r in rows if r["method"] != "ar")
    print(f"lossless check (greedy speculative == AR, token for token, {len(prompts)} questions): "
          f"{'PASS' if ok else 'FAIL'}" + (f" ({ties} divergences at numerical ties of the target, "
                                            "see the results' first_mismatch)" if ties else ""))
    print(f"results: {FLAGS.out} (+ .md, .png)")
    return 0 if ok else 1


if __name__ == "__main__":
    app.run(main)
