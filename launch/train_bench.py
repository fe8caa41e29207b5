"""Training throughput of the EAGLE-3 and ConFu objectives on SmolLM2-135M, in one process.

    python -m launch.train_bench --max_length 512 --batch 2 --steps 3

Both variants run the same jitted training step the loop runs (``train_step_fn``: value_and_grad
of ``confu_loss`` + clipped AdamW) on the same real ShareGPT batches (the grain pipeline, chat
template, assistant masks) against the same frozen target, after compilation. Prints per variant:
compile time, seconds per step, tokens/s (B·N sequence tokens per second) and the compiled step's
own memory (arguments + outputs + temporaries, from XLA's memory analysis); then the ConFu/EAGLE-3
step-time ratio (the cost of the contemplate pass and the future entry) and the process's peak
resident memory (``resource.getrusage``). ``--out`` writes the same as JSON.

ConFu evaluates the draft head only inside anchor windows (<= K·(l+1) indices per row), so with
few anchors it trains fewer positions per step than EAGLE-3 and can be cheaper per step. The
default ``confu:128`` run (128·4 >= 512: every index in a window, head on all N) isolates the
cost of the contemplate pass and the future entry.
"""

from __future__ import annotations

import itertools
import json
import resource
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf file or HF directory")
flags.DEFINE_list("variants", ["eagle3", "confu", "confu:128"],
                  "variants to time (configs.common.base_config); 'confu:K' sets K_train for that run")
flags.DEFINE_integer("max_length", 512, "tokens per row (N)")
flags.DEFINE_integer("batch", 2, "rows per step (B)")
flags.DEFINE_integer("steps", 3, "timed steps per variant (after one warm-up step), interleaved")
flags.DEFINE_integer("records", 300, "ShareGPT conversations read (batches and draft-vocab counts)")
flags.DEFINE_integer("k_train", 64, "ConFu anchors per row (unless the variant says 'confu:K')")
flags.DEFINE_integer("ttt_steps", 7, "L_ttt")
flags.DEFINE_integer("vocab_chunk", 8192, "full-vocabulary argmax chunk")
flags.DEFINE_string("out", "", "write the results as JSON here")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from configs.common import base_config
    from confu_jax.data import formats, pipeline
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.draft_vocab import draft_vocab_from_conversations
    from confu_jax.models.params import init_trainable
    from confu_jax.models.spec import ModelSpec, model_spec_from_config
    from confu_jax.train.loss import confu_loss, objective_from_config
    from confu_jax.train.optim import make_optimizer
    from confu_jax.train.state import create_train_state
    from confu_jax.train.step import train_step_fn
    from confu_jax.weights import load_model

    t0 = time.time()
    cfg, target = load_model(FLAGS.model)
    target = jax.device_put(target)
    tokenizer = ChatTokenizer.load(FLAGS.model)
    convs, _ = formats.load_conversations(["sharegpt"], max_records=FLAGS.records)
    n, b = FLAGS.max_length, FLAGS.batch
    ds = pipeline.make_dataset(convs, tokenizer, max_length=n, per_host_batch_size=b, shuffle=False,
                               num_epochs=1, min_loss_tokens=n // 4, num_threads=1)
    batches = [{k: jnp.asarray(x[k]) for k in ("tokens", "loss_mask", "attention_mask")}
               for x in itertools.islice(iter(ds), FLAGS.steps + 1)]
    if len(batches) < FLAGS.steps + 1:
        raise SystemExit(f"only {len(batches)} batches of {b} rows with >= {n // 4} answer tokens in "
                         f"{FLAGS.records} records; raise --records")
    answer_frac = float(np.mean([np.asarray(x["loss_mask"]).mean() for x in batches]))
    print(f"setup {time.time() - t0:.1f}s: target {cfg.n_layers} layers d={cfg.d_model} V={cfg.vocab_size}; "
          f"{len(batches)} batches [{b}, {n}], {100 * answer_frac:.0f}% answer tokens", flush=True)

    runs, results = {}, {}
    for variant in FLAGS.variants:
        name, _, k = variant.partition(":")
        config = base_config("smollm2-135m", name)
        config.draft.ttt_steps = FLAGS.ttt_steps
        config.objective.k_train = int(k) if k else FLAGS.k_train
        config.objective.vocab_chunk = FLAGS.vocab_chunk
        head = model_spec_from_config(config).head
        spec = ModelSpec(cfg, head)
        vocab = draft_vocab_from_conversations(convs, tokenizer, target_vocab_size=cfg.vocab_size,
                                               draft_vocab_size=head.draft_vocab_size, max_length=n)
        dv = {"d2t": jnp.asarray(vocab.d2t), "t2d": jnp.asarray(vocab.t2d)}
        obj = objective_from_config(config)

        def loss_fn(trainable, frozen, batch, rng, spec=spec, dv=dv, obj=obj):
            return confu_loss(spec, trainable, frozen, dv, batch, rng, obj)

        tx, schedule = make_optimizer(config.train.optim, 1000)
        state = jax.jit(lambda: create_train_state(init_trainable(spec, jax.random.PRNGKey(0)), tx,
                                                   jax.random.PRNGKey(1)))()
        step = jax.jit(train_step_fn(loss_fn, tx, schedule), donate_argnums=(0,))
        t1 = time.time()
        compiled = step.lower(state, target, batches[0]).compile()
        compile_s = time.time() - t1
        mem = compiled.memory_analysis()
        step_mib = None
        if mem is not None:
            step_mib = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                        - mem.alias_size_in_bytes) / 2 ** 20
        state, m = compiled(state, target, batches[0])  # warm-up
        jax.block_until_ready(m)
        runs[variant] = [compiled, state, []]
        results[variant] = {"compile_s": compile_s, "step_memory_mib": step_mib,
                            "k_train": int(config.objective.k_train) if name != "eagle3" else None}
        print(f"{variant:>12}: compiled in {compile_s:.1f}s, step memory {step_mib or float('nan'):.0f} MiB",
              flush=True)

    # Interleaved rounds: on a shared machine, load drifts hit every variant alike.
    for i in range(FLAGS.steps):
        for variant, run in runs.items():
            t = time.time()
            run[1], m = run[0](run[1], target, batches[1 + i])
            jax.block_until_ready(m)
            run[2].append(time.time() - t)
            results[variant]["loss_last"] = float(m["loss"])
            results[variant].setdefault("trained_positions", []).append(float(m["positions/step0"]))
    for variant, run in runs.items():
        sec = float(np.median(run[2]))
        pos = float(np.mean(results[variant]["trained_positions"]))
        results[variant].update(step_s=sec, step_s_all=run[2], tokens_per_s=b * n / sec,
                                trained_positions_per_s=pos / sec)
        print(f"{variant:>12}: step {sec:6.2f}s (median of {FLAGS.steps}) | {b * n / sec:7.1f} tokens/s | "
              f"{pos:5.0f} trained positions/step (TTT step 0) | loss {results[variant]['loss_last']:.3f}",
              flush=True)

    summary = {"config": {"model": FLAGS.model, "batch": b, "max_length": n, "k_train": FLAGS.k_train,
                          "ttt_steps": FLAGS.ttt_steps, "vocab_chunk": FLAGS.vocab_chunk,
                          "devices": [str(d) for d in jax.devices()]},
               "variants": results, "peak_rss_mib": _rss_mib()}
    if "eagle3" in results:
        for v in results:
            if v == "eagle3":
                continue
            paired = [c / e for c, e in zip(runs[v][2], runs["eagle3"][2])]
            ratio = results[v]["step_s"] / results["eagle3"]["step_s"]
            results[v]["step_time_over_eagle3"] = ratio
            results[v]["step_time_over_eagle3_paired_median"] = float(np.median(paired))
            print(f"{v} / eagle3 step time: {ratio:.3f}x (medians), {float(np.median(paired)):.3f}x "
                  f"(median of per-round ratios)")
    print(f"peak RSS: {summary['peak_rss_mib']:.0f} MiB")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
