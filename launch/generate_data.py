"""Self-distillation: regenerate every assistant turn with the target, write SpecForge JSONL.

    python -m launch.generate_data --output data/regen.jsonl \
        [--model smollm2-135m-instruct] [--input sharegpt,more.jsonl] [--max_records 1000] \
        [--batch_size 16] [--max_new_tokens 512] [--max_turns 0] [--temperature 0] [--top_p 1]
        [--reuse_prefix] [--fill_rows 1] [--steps_per_sync 16]
        [--release releases/data/<name>] [--chat_template_kwargs '{"enable_thinking": false}']

Why: a draft head is trained to imitate the *target's* next-token distribution, so training on the
target's own answers (instead of ShareGPT's ChatGPT answers) removes a distribution shift; EAGLE
recommends it. System and user turns are kept verbatim; assistant turns are regenerated in order,
each one conditioned on the *regenerated* earlier answers (the context the target produces at
inference). User turns after the last assistant turn are dropped (nothing to learn from them).
Each turn is generated from the prompt the chat template gives for it (the conversation so far with
the generation prompt), so templates that re-render earlier turns (Qwen3 drops their reasoning) work.
``--chat_template_kwargs`` (a JSON object) reaches every render: ``'{"enable_thinking": false}'``
makes Qwen3 answer without a reasoning block (otherwise a ``--max_new_tokens`` answer may be cut off
inside its reasoning); a kwarg the template does not read is refused in one line naming the
variables it does read. Records and ``<output>.runs.jsonl`` name the template (sha256) and kwargs.

Generation is batched and jitted. The default engine is **continuous batching**
(``confu_jax.decode.continuous``): ``--batch_size`` slots decode together and a slot whose answer
finished is refilled at once with the next prompt — the next turn of the same conversation
(conditioned on the regenerated answer) or a new conversation — without recompiling; a progress
bar shows conversations and generated tokens/s. A conversation's next turn stays in its slot and
prefills only the tokens the turn adds to the cached context (``--reuse_prefix``, default on;
greedy tokens equal a from-scratch prefill up to float rounding at near-ties), and slots freed
together are prefilled together (``--fill_rows``). ``--engine static`` runs batches of
``--batch_size`` conversations turn by turn through ``generate_ar`` instead.

**A node or a pod** (``confu_jax.data.distill_shards``): run the same command once per process (host);
each takes the conversations whose id hashes to its slot — ``--shard_index`` / ``--num_shards``, else
the launcher's environment (``JAX_PROCESS_ID`` / ``JAX_NUM_PROCESSES``, SLURM's ``SLURM_PROCID`` /
``SLURM_NTASKS``, a Cloud TPU VM pod's worker id) — appends to its own
``<output>.shard-IIIII-of-NNNNN`` file (resumable like any output) and marks it done; process 0 then
waits for every shard and merges them into ``--output`` in input order (``--nomerge``: leave that to a
later run). **Every local device generates**: by default each of this process's devices holds a
replica of the target and runs its own engine on its own share of the conversations (threads; XLA
runs outside the GIL), each (process, device) pair one shard of the split above, so the merged
output is what one device writes; ``--devices N`` uses the first N. ``--shard_target`` (automatic
when the weights exceed half a device's memory) splits the target's weights over the devices
instead (a tensor axis), one engine; the processes never communicate.

Output ``{"id", "conversations": [{"role", "content"}]}`` per line, append-only, flushed and fsynced
after every conversation (continuous) or batch (static), so a killed run loses at most the
conversations in flight. ``--output``, ``--input``, ``--model`` and ``--release`` may be ``gs://`` URLs:
the output object grows by composed appends, at most one every 5 s (GCS takes about one mutation a
second per object; a kill there loses the records of those seconds too), shards and markers live
beside it (docs/scale.md).
Rerunning with the same ``--output`` resumes: ids already in the file are skipped, and a torn last
line (killed mid-write) is cut off first. Input ids must be unique (duplicates after the first are
skipped, with a count).
A conversation whose prompt would exceed ``--max_prompt_len`` tokens stops at the answers it has, as
does one whose answer comes back empty (the target ended its turn at once: nothing to learn, and
not a usable record); one with no regenerated answer at all is not written (and is re-checked,
cheaply, on resume).

Every invocation appends its command line to ``<output>.runs.jsonl`` (``launch.release_data``
records it in the release manifest). ``--release releases/data/<name>`` skips the conversations
that data release already holds (its parts are hash-checked first), so nothing released is ever
generated twice; pack the output into it with ``launch.release_data``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import sys

import numpy as np

from confu_jax import storage
from confu_jax.data.chat import parse_template_kwargs
from confu_jax.decode import self_distill
from confu_jax.decode.self_distill import (drop_released, generate_dataset, keep_turns, make_generate_fn,
                                           read_records, regenerate_continuous)
from confu_jax.data.distill_shards import (merge_shards, mark_done, process_slot, shard_of, shard_output,
                                           wait_for_shards)
from confu_jax.runs.lock import output_lock

log = logging.getLogger("generate_data")


def _define_flags(flag_values=None):
    """The CLI's flags, defined on ``flag_values`` (default: absl's global FLAGS)."""
    import functools

    from absl import flags as absl_flags

    fv = flag_values if flag_values is not None else absl_flags.FLAGS

    class _Bound:  # absl's DEFINE_* bound to ``fv`` (parse_generation_command defines them on its own)
        FLAGS = fv

        def __getattr__(self, name):
            return functools.partial(getattr(absl_flags, name), flag_values=fv)

    flags = _Bound()

    flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf or HF directory")
    flags.DEFINE_string("tokenizer", "", "tokenizer source (default: --model)")
    flags.DEFINE_list("input", ["sharegpt"], "conversation files or asset names (ShareGPT/SpecForge/UltraChat)")
    flags.DEFINE_string("output", None, "JSONL to write (appended to; rerun to resume)", required=True)
    flags.DEFINE_integer("max_records", 0, "use only the first N good input conversations (0 = all)")
    flags.DEFINE_integer("max_turns", 0, "regenerate at most this many assistant turns per conversation (0 = "
                         "all); later turns are dropped. 1 suits training rows too short to reach later turns")
    flags.DEFINE_enum("engine", "continuous", ["continuous", "static"],
                      "continuous: B slots refilled as rows finish (confu_jax.decode.continuous); "
                      "static: batches of --batch_size conversations, turn by turn (generate_ar)")
    flags.DEFINE_integer("batch_size", 32, "rows decoded together (continuous: slots; static: conversations per call)")
    flags.DEFINE_integer("steps_per_sync", 16, "continuous: decode steps between host checks for finished rows")
    flags.DEFINE_bool("reuse_prefix", True, "continuous: a conversation's next turn continues in its slot and "
                      "prefills only the tokens the turn adds (off: every turn prefills its whole context)")
    flags.DEFINE_integer("fill_rows", 1, "continuous: slots refilled at one sync are prefilled together, this "
                         "many at most per call")
    flags.DEFINE_integer("max_new_tokens", 512, "tokens generated per assistant turn at most")
    flags.DEFINE_integer("max_prompt_len", 512,
                         "longest prompt (tokens) a turn may be generated from; the continuous engine's "
                         "cache holds max_prompt_len + max_new_tokens slots per row")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy")
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (temperature > 0)")
    flags.DEFINE_string("dtype", "", "parameter/compute dtype (default: the checkpoint's)")
    flags.DEFINE_enum("on_bad_record", "skip", ["skip", "fail"], "what to do with malformed input records")
    flags.DEFINE_integer("num_shards", None, "split the conversations over this many processes/hosts (by id "
                         "hash); default: the launcher's environment (JAX_NUM_PROCESSES, SLURM_NTASKS, TPU "
                         "pod workers), else 1")
    flags.DEFINE_integer("shard_index", None, "which shard this process generates (default: the launcher's "
                         "environment); its output gets a '.shard-IIIII-of-NNNNN' suffix when num_shards > 1")
    flags.DEFINE_bool("merge", True, "with several shards: process 0 waits for every shard, then merges them "
                      "into --output in input order")
    flags.DEFINE_bool("shard_target", False, "split the target's weights over this process's devices (a tensor "
                      "axis), one engine, instead of a replica and an engine on each device (the default; also "
                      "split automatically when the weights exceed half a device's memory)")
    flags.DEFINE_integer("devices", 0, "local devices that generate, each with its own replica of the target and "
                         "its own share of the conversations (0 = all of this process's devices)")
    flags.DEFINE_integer("cpu_devices", 0, "expose N CPU devices in this process (tests of --shard_target on a "
                         "CPU machine); 0 = JAX's default")
    flags.DEFINE_string("chat_template_kwargs", "", "JSON object of extra chat-template variables for every "
                        "render, e.g. '{\"enable_thinking\": false}' (Qwen3 without reasoning); a kwarg the "
                        "template does not read is refused")
    flags.DEFINE_list("release", [], "data release folders (releases/data/<name>, confu_jax.data.releases), "
                      "comma-separated: conversations any of them holds are not generated again")
    return flags.FLAGS


def parse_generation_command(command: str) -> dict:
    """The generation settings of a ``launch.generate_data`` command line (defaults filled in):
    ``command`` plus model, tokenizer, dtype, input, max_records, max_turns, temperature, top_p,
    max_new_tokens, max_prompt_len, engine, batch_size."""
    import shlex

    from absl import flags as absl_flags

    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w in ("launch.generate_data", "launch/generate_data.py")
               or w.endswith("/launch/generate_data.py")), None)
    if at is None:
        raise ValueError(f"not a launch.generate_data command line: {command!r}")
    fv = absl_flags.FlagValues()
    _define_flags(fv)
    try:
        fv(["generate_data"] + words[at + 1 :])
    except absl_flags.Error as e:
        raise ValueError(f"cannot parse the generate_data command {command!r}: {e}") from e
    return {"command": command, **settings_of(fv)}


SETTING_KEYS = ("model", "tokenizer", "dtype", "input", "max_records", "max_turns", "temperature", "top_p",
                "max_new_tokens", "max_prompt_len", "engine", "batch_size")


def settings_of(fv) -> dict:
    """The generation settings (``SETTING_KEYS``) of parsed flag values, as recorded in the release manifest."""
    settings = {k: fv[k].value for k in SETTING_KEYS}
    settings["tokenizer"] = settings["tokenizer"] or settings["model"]
    settings["input"] = list(settings["input"])
    settings["chat_template_kwargs"] = parse_template_kwargs(fv["chat_template_kwargs"].value)
    return settings


def record_run(output: str, argv, template_sha256=None) -> str:
    """Record this invocation beside ``output`` (``self_distill.record_run``: its command line and its
    settings as JSON, with the sha256 of the chat template that rendered the prompts) -> the command line."""
    import shlex

    from absl import flags as absl_flags

    command = "python -m launch.generate_data " + shlex.join(list(argv[1:]))
    fv = absl_flags.FlagValues()
    _define_flags(fv)
    fv(["generate_data"] + list(argv[1:]))
    settings = settings_of(fv)
    if template_sha256:  # known once the tokenizer is loaded (a command parsed alone has none)
        settings["chat_template_sha256"] = template_sha256
    self_distill.record_run(output, command, settings)
    return command


def main(argv):
    del argv
    from confu_jax.compile_cache import enable_compilation_cache
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.formats import load_conversations

    f = FLAGS
    if f.cpu_devices:
        from confu_jax.train.distributed import configure_cpu

        configure_cpu(f.cpu_devices, None)
    enable_compilation_cache()  # compiled programs persist across runs (CONFU_JAX_COMPILE_CACHE)
    try:
        shard_index, num_shards = process_slot(f.shard_index, f.num_shards)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    # before the input is read: a kwarg the template does not read is one line and exit 2
    tokenizer = ChatTokenizer.load(f.tokenizer or f.model,
                                   template_kwargs=parse_template_kwargs(f.chat_template_kwargs))
    template_sha256 = tokenizer.template_record()["sha256"]
    convs, report = load_conversations(
        f.input, on_bad_record=f.on_bad_record, max_records=f.max_records or None
    )
    log.info("input: %s", report.summary())
    every = [keep_turns(c, f.max_turns) for c in convs]  # all shards' conversations (process 0 merges them)
    n_released = 0
    for release in f.release:
        every, n_dropped = drop_released(every, release)
        n_released += n_dropped
        log.info("%s: %d conversations already released, not generated again", release, n_dropped)
    import jax

    cfg, params, devices = _load_target(f.model, f.dtype or None, f.shard_target, f.devices)
    # Every local device generates: a replica of the target on each (its own engine, its own slice of
    # the conversations) unless the target is split over them (--shard_target, or too big for one).
    # Each (process, device) pair is one shard of the split the shard machinery already keeps: its own
    # output file, a done marker, process 0's merge in input order: the merged output is what one
    # device writes.
    n_local = len(devices)
    total = num_shards * n_local
    assignment = [[] for _ in range(total)]
    for c in every:
        assignment[shard_of(c["id"], total)].append(c["id"])
    mine = [shard_index * n_local + j for j in range(n_local)]
    outputs = [shard_output(f.output, k, total) for k in mine]
    log.info("process %d of %d, %d device(s) (%s): %d conversations -> %s", shard_index, num_shards, n_local,
             "target replicated on each" if n_local > 1 else "one engine", sum(len(assignment[k]) for k in mine),
             ", ".join(outputs))
    with contextlib.ExitStack() as locks:
        for out in outputs:  # one writer per output: a second resume would interleave the same ids
            locks.enter_context(output_lock(out))
        storage.makedirs(os.path.dirname(storage.absolute(f.output)))  # gs://: nothing to create
        for out in outputs:
            record_run(out, sys.argv, template_sha256)

        def work(j):
            k = mine[j]
            convs_k = [c for c in every if shard_of(c["id"], total) == k]
            p = jax.device_put(params, devices[j]) if n_local > 1 else params
            # one progress bar per device (a terminal), or a line a minute each naming its device (a log)
            label = f"regenerating on {devices[j]}" if n_local > 1 else "regenerating"
            with jax.default_device(devices[j]) if n_local > 1 else contextlib.nullcontext():
                return _generate(f, convs_k, outputs[j], tokenizer, cfg, p, desc=label,
                                 position=j if n_local > 1 else None)

        if n_local == 1:
            per_device = [work(0)]
        else:
            with concurrent.futures.ThreadPoolExecutor(n_local) as pool:  # XLA runs outside the GIL
                per_device = list(pool.map(work, range(n_local)))
        # counts add up; "seconds" is the slowest engine's (they ran at once)
        stats = {key: (max if key == "seconds" else sum)(d.get(key, 0) for d in per_device) for key in per_device[0]}
        summary = {"output": outputs[0] if len(outputs) == 1 else outputs, **stats,
                   **({"already_released": n_released} if f.release else {})}
        if n_local > 1:
            summary["devices"] = [{"device": str(devices[j]), "conversations": len(assignment[mine[j]]),
                                   "written": d["written"], "tokens_generated": d.get("tokens_generated", 0)}
                                  for j, d in enumerate(per_device)]
            for d in summary["devices"]:
                log.info("%s: %d conversations, %d written, %d tokens", d["device"], d["conversations"],
                         d["written"], d["tokens_generated"])
        if total > 1:
            for j, k in enumerate(mine):
                mark_done(outputs[j], assignment[k], per_device[j])
            if shard_index == 0 and f.merge:
                wait_for_shards(f.output, assignment)
                summary["merged"] = merge_shards(f.output, total, [c["id"] for c in every], read_records)
                summary["merged"]["output"] = f.output
                record_run(f.output, sys.argv, template_sha256)  # the merged file's provenance, for launch.release_data
    print(json.dumps(summary))


def _generate(f, convs, output, tokenizer, cfg, params, **bar) -> dict:
    """One engine's regeneration of ``convs`` into ``output`` (resumable): the flags' engine and settings;
    ``bar``: the progress bar's ``desc`` / ``position``."""
    if f.engine == "continuous":
        return regenerate_continuous(convs, output, tokenizer, cfg, params, batch_size=f.batch_size,
                                     max_new_tokens=f.max_new_tokens, max_prompt_len=f.max_prompt_len,
                                     temperature=f.temperature, top_p=f.top_p, steps_per_sync=f.steps_per_sync,
                                     reuse_prefix=f.reuse_prefix, fill_rows=f.fill_rows, **bar)
    generate_fn = make_generate_fn(params, cfg, max_new_tokens=f.max_new_tokens, temperature=f.temperature,
                                   top_p=f.top_p, eos_ids=tokenizer.eos_ids)
    return generate_dataset(convs, output, tokenizer, generate_fn, batch_size=f.batch_size,
                            max_prompt_len=f.max_prompt_len, **bar)


# A replica of the target on every device only where it leaves this share of the device's memory to
# the caches and activations; else the target is split over the devices (tensor axis), one engine.
REPLICA_SHARE = 0.5


def _load_target(model: str, dtype, shard: bool, n_devices: int = 0):
    """(LlamaConfig, params, devices the engines run on). By default one replica per local device
    (``n_devices`` > 0: the first that many), loaded once on the host's default device and copied to
    each engine's; with ``shard``, or when the weights would take more than ``REPLICA_SHARE`` of a
    device's memory, split over this process's devices along a tensor axis (the training layout's
    rules; a Hugging Face checkpoint is read slice by slice) and driven by one engine."""
    import jax

    from confu_jax import sharding as shd
    from confu_jax.devices import device_memory_bytes
    from confu_jax.models.llama import param_shapes
    from confu_jax.weights import load_model, load_model_sharded, read_architecture

    local = jax.local_devices()
    if n_devices < 0 or n_devices > len(local):
        raise ValueError(f"--devices={n_devices}: this process has {len(local)} local device(s)")
    local = local[:n_devices] if n_devices else local
    cfg = read_architecture(model, dtype)
    weight_bytes = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                       for s in jax.tree_util.tree_leaves(param_shapes(cfg)))
    memory = device_memory_bytes(local[0].device_kind)
    if not shard and len(local) > 1 and memory and weight_bytes > REPLICA_SHARE * memory:
        log.info("the target's %.1f GiB exceed %.0f%% of a %s's memory: split over the %d devices, one engine",
                 weight_bytes / 2**30, 100 * REPLICA_SHARE, local[0].device_kind, len(local))
        shard = True
    if not shard:
        cfg, params = load_model(model, dtype)
        return cfg, params, local
    mesh = shd.make_mesh(1, 1, len(local), devices=local)
    shardings = shd.tree_shardings(param_shapes(cfg), mesh, shd.PARAM_RULES, axis_units=shd.llama_axis_units(cfg.head_dim))
    cfg, params = load_model_sharded(model, shardings, dtype)
    return cfg, params, [local[0]]


if __name__ == "__main__":
    from absl import app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    FLAGS = _define_flags()
    from confu_jax.user_errors import run

    run("launch.generate_data", main)
