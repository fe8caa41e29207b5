"""Chat with a target model from the command line.

    python -m launch.generate --prompt "What is speculative decoding?"
    python -m launch.generate --prompt "Hi" --temperature 0.7 --top_p 0.9 --seed 1
    python -m launch.generate --prompt "Hi" --config.decode.max_new_tokens=64
    python -m launch.generate --prompt "Hi" --method confu --draft_ckpt runs/smollm2_confu --plan dynamic:6,8,30
    python -m launch.generate --prompt "Hi" --method eagle3 --plan chain:4   # random head: smoke/lossless check
    python -m launch.generate --prompt "Summarize: ..." --method lookup --plan chain:4   # model-free lookup
    python -m launch.generate --prompt "Hi" --method draft_model --draft_model self:8 --plan chain:3
    python -m launch.generate --prompt "Hi" --method sd2 --draft_model runs/smollm2_sd2 --plan chain:3

The prompt is wrapped as one user turn and rendered with the checkpoint's chat template (generation
prompt appended; ``--chat_template_kwargs '{"enable_thinking": false}'`` passes template variables,
e.g. Qwen3's switch that answers without a reasoning block). The completion goes to stdout; timing (compile time, tokens/s) to stderr, so the
output pipes cleanly. ``--max_new_tokens/--temperature/--top_p/--seed`` are shorthands for the
matching ``--config.decode.*`` fields and win over them when given.

Decoding methods are looked up in ``METHODS``: ``ar`` (jitted autoregressive), ``eagle3`` and
``confu`` (the jitted speculative loop, ``confu_jax.decode.loop``), ``lookup`` (model-free prompt
lookup) and ``hybrid`` (lookup where it matches, a head elsewhere). A head method reads its head
from ``--draft_ckpt`` (a ``launch.train`` workdir); without it a randomly initialised head is
used — τ stays near 1 but the output must still equal ``--method ar``'s (lossless), which makes it
a smoke test. ``--plan`` (alias ``--tree``) is the method's plan (``decode.families``). The speculative methods also
print τ (mean tokens per target pass, Spec-Bench). ``--attention_impl pallas`` verifies with the Pallas
tree-attention kernel (a CUDA GPU only; refused in one line, exit 2, on other backends) and ``--mesh``
decodes over a device mesh.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Callable, NamedTuple, Optional

from absl import app, flags
from ml_collections import config_flags

from confu_jax.bench.cli_args import ATTENTION_CHOICES, ATTENTION_HELP
from confu_jax.decode.families import METHODS as REGISTERED_METHODS
from confu_jax.user_errors import one_line_errors

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "configs", "generate.py")


class MethodOutput(NamedTuple):
    tokens: list  # emitted token ids (the stop token included when it was emitted)
    stop_reason: str
    compile_s: float  # tracing + XLA compilation, paid once per shape bucket
    decode_s: float  # prefill + decode of this prompt, compiled program only
    accept_log: Optional[list] = None  # speculative: tokens emitted per target pass (bonus included)
    head: str = ""  # speculative: where the draft head came from


def run_ar(params, cfg, prompt_ids: list, decode, eos_ids, mesh=None, **_) -> MethodOutput:
    """Jitted autoregressive decoding (``confu_jax.decode.generate``); ``mesh``: sharded
    (``confu_jax.decode.sharded``)."""
    import jax
    import numpy as np

    from confu_jax.decode.generate import compile_ar
    from confu_jax.decode.sharded import place_target
    from confu_jax.decode.stopping import StopReason

    if mesh is not None:
        params = place_target(params, cfg, mesh)
    t0 = time.perf_counter()
    run, args = compile_ar(
        params, cfg, [prompt_ids], max_new_tokens=decode.max_new_tokens,
        temperature=decode.temperature, top_p=decode.top_p, seed=decode.seed, eos_ids=eos_ids,
        max_len=decode.max_len or None, min_bucket=decode.min_bucket, mesh=mesh)
    t1 = time.perf_counter()
    res = jax.block_until_ready(run(params, *args))
    t2 = time.perf_counter()
    n = int(np.asarray(res.n_generated_b)[0])
    tokens = np.asarray(res.tokens_bn)[0, :n].tolist()
    reason = StopReason(int(np.asarray(res.stop_reason_b)[0])).name.lower()
    return MethodOutput(tokens, reason, t1 - t0, t2 - t1)


def run_speculative(params, cfg, prompt_ids: list, decode, eos_ids, *, method: str,
                    draft_ckpt: Optional[str] = None, plan: Optional[str] = None, seed: int = 0,
                    target_source: str = "the loaded target", mesh=None,
                    draft_model: Optional[str] = None) -> MethodOutput:
    """The jitted speculative loop with a trained (``draft_ckpt``) or random head, or for the
    draft-model methods the draft model ``draft_model`` (``self:N``, a checkpoint, an SD² run);
    ``mesh``: sharded (``confu_jax.decode.sharded``)."""
    import jax
    import numpy as np

    from confu_jax.decode.stopping import StopReason
    from confu_jax.decode.families import FAMILIES, decode_head, drafter_for, family_of
    from confu_jax.decode.loop import compile_speculative
    from confu_jax.decode.sharded import place_params

    family = family_of(method)
    if draft_model and family.source_flag != "draft_model":
        takes = sorted(m for m, spec in REGISTERED_METHODS.items() if spec.family in FAMILIES
                       and FAMILIES[spec.family].source_flag == "draft_model")
        raise ValueError(f"--draft_model is for --method {' / '.join(takes)}, not {method} (its weights: --draft_ckpt)")
    source = (draft_model or draft_ckpt) if family.source_flag == "draft_model" else draft_ckpt
    head = decode_head(method, cfg, params, source, seed=seed, target_source=target_source)
    drafter = drafter_for(method, plan, head)  # the default plan fits the head; a deeper one is refused
    target, drafter_params = head.target, head.drafter_params
    if mesh is not None:
        target, drafter_params = place_params(target, drafter_params, mesh)
    t0 = time.perf_counter()
    run, args = compile_speculative(  # a plan the drafter cannot run is refused here, at trace time
        target, drafter, drafter_params, [prompt_ids], max_new_tokens=decode.max_new_tokens,
        temperature=decode.temperature, top_p=decode.top_p, seed=decode.seed, eos_ids=eos_ids,
        max_len=decode.max_len or None, min_bucket=decode.min_bucket, mesh=mesh)
    t1 = time.perf_counter()
    if not head.trained and REGISTERED_METHODS[method].needs_head:
        print(f"[{method}] no --draft_ckpt: using an UNTRAINED draft head ({head.source}); "
              "output is still the target's, but expect tau ~ 1", file=sys.stderr)
    res = jax.block_until_ready(run(target, drafter_params, *args))
    t2 = time.perf_counter()
    n = int(np.asarray(res.n_generated_b)[0])
    passes = int(np.asarray(res.n_passes_b)[0])
    tokens = np.asarray(res.tokens_bn)[0, :n].tolist()
    reason = StopReason(int(np.asarray(res.stop_reason_b)[0])).name.lower()
    log = np.asarray(res.accept_log_bi)[0, :passes].tolist()
    return MethodOutput(tokens, reason, t1 - t0, t2 - t1, log, head.source)


# --method name -> fn(params, cfg, prompt_ids, config.decode, eos_ids, draft_ckpt=, plan=) -> MethodOutput,
# one entry per method of the registry (confu_jax.models.registry)
METHODS: dict[str, Callable[..., MethodOutput]] = {
    name: functools.partial(run_speculative, method=name) if m.speculative else run_ar
    for name, m in REGISTERED_METHODS.items() if not m.chooses_method
}

flags.DEFINE_string("prompt", None, "user message; rendered with the model's chat template", required=True)
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "target model: an asset name (smollm2-135m-instruct), a .gguf file, or a Hugging "
                    "Face directory with config.json + model.safetensors + tokenizer.json")
flags.DEFINE_enum("method", "ar", sorted(METHODS),
                  "decoding method: 'ar' = jitted autoregressive decoding; 'eagle3', 'confu' and the ConFu "
                  "ablations = speculative decoding with the head from --draft_ckpt (random head without it)")
flags.DEFINE_string("draft_ckpt", None, "speculative methods: a launch.train workdir holding the trained "
                    "draft head (config.json + checkpoints/), or for eagle3 an EAGLE-3 head directory in the "
                    "official (SGLang / SpecForge) or speculators (vLLM) format; unset = randomly initialised head")
flags.DEFINE_string("draft_model", None, "--method draft_model / sd2: the draft model, self:N (the target's first "
                    "N layers + its final norm and LM head; default a quarter of its layers), an asset name, a .gguf "
                    "file or a Hugging Face directory sharing the target's tokenizer (checked), or for sd2 a "
                    "launch.train SD² workdir (configs/*_sd2.py)")
flags.DEFINE_string("plan", None, "speculative methods: draft plan (--tree: the same flag), chain:K | "
                    "sampled_chain:K | "
                    "dynamic:DEPTH,TOPK,NODES (EAGLE-2 tree; NODES excludes the root) | tree:k1,...,kD; block "
                    "drafters (dflash, medusa) also ddtree:N[,D] (DDTree: the N best nodes over the block's "
                    "per-position top-k, at most D deep); lookup also "
                    "lookup:K[,W[,NMIN,NMAX]]. Default: chain:4, or as deep as the head drafts when it "
                    "drafts fewer (Medusa heads, MLP speculator stages)")
flags.DEFINE_alias("tree", "plan")  # the flag's first name: a plan may be a chain
flags.DEFINE_integer("max_new_tokens", None, "most tokens to generate (overrides config.decode.max_new_tokens)")
flags.DEFINE_float("temperature", None, "sampling temperature, 0 = greedy (overrides config.decode.temperature)")
flags.DEFINE_float("top_p", None, "nucleus sampling mass in (0, 1], 1 = off (overrides config.decode.top_p)")
flags.DEFINE_bool("print_ids", False, "also print the generated token ids to stderr (exact comparisons)")
flags.DEFINE_string("chat_template_kwargs", "", "JSON object of extra chat-template variables, e.g. "
                    "'{\"enable_thinking\": false}' (Qwen3 without reasoning; the kwargs the head's data was "
                    "generated with); a kwarg the template does not read is refused")
flags.DEFINE_integer("seed", None, "RNG seed for sampling (overrides config.decode.seed)")
flags.DEFINE_string("mesh", "", "decode over a device mesh, e.g. tensor=8 (heads / MLP / vocabulary of the "
                    "target and head split over 'tensor', for targets that do not fit one device); axes "
                    "data, fsdp, tensor with the training rules (confu_jax/sharding.py). One prompt is one "
                    "row, so data × fsdp must be 1. Empty = one device. On CPU the mesh's devices are faked "
                    "(--xla_force_host_platform_device_count), a layout check rather than a speed-up")
flags.DEFINE_enum("attention_impl", "xla", list(ATTENTION_CHOICES), ATTENTION_HELP)
try:  # with a default file, ml_collections applies the --config.X overrides here, at definition
    config_flags.DEFINE_config_file(
        "config", _DEFAULT_CONFIG,
        "ml_collections config file with the decode settings (fields: decode.max_new_tokens, "
        "decode.temperature, decode.top_p, decode.seed, decode.min_bucket, decode.max_len, chat.system); "
        "override fields with --config.decode.top_p=0.9 etc.",
        lock_config=True)
except (AttributeError, KeyError, TypeError, ValueError) as _e:
    from confu_jax.user_errors import config_override_error

    config_override_error("launch.generate", _e)
FLAGS = flags.FLAGS


def resolved_config():
    """The config with the shorthand flags applied (they win over --config.decode.*)."""
    config = FLAGS.config
    for name in ("max_new_tokens", "temperature", "top_p", "seed"):
        value = getattr(FLAGS, name)
        if value is not None:
            with config.unlocked():
                setattr(config.decode, name, value)
    return config


def main(argv):
    from confu_jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # compiled programs persist across runs (CONFU_JAX_COMPILE_CACHE)
    if FLAGS.mesh:
        from confu_jax.decode.sharded import fake_host_devices

        fake_host_devices(FLAGS.mesh)  # before JAX starts its backends
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU backend" noise
    from confu_jax.runs.quiet_logs import quiet_orbax_logs

    quiet_orbax_logs()  # no save-phase chatter or read-only warnings from orbax
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}; pass the text with --prompt")
    if not REGISTERED_METHODS[FLAGS.method].speculative:  # before the target loads: a flag it would ignore
        given = [f"--{name}" for name in ("draft_ckpt", "draft_model", "plan") if getattr(FLAGS, name)]
        if given:
            with one_line_errors("launch.generate"):
                raise ValueError(f"{' / '.join(given)} set, but --method {FLAGS.method} drafts nothing (they are "
                                 "for the speculative methods)")
    from confu_jax.bench.cli_args import decode_attention_impl
    from confu_jax.data.chat import ChatTokenizer, parse_template_kwargs
    from confu_jax.weights import load_model

    with one_line_errors("launch.generate"):  # a kernel this backend lacks: refused before the model loads
        attention_impl = decode_attention_impl(FLAGS.attention_impl)
    config = resolved_config()
    try:  # an unsupported or broken checkpoint, a missing chat template: one line naming file and field
        tok = ChatTokenizer.load(FLAGS.model, template_kwargs=parse_template_kwargs(FLAGS.chat_template_kwargs))
        cfg, params = load_model(FLAGS.model)
        cfg = cfg.replace(attention_impl=attention_impl)
        messages = [{"role": "system", "content": config.chat.system}] if config.chat.system else []
        messages.append({"role": "user", "content": FLAGS.prompt})
        prompt_ids = tok.encode(tok.render(messages, add_generation_prompt=True))
    except (ValueError, FileNotFoundError) as e:  # CheckpointError, AssetNotFoundError included
        sys.exit(f"launch.generate: {e}")
    mesh = None
    if FLAGS.mesh:
        from confu_jax.decode.sharded import parse_mesh

        try:
            mesh = parse_mesh(FLAGS.mesh)
        except ValueError as e:
            raise app.UsageError(str(e))
    with one_line_errors("launch.generate"):  # a bad plan, head or setting: one line, exit 2
        out = METHODS[FLAGS.method](params, cfg, prompt_ids, config.decode, tok.eos_ids,
                                    draft_ckpt=FLAGS.draft_ckpt, plan=FLAGS.plan, target_source=FLAGS.model,
                                    mesh=mesh, draft_model=FLAGS.draft_model)
    print(tok.decode(out.tokens, skip_special_tokens=True).strip())
    print(f"[{FLAGS.method}] prompt {len(prompt_ids)} tokens, generated {len(out.tokens)} "
          f"(stop: {out.stop_reason}) in {out.decode_s:.2f} s = {len(out.tokens) / out.decode_s:.1f} "
          f"tokens/s; compile {out.compile_s:.1f} s", file=sys.stderr)
    if out.accept_log is not None:
        tau = sum(out.accept_log) / max(len(out.accept_log), 1)
        print(f"[{FLAGS.method}] tau = {tau:.3f} tokens per target pass over {len(out.accept_log)} passes "
              f"(plan {FLAGS.plan or 'the method default'}; head: {out.head})", file=sys.stderr)
    if FLAGS.print_ids:
        print("ids: " + " ".join(map(str, out.tokens)), file=sys.stderr)


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.generate", main)
