"""The target's layer schedule on this host, side by side: one scan over stacked layers against
per-layer weight buffers (``unroll_layers``), for the AR loop and a speculative loop (the released
EAGLE-3 head, chain:3), SmolLM2, batch 1, greedy, EOS off.

    python -m experiments.layer_schedule [--rounds 10] [--max_new_tokens 96] [--prompt_len 50]

Prints each program's compile time and its run time over ``--rounds`` interleaved rounds (every
program once per round, so a drift of the machine's speed falls on all alike): what
``--layers`` (launch.quickstart, launch.decode_bench) should be on this host. Outputs are equal
under both schedules (tests/unit/test_unrolled.py); only the cost differs, and it differs by host.
"""

from __future__ import annotations

import time

from absl import app, flags

flags.DEFINE_integer("rounds", 10, "interleaved timed rounds")
flags.DEFINE_integer("max_new_tokens", 96, "tokens per decode")
flags.DEFINE_integer("prompt_len", 50, "prompt tokens (random ids, fixed seed)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "target")
flags.DEFINE_string("head", "releases/heads/smollm2_eagle3", "EAGLE-3 head for the speculative program")
flags.DEFINE_string("plan", "chain:3", "the speculative program's plan")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import numpy as np

    from confu_jax.decode import generate, loop
    from confu_jax.decode.families import decode_head, parse_drafter
    from confu_jax.weights import load_model

    cfg, params = load_model(FLAGS.model)
    head = decode_head("eagle3", cfg, params, FLAGS.head)
    prompt = [[int(x) for x in np.random.default_rng(0).integers(100, cfg.vocab_size - 100, FLAGS.prompt_len)]]
    kw = dict(max_new_tokens=FLAGS.max_new_tokens, eos_ids=())
    programs, compile_s = {}, {}
    for unroll in (False, True):
        schedule = "unroll" if unroll else "scan"
        t0 = time.perf_counter()
        programs[f"ar/{schedule}"] = (*generate.compile_ar(params, cfg, prompt, unroll_layers=unroll, **kw), (params,))
        compile_s[f"ar/{schedule}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        programs[f"{FLAGS.plan}/{schedule}"] = (*loop.compile_speculative(
            head.target, parse_drafter("eagle3", FLAGS.plan), head.drafter_params, prompt, unroll_layers=unroll, **kw),
            (head.target, head.drafter_params))
        compile_s[f"{FLAGS.plan}/{schedule}"] = time.perf_counter() - t0
    outputs = {}
    for name, (fn, args, p) in programs.items():  # first runs, untimed
        res = jax.block_until_ready(fn(*p, *args))
        outputs[name] = np.asarray(res.tokens_bn)[0, :int(np.asarray(res.n_generated_b)[0])].tolist()
    assert len({tuple(v) for v in outputs.values()}) == 1, "the schedules' outputs differ"
    times = {name: [] for name in programs}
    for _ in range(FLAGS.rounds):
        for name, (fn, args, p) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*p, *args))
            times[name].append(time.perf_counter() - t0)
    print(f"{'program':<22} {'compile s':>10} {'run s (median)':>15} {'min':>7} {'max':>7}")
    for name in programs:
        t = times[name]
        print(f"{name:<22} {compile_s[name]:>10.1f} {np.median(t):>15.3f} {min(t):>7.3f} {max(t):>7.3f}")
    for prog in ("ar", FLAGS.plan):
        s, u = np.median(times[f"{prog}/scan"]), np.median(times[f"{prog}/unroll"])
        print(f"{prog}: unroll / scan run time {u / s:.2f}, compile {compile_s[f'{prog}/unroll'] / compile_s[f'{prog}/scan']:.1f}x")


if __name__ == "__main__":
    app.run(main)
