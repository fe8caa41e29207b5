"""Training throughput of the EAGLE-3 and ConFu objectives on SmolLM2-135M, in one process.

    python -m launch.train_bench --max_length 512 --batch 2 --steps 3

Both variants run the same jitted training step the loop runs (``train_step_fn``: value_and_grad
of ``confu_loss`` + clipped AdamW) on the same real batches (ShareGPT, or ``--data``) (the grain pipeline, chat
template, assistant masks) against the same frozen target, after compilation. Prints per variant:
compile time, seconds per step, tokens/s (B·N sequence tokens per second) and the compiled step's
own memory (arguments + outputs + temporaries, from XLA's memory analysis); then the ConFu/EAGLE-3
step-time ratio (the cost of the contemplate pass and the future entry) and the process's peak
resident memory (``resource.getrusage``). ``--out`` writes the same as JSON.

``--layouts=padded,packed`` runs every variant on both row layouts side by side: ``padded`` (one
conversation per row, today's default) and ``packed`` (``data.pack``: several conversations per row,
attention block-diagonal, docs/DESIGN.md §4), both drawn in order from the same conversations with the
same filter. Packed rows hold more real tokens per step, so compare ``real_tokens_per_s`` (non-padding
tokens per second) and ``trained_positions_per_s``, not ``tokens_per_s`` (B·N, layout-blind).
``--offline_features DIR`` adds ``eagle3+offline``: EAGLE-3 reading the target's taps and teacher from
``launch.target_features`` shards instead of running the target (padded rows: the store's first
B·(steps+1) rows, written with the same --max_length and draft vocabulary size), and with
``packed`` among the layouts ``eagle3+offline@packed``: the store's rows in order, packed.

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

from absl import flags

from confu_jax import storage

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf file or HF directory")
flags.DEFINE_list("variants", ["eagle3", "confu", "confu:128"],
                  "variants to time (configs.common.base_config); 'confu:K' sets K_train for that run")
flags.DEFINE_integer("max_length", 512, "tokens per row (N)")
flags.DEFINE_integer("batch", 2, "rows per step (B)")
flags.DEFINE_integer("steps", 3, "timed steps per variant (after one warm-up step), interleaved")
flags.DEFINE_list("data", ["sharegpt"], "conversation files or asset names (as data.train_files), e.g. the "
                  "self-distilled JSONL of launch.generate_data")
flags.DEFINE_integer("records", 300, "conversations read (batches and draft-vocab counts)")
flags.DEFINE_integer("k_train", 64, "ConFu anchors per row (unless the variant says 'confu:K')")
flags.DEFINE_integer("ttt_steps", 7, "L_ttt")
flags.DEFINE_integer("vocab_chunk", 8192, "full-vocabulary argmax chunk")
flags.DEFINE_integer("draft_vocab_size", 0, "draft vocabulary (0: the config's, 16384; the CPU recipe uses 4096)")
flags.DEFINE_list("layouts", ["padded"], "row layouts to time side by side: 'padded' (one conversation per "
                  "row) and/or 'packed' (several per row, data.pack)")
flags.DEFINE_integer("min_loss_tokens", -1, "keep conversations with at least this many answer tokens after "
                     "truncation (-1: max_length // 4)")
flags.DEFINE_integer("pack_bins", 0, "first-fit packing bins in flight (0: the batch size)")
flags.DEFINE_string("offline_features", "", "a launch.target_features directory written for --model with the "
                    "same --max_length and --draft_vocab_size: adds the variant 'eagle3+offline' (no target "
                    "forward), timed on the store's first rows")
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
    from confu_jax.models.registry import get_variant
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
    convs, _ = formats.load_conversations(FLAGS.data, max_records=FLAGS.records)
    n, b = FLAGS.max_length, FLAGS.batch
    min_loss = FLAGS.min_loss_tokens if FLAGS.min_loss_tokens >= 0 else n // 4
    keys = {"padded": ("tokens", "loss_mask", "attention_mask"), "packed": pipeline.PACKED_KEYS}
    batches = {}
    for layout in FLAGS.layouts:
        if layout not in keys:
            raise SystemExit(f"--layouts: unknown layout {layout!r}; expected 'padded' and/or 'packed'")
        ds = pipeline.make_dataset(convs, tokenizer, max_length=n, per_host_batch_size=b, shuffle=False,
                                   num_epochs=1, min_loss_tokens=min_loss, num_threads=1,
                                   pack=layout == "packed", pack_bins=FLAGS.pack_bins)
        batches[layout] = [{k: jnp.asarray(x[k]) for k in keys[layout]}
                           for x in itertools.islice(iter(ds), FLAGS.steps + 1)]
        if len(batches[layout]) < FLAGS.steps + 1:
            raise SystemExit(f"only {len(batches[layout])} {layout} batches of {b} rows with >= {min_loss} answer "
                             f"tokens in {FLAGS.records} records; raise --records")
        got = batches[layout]
        answer_frac = float(np.mean([np.asarray(x["loss_mask"]).mean() for x in got]))
        real_frac = float(np.mean([np.asarray(x["attention_mask"]).mean() for x in got]))
        print(f"{layout}: {len(got)} batches [{b}, {n}], {100 * real_frac:.0f}% real tokens, "
              f"{100 * answer_frac:.0f}% answer tokens", flush=True)
    print(f"setup {time.time() - t0:.1f}s: target {cfg.n_layers} layers d={cfg.d_model} V={cfg.vocab_size}",
          flush=True)
    offline = None
    if FLAGS.offline_features:
        from confu_jax.data.target_features import FeatureStore

        offline = FeatureStore(FLAGS.offline_features)
        if offline.max_length != n:
            raise SystemExit(f"--offline_features {FLAGS.offline_features}: written for rows of {offline.max_length} "
                             f"tokens, --max_length is {n}")
        # the stored rows in order, batched: the same conversations the padded layout reads
        rows = [offline[i] for i in range(min(len(offline), b * (FLAGS.steps + 1)))]
        if len(rows) < b * (FLAGS.steps + 1):
            raise SystemExit(f"--offline_features holds {len(offline)} rows; {b * (FLAGS.steps + 1)} needed")
        batches["offline"] = [{k: jnp.asarray(np.stack([r[k] for r in rows[i * b:(i + 1) * b]])) for k in rows[0]}
                              for i in range(FLAGS.steps + 1)]
        if "packed" in FLAGS.layouts:
            from confu_jax.data.target_features import feature_dataset

            ds = feature_dataset(offline, per_host_batch_size=b, shuffle=False, pack=True, pack_bins=FLAGS.pack_bins)
            batches["offline@packed"] = [{k: jnp.asarray(v) for k, v in x.items()}
                                         for x in itertools.islice(iter(ds), FLAGS.steps + 1)]

    runs, results = {}, {}
    plan = [(v, layout) for v in FLAGS.variants for layout in FLAGS.layouts]
    if offline is not None:
        plan += [("eagle3+offline", layout) for layout in ("offline", "offline@packed") if layout in batches]
    for variant, layout in plan:
        if layout.startswith("offline"):
            run_name = variant + layout.removeprefix("offline")
        else:
            run_name = variant if len(FLAGS.layouts) == 1 else f"{variant}@{layout}"
        name, _, k = variant.partition(":")
        name = name.removesuffix("+offline")
        config = base_config("smollm2-135m", name)
        config.draft.ttt_steps = FLAGS.ttt_steps
        config.objective.k_train = int(k) if k else FLAGS.k_train
        config.objective.vocab_chunk = FLAGS.vocab_chunk
        if FLAGS.draft_vocab_size:
            config.draft.draft_vocab_size = FLAGS.draft_vocab_size
        head = model_spec_from_config(config).head
        spec = ModelSpec(cfg, head)
        if layout.startswith("offline"):
            vocab = offline.draft_vocab()
            if vocab.draft_size != head.draft_vocab_size:
                raise SystemExit(f"--offline_features: draft vocabulary of {vocab.draft_size} ids; the "
                                 f"{name} config has {head.draft_vocab_size}")
        else:
            vocab = draft_vocab_from_conversations(convs, tokenizer, target_vocab_size=cfg.vocab_size,
                                                   draft_vocab_size=head.draft_vocab_size, max_length=n)
        dv = {"d2t": jnp.asarray(vocab.d2t), "t2d": jnp.asarray(vocab.t2d)}
        obj = objective_from_config(config)

        def loss_fn(trainable, frozen, batch, rng, spec=spec, dv=dv, obj=obj):
            return confu_loss(spec, trainable, frozen, dv, batch, rng, obj)

        data = batches[layout]
        tx, schedule = make_optimizer(config.train.optim, 1000)
        state = jax.jit(lambda: create_train_state(init_trainable(spec, jax.random.PRNGKey(0)), tx,
                                                   jax.random.PRNGKey(1)))()
        step = jax.jit(train_step_fn(loss_fn, tx, schedule), donate_argnums=(0,))
        t1 = time.time()
        compiled = step.lower(state, target, data[0]).compile()
        compile_s = time.time() - t1
        mem = compiled.memory_analysis()
        step_mib = None
        if mem is not None:
            step_mib = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                        - mem.alias_size_in_bytes) / 2 ** 20
        state, m = compiled(state, target, data[0])  # warm-up
        jax.block_until_ready(m)
        runs[run_name] = [compiled, state, [], data]
        results[run_name] = {"compile_s": compile_s, "step_memory_mib": step_mib, "layout": layout,
                             "k_train": int(config.objective.k_train) if get_variant(name).has_future else None}
        print(f"{run_name:>16}: compiled in {compile_s:.1f}s, step memory {step_mib or float('nan'):.0f} MiB",
              flush=True)

    # Interleaved rounds: on a shared machine, load drifts hit every variant alike.
    for i in range(FLAGS.steps):
        for variant, run in runs.items():
            t = time.time()
            run[1], m = run[0](run[1], target, run[3][1 + i])
            jax.block_until_ready(m)
            run[2].append(time.time() - t)
            results[variant]["loss_last"] = float(m["loss"])
            results[variant].setdefault("trained_positions", []).append(float(m["positions/step0"]))
            results[variant].setdefault("real_tokens", []).append(float(np.asarray(run[3][1 + i]["attention_mask"]).sum()))
    for variant, run in runs.items():
        sec = float(np.median(run[2]))
        pos = float(np.mean(results[variant]["trained_positions"]))
        real = float(np.sum(results[variant]["real_tokens"]) / np.sum(run[2]))
        results[variant].update(step_s=sec, step_s_all=run[2], tokens_per_s=b * n / sec,
                                real_tokens_per_s=real, trained_positions_per_s=pos / sec)
        print(f"{variant:>16}: step {sec:6.2f}s (median of {FLAGS.steps}) | {b * n / sec:7.1f} tokens/s | "
              f"{real:7.1f} real tokens/s | {pos:5.0f} trained positions/step (TTT step 0) | "
              f"loss {results[variant]['loss_last']:.3f}", flush=True)

    for variant in FLAGS.variants:
        if f"{variant}@packed" in results and f"{variant}@padded" in results:
            pk, pd = results[f"{variant}@packed"], results[f"{variant}@padded"]
            gain = pk["real_tokens_per_s"] / pd["real_tokens_per_s"]
            pk["real_tokens_per_s_over_padded"] = gain
            print(f"{variant}: packed / padded real tokens/s: {gain:.2f}x")
    summary = {"config": {"model": FLAGS.model, "batch": b, "max_length": n, "k_train": FLAGS.k_train,
                          "layouts": FLAGS.layouts, "min_loss_tokens": min_loss,
                          "ttt_steps": FLAGS.ttt_steps, "vocab_chunk": FLAGS.vocab_chunk,
                          "devices": [str(d) for d in jax.devices()]},
               "variants": results, "peak_rss_mib": _rss_mib()}
    for v in results:  # each run against EAGLE-3 on the same rows (same layout)
        lay = results[v]["layout"]
        base = "eagle3" if "eagle3" in results else f"eagle3@{ {'offline': 'padded', 'offline@packed': 'packed'}.get(lay, lay)}"
        if v == base or base not in results:
            continue
        paired = [c / e for c, e in zip(runs[v][2], runs[base][2])]
        ratio = results[v]["step_s"] / results[base]["step_s"]
        results[v]["step_time_over_eagle3"] = ratio
        results[v]["step_time_over_eagle3_paired_median"] = float(np.median(paired))
        print(f"{v} / {base} step time: {ratio:.3f}x (medians), {float(np.median(paired)):.3f}x "
              f"(median of per-round ratios)")
    print(f"peak RSS: {summary['peak_rss_mib']:.0f} MiB")
    if FLAGS.out:
        storage.write_text(FLAGS.out, json.dumps(summary, indent=1))


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.train_bench", main)
