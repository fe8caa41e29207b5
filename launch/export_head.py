"""Export a trained head to the formats serving engines load: ``python -m launch.export_head``.

    python -m launch.export_head --workdir runs/smollm2_eagle3 --format eagle3 --out exports/e3_sglang
    python -m launch.export_head --workdir runs/smollm2_eagle3 --format speculators --out exports/e3_vllm \
        --embed_from smollm2-135m-instruct
    python -m launch.export_head --workdir releases/heads/smollm2_eagle3 --format speculators --out exports/e3_vllm
    python -m launch.export_head --workdir path/to/EAGLE3-head --format speculators --out exports/e3_vllm \
        --target_model path/to/Llama-3.1-8B-Instruct
    python -m launch.export_head --workdir runs/smollm2_medusa --format medusa --out exports/medusa --dtype bfloat16
    python -m launch.export_head --workdir runs/smollm2_mlp_speculator --format mlp_speculator --out exports/mlp
    python -m launch.export_head --workdir runs/smollm2_mtp --format mtp --out exports/mtp
    python -m launch.export_head --workdir runs/smollm2_dflash --format dflash --out exports/dflash
    python -m launch.export_head --workdir runs/smollm2_peagle --format peagle --out exports/peagle
    python -m launch.export_head --workdir runs/smollm2_dspark --format dspark --out exports/dspark

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
``AutoModel.from_pretrained(..., trust_remote_code=True)`` with its ``dflash.py``. ``--format peagle`` and
``--format dspark`` write a P-EAGLE / DSpark run in speculators' ``peagle`` / ``dspark`` layouts
(``weights.peagle_format``, ``weights.dspark_format``), which load back here and in speculators.

A ConFu head exports its EAGLE-3 part only (fc, the draft layer, LM head): serving engines have no
contemplate tokens, so its future path (soft prompts, MoE_con, MoE_f) is dropped, with a warning.

``--workdir`` and ``--out`` may be ``gs://`` URLs (docs/scale.md): the export is written in a local
staging folder and then put at ``--out`` with ``config.json`` last (``storage.staged_dir``).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from confu_jax import storage
from confu_jax.decode.families import export_formats
from confu_jax.decode.families import EXPORT_FORMATS

flags.DEFINE_string("workdir", None, "the head to export: a launch.train workdir (config.json + checkpoints/); "
                    "for --format eagle3 / speculators also a release (releases/heads/...) or an EAGLE-3 head in the "
                    "official or speculators layout (converted)", required=True)
flags.DEFINE_integer("step", None, "checkpoint step to export (default: the latest)")
flags.DEFINE_enum("format", "eagle3", list(export_formats()),
                  "; ".join(f"{name}: {EXPORT_FORMATS[name].help}" for name in export_formats()))
flags.DEFINE_string("out", None, "output directory (created; existing config.json / model.safetensors are "
                    "overwritten)", required=True)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "stored float dtype, written in config.json (default: the target checkpoint's own dtype, what a "
                  "serving engine runs the target in and its --dtype auto reads: bf16 for a bf16 target; the "
                  "head's own dtype when the target cannot be read)")
flags.DEFINE_string("verifier", None, "speculators format: the target's Hugging Face id or path, recorded as "
                    "speculators_config.verifier.name_or_path (default: the source in the workdir's target.json)")
flags.DEFINE_string("embed_from", None, "speculators format: also store this target's embedding as "
                    "embed_tokens.weight (asset name, .gguf or HF directory; speculators' own loader needs "
                    "it, vLLM shares the target's when absent). Checked against the head's target fingerprint.")
flags.DEFINE_bool("mtp_shared", False, "mtp format: also store the target's embedding and LM head as the layer's "
                  "embed_tokens / shared_head.head (DeepSeek's checkpoints carry these copies)")
flags.DEFINE_string("target_model", None, "eagle3 / speculators formats from a published-layout head: the target "
                    "it drafts for (asset name, HF directory or .gguf; only its config is read), which fixes the "
                    "default feature layers (default: the release manifest's or the speculators verifier)")
FLAGS = flags.FLAGS


OPTIONS = ("verifier", "embed_from", "mtp_shared", "target_model")  # flags a format may read (ExportFormat.options)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    fmt = EXPORT_FORMATS[FLAGS.format]
    for option in OPTIONS:
        if getattr(FLAGS, option) and option not in fmt.options:
            takers = [name for name, f in EXPORT_FORMATS.items() if option in f.options]
            raise app.UsageError(f"--{option} is for --format {' / '.join(takers)}, not {fmt.name}")
    workdir = storage.absolute(os.path.expanduser(FLAGS.workdir))  # a gs:// run is read where it is
    target, source = None, ""
    if fmt.reads_target:
        config, spec, target_params = _run_target(workdir)
        target, source = (spec.target, target_params), str(config.model.source)
    options = {o: getattr(FLAGS, o) for o in fmt.options}
    # the writers write a local folder; storage.staged_dir puts it at --out (a local folder or gs://)
    # with config.json last, so a reader that finds the config finds the weights it describes
    with storage.staged_dir(FLAGS.out) as out:
        summary = fmt.write(workdir, out, step=FLAGS.step, dtype=FLAGS.dtype, target=target, target_source=source,
                            warn=lambda message: print(f"WARNING: {message}", file=sys.stderr), **options)
    print(summary.replace(out, FLAGS.out))


def _run_target(workdir: str):
    """(config, spec, target params) of a run whose format needs its target: the target loaded from the
    run's config as training loaded it (the export checks the fingerprint in target.json)."""
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import read_config
    from confu_jax.train.target_loading import load_target

    config = read_config(workdir)
    spec, target_params = load_target(config, model_spec_from_config(config))
    return config, spec, target_params


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.export_head", main)
