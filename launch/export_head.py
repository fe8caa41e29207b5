"""Export a trained head to the formats serving engines load: ``python -m launch.export_head``.

    python -m launch.export_head --workdir runs/smollm2_eagle3 --format eagle3 --out exports/e3_sglang
    python -m launch.export_head --workdir runs/smollm2_eagle3 --format speculators --out exports/e3_vllm \
        --embed_from smollm2-135m-instruct
    python -m launch.export_head --workdir runs/smollm2_medusa --format medusa --out exports/medusa --dtype bfloat16
    python -m launch.export_head --workdir runs/smollm2_mlp_speculator --format mlp_speculator --out exports/mlp
    python -m launch.export_head --workdir runs/smollm2_mtp --format mtp --out exports/mtp
    python -m launch.export_head --workdir runs/smollm2_dflash --format dflash --out exports/dflash

``--format eagle3`` writes the official EAGLE-3 layout (config.json + model.safetensors, tensors
``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` as offsets, ``t2d``), which SGLang and SpecForge
load; ``--format speculators`` writes vLLM's format (``speculators_config``, ``layers.0.*``). Layouts
and their conventions: docs/interop.md. Heads in either format
also load here: ``launch.generate --draft_ckpt DIR``, ``launch.decode_bench --heads``, and
``train.checkpoint.init_from=DIR``. ``--format medusa`` writes a Medusa run's heads as FasterDecoding's
``medusa_lm_head.safetensors`` + ``config.json`` (``weights.medusa_format``), which load back here
(``--heads medusa=DIR``) and in Medusa's own code. ``--format mlp_speculator`` writes an MLP speculator run
as the published fms-extras / vLLM layout (``config.json`` with model_type ``mlp_speculator`` +
``model.safetensors``, ``weights.mlp_speculator_format``), which loads back here
(``--heads mlp_speculator=DIR``), in vLLM (``--speculative-model``) and in fms-extras. ``--format mtp``
writes an MTP run in DeepSeek-V3's MTP layout (``model.layers.{N}.enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head.norm`` + the Llama layer's names, ``weights.mtp_format``; ``--mtp_shared`` adds the
target's embedding and LM head as ``embed_tokens`` / ``shared_head.head``), which loads back here
(``--heads mtp=DIR``). ``--format dflash`` writes a DFlash run as z-lab's released layout
(``DFlashDraftModel`` config.json with ``block_size`` / ``dflash_config`` + ``model.safetensors``,
``weights.dflash_format``), which loads back here (``--heads dflash=DIR``) and in the reference's
``AutoModel.from_pretrained(..., trust_remote_code=True)`` with its ``dflash.py``.

A ConFu head exports its EAGLE-3 part only (fc, the draft layer, LM head): serving engines have no
contemplate tokens, so its future path (soft prompts, MoE_con, MoE_f) is dropped, with a warning.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from confu_jax.decode.families import export_formats

flags.DEFINE_string("workdir", None, "a launch.train workdir (config.json + checkpoints/) holding the head",
                    required=True)
flags.DEFINE_integer("step", None, "checkpoint step to export (default: the latest)")
flags.DEFINE_enum("format", "eagle3", list(export_formats()),
                  "eagle3: official EAGLE-3 layout (SGLang, SpecForge); speculators: vLLM's format; "
                  "medusa: FasterDecoding's medusa_lm_head.safetensors + config.json (a Medusa run); "
                  "mlp_speculator: fms-extras / vLLM model.safetensors + config.json (an MLP speculator run); "
                  "mtp: DeepSeek-V3's MTP layer names around a Llama layer (an MTP run); "
                  "dflash: z-lab's DFlashDraftModel model.safetensors + config.json (a DFlash run)")
flags.DEFINE_string("out", None, "output directory (created; existing config.json / model.safetensors are "
                    "overwritten)", required=True)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "stored float dtype (default: the head's parameter dtype, float32 for our runs)")
flags.DEFINE_string("verifier", None, "speculators format: the target's Hugging Face id or path, recorded as "
                    "speculators_config.verifier.name_or_path (default: the source in the workdir's target.json)")
flags.DEFINE_string("embed_from", None, "speculators format: also store this target's embedding as "
                    "embed_tokens.weight (asset name, .gguf or HF directory; speculators' own loader needs "
                    "it, vLLM shares the target's when absent). Checked against the head's target fingerprint.")
flags.DEFINE_bool("mtp_shared", False, "mtp format: also store the target's embedding and LM head as the layer's "
                  "embed_tokens / shared_head.head (DeepSeek's checkpoints carry these copies)")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    import numpy as np

    from confu_jax.runs.heads import check_head_target, load_trained_head, read_target_record
    from confu_jax.weights.eagle3_formats import eagle3_part, export_head

    workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
    if FLAGS.format == "medusa":
        return export_medusa(workdir)
    if FLAGS.format == "mlp_speculator":
        return export_mlp_speculator(workdir)
    if FLAGS.format == "mtp":
        return export_mtp(workdir)
    if FLAGS.format == "dflash":
        return export_dflash(workdir)
    if FLAGS.embed_from and FLAGS.format != "speculators":
        raise app.UsageError("--embed_from is for --format speculators (the official format has no embedding)")
    head = load_trained_head(workdir, FLAGS.step)
    spec, trainable = head.spec, head.trainable
    if spec.head.has_future:
        print(f"WARNING: {workdir} holds a {spec.head.variant!r} head; exporting its EAGLE-3 part only. Serving "
              "engines (SGLang, vLLM) have no contemplate tokens, so the future path (soft prompts, MoE_con, "
              "MoE_f) is dropped and the exported draft runs without the future entry it was trained with: "
              "expect a lower acceptance length there than ConFu has here.", file=sys.stderr)
    spec, draft = eagle3_part(spec, trainable)
    record = read_target_record(workdir) or {}
    embed = None
    if FLAGS.embed_from:
        from confu_jax.weights import load_model

        cfg, params = load_model(FLAGS.embed_from)
        check_head_target(head, workdir, cfg, params, FLAGS.embed_from)
        embed = np.asarray(params["embed"]["embedding"])
    out = export_head(FLAGS.out, FLAGS.format, spec, draft, head.draft_vocab["d2t"], head.draft_vocab["t2d"],
                      dtype=FLAGS.dtype, verifier=FLAGS.verifier or record.get("source"), embed=embed)
    with open(os.path.join(out, "config.json")) as f:
        n_keys = len(json.load(f))
    print(f"exported {workdir} (step {head.step}, {spec.head.variant} part) to {out} in the {FLAGS.format} format "
          f"({n_keys} config keys, taps {list(spec.taps)}, draft vocab {spec.head.draft_vocab_size})")


def _run_target(workdir: str):
    """(config, spec, target params) of another family's run: its target loaded from the run's config as
    training loaded it (the export checks the fingerprint in target.json)."""
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import read_config
    from confu_jax.train.target_loading import load_target

    if FLAGS.embed_from or FLAGS.verifier:
        raise app.UsageError("--embed_from / --verifier are for --format speculators")
    if FLAGS.mtp_shared and FLAGS.format != "mtp":
        raise app.UsageError("--mtp_shared is for --format mtp")
    config = read_config(workdir)
    spec, target_params = load_target(config, model_spec_from_config(config))
    return config, spec, target_params


def export_medusa(workdir: str) -> None:
    """A Medusa run (configs/*_medusa.py) in FasterDecoding's format."""
    from confu_jax.runs.medusa import export_medusa_run

    config, spec, target_params = _run_target(workdir)
    run = export_medusa_run(workdir, FLAGS.out, spec.target, target_params, step=FLAGS.step,
                            dtype=FLAGS.dtype or "float32", target_source=str(config.model.source))
    print(f"exported {workdir} (step {run.step}, Medusa heads) to {FLAGS.out} in the FasterDecoding format "
          f"(medusa_lm_head.safetensors + config.json, {FLAGS.dtype or 'float32'})")


def export_mlp_speculator(workdir: str) -> None:
    """An MLP speculator run (configs/*_mlp_speculator.py) in the published fms-extras / vLLM format."""
    from confu_jax.runs.mlp_speculator import export_mlp_speculator_run

    config, spec, target_params = _run_target(workdir)
    run = export_mlp_speculator_run(workdir, FLAGS.out, spec.target, target_params, step=FLAGS.step,
                                    dtype=FLAGS.dtype or "float32", target_source=str(config.model.source))
    c = run.config
    print(f"exported {workdir} (step {run.step}, MLP speculator: {c.n_predict} stages, inner_dim {c.inner_dim}"
          f"{', tied' if c.tie_weights else ''}{', scale_input' if c.scale_input else ''}) to {FLAGS.out} in the "
          f"mlp_speculator format (model.safetensors + config.json, {FLAGS.dtype or 'float32'})")


def export_mtp(workdir: str) -> None:
    """An MTP run (configs/*_mtp.py) in DeepSeek-V3's MTP layout."""
    from confu_jax.runs.mtp import export_mtp_run

    config, spec, target_params = _run_target(workdir)
    run = export_mtp_run(workdir, FLAGS.out, spec.target, target_params, step=FLAGS.step,
                         dtype=FLAGS.dtype or "float32", include_shared=FLAGS.mtp_shared,
                         target_source=str(config.model.source))
    print(f"exported {workdir} (step {run.step}, MTP module: layer model.layers.{spec.target.n_layers}"
          f"{', with the shared embedding / LM head' if FLAGS.mtp_shared else ''}) to {FLAGS.out} in the mtp format "
          f"(DeepSeek-V3 names; model.safetensors + config.json, {FLAGS.dtype or 'float32'})")


def export_dflash(workdir: str) -> None:
    """A DFlash run (configs/*_dflash.py) in z-lab's published DFlash layout."""
    from confu_jax.runs.dflash import export_dflash_run

    config, spec, target_params = _run_target(workdir)
    run = export_dflash_run(workdir, FLAGS.out, spec.target, target_params, step=FLAGS.step,
                            dtype=FLAGS.dtype or "float32", target_source=str(config.model.source))
    print(f"exported {workdir} (step {run.step}, DFlash: {run.draft.n_layers} layers over target layers "
          f"{[t - 1 for t in run.taps]}, block {run.block_size}, mask {run.mask_token_id}) to {FLAGS.out} in the "
          f"dflash format (DFlashDraftModel; model.safetensors + config.json, {FLAGS.dtype or 'float32'})")


if __name__ == "__main__":
    from confu_jax.user_errors import cli_main

    app.run(cli_main("launch.export_head", main))
