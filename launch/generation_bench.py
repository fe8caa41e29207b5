"""Self-distillation throughput: continuous batching against batch-1 ``generate_ar``, one run.

    python -m launch.generation_bench [--model smollm2-135m-instruct] [--batch 32] \\
        [--n_prompts 64] [--n_ar 4] [--max_new_tokens 256] [--out runs/generation_bench.json]

Both sides decode first-turn ShareGPT prompts (chat template applied) greedily with the same
weights, on the same machine, one after the other; compilation is done before timing (AR: one
AOT-compiled program per prompt; continuous: a warm-up pass over one prompt of every bucket).
Reported: generated tokens / wall seconds for each side and their ratio. Run it on an otherwise
idle machine: anything sharing the cores makes the figures noise.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf or HF directory")
flags.DEFINE_integer("batch", 32, "continuous batching slots")
flags.DEFINE_integer("n_prompts", 64, "prompts decoded by the continuous engine")
flags.DEFINE_integer("n_ar", 4, "prompts decoded one at a time by generate_ar (the first of the same list)")
flags.DEFINE_integer("max_new_tokens", 256, "tokens per answer at most")
flags.DEFINE_integer("max_prompt_len", 512, "prompts longer than this are skipped")
flags.DEFINE_integer("steps_per_sync", 16, "continuous: decode steps between host checks")
flags.DEFINE_string("out", "", "write the results JSON here too")
FLAGS = flags.FLAGS


def first_turn_prompts(tok, n: int, max_prompt_len: int) -> list:
    from confu_jax.data.formats import load_conversations

    convs, _ = load_conversations(["sharegpt"], max_records=4 * n)
    out = []
    for c in convs:
        first = []
        for m in c["messages"]:
            if m["role"] == "assistant":
                break
            first.append(m)
        ids, _ = tok.encode_chat(first, add_generation_prompt=True)
        if 1 <= len(ids) <= max_prompt_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def main(argv):
    del argv
    import jax
    import numpy as np

    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.decode.continuous import ContinuousGenerator
    from confu_jax.decode.generate import compile_ar
    from confu_jax.decode.requests import one_prompt_per_bucket
    from confu_jax.weights import load_model

    tok = ChatTokenizer.load(FLAGS.model)
    cfg, params = load_model(FLAGS.model)
    prompts = first_turn_prompts(tok, FLAGS.n_prompts, FLAGS.max_prompt_len)
    max_len = FLAGS.max_prompt_len + FLAGS.max_new_tokens
    kw = dict(max_new_tokens=FLAGS.max_new_tokens, eos_ids=tok.eos_ids, max_len=max_len)

    ar_tokens, ar_s = 0, 0.0
    for p in prompts[:FLAGS.n_ar]:
        run, args = compile_ar(params, cfg, [p], **kw)
        t0 = time.perf_counter()
        res = jax.block_until_ready(run(params, *args))
        ar_s += time.perf_counter() - t0
        ar_tokens += int(np.asarray(res.n_generated_b)[0])
    print(f"AR batch 1: {ar_tokens} tokens in {ar_s:.1f} s = {ar_tokens / ar_s:.2f} tokens/s", flush=True)

    gen = ContinuousGenerator(params, cfg, batch=FLAGS.batch, max_len=max_len, max_new_tokens=FLAGS.max_new_tokens,
                              eos_ids=tok.eos_ids, steps_per_sync=FLAGS.steps_per_sync)
    t0 = time.perf_counter()
    warm_gen = ContinuousGenerator(params, cfg, batch=FLAGS.batch, max_len=max_len, max_new_tokens=2,
                                   eos_ids=(), steps_per_sync=FLAGS.steps_per_sync)
    list(warm_gen.run((i, p, 0) for i, p in enumerate(one_prompt_per_bucket(prompts))))
    gen_compile_s = time.perf_counter() - t0  # fill programs per bucket; the step program compiles below
    list(gen.run([(0, prompts[0], 0)]))
    t0 = time.perf_counter()
    n0 = gen.tokens_generated
    finished = list(gen.run((i, p, 0) for i, p in enumerate(prompts)))
    cont_s = time.perf_counter() - t0
    cont_tokens = gen.tokens_generated - n0
    print(f"continuous B={FLAGS.batch}: {cont_tokens} tokens for {len(finished)} prompts in {cont_s:.1f} s = "
          f"{cont_tokens / cont_s:.2f} tokens/s", flush=True)
    result = {
        "model": FLAGS.model, "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
        "max_new_tokens": FLAGS.max_new_tokens, "max_len": max_len,
        "ar": {"prompts": FLAGS.n_ar, "tokens": ar_tokens, "seconds": ar_s, "tokens_per_s": ar_tokens / ar_s},
        "continuous": {"batch": FLAGS.batch, "steps_per_sync": FLAGS.steps_per_sync, "prompts": len(finished),
                       "tokens": cont_tokens, "seconds": cont_s, "tokens_per_s": cont_tokens / cont_s,
                       "warmup_s": gen_compile_s},
        "speedup": (cont_tokens / cont_s) / (ar_tokens / ar_s),
    }
    print(f"throughput ratio (continuous / AR batch 1): {result['speedup']:.2f}x")
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
