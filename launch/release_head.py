"""Release a trained EAGLE-3 or ConFu head into the repo: ``python -m launch.release_head``.

    python -m launch.release_head --workdir ~/.cache/confu_jax/heads/e3 --release releases/heads/smollm2_eagle3 \
        --data releases/data/sharegpt_smollm2 --tau heldout_decode_chain3=1.62,mtbench_chain3=1.28

Exports the head in bf16 into the release folder — EAGLE-3 in the official layout
(``launch.export_head``'s path), ConFu, which has no published layout, as its whole trainable tree
(``confu_jax.runs.trainable_export``) — and writes its manifest (``confu_jax.runs.head_release``: file hashes, the data release's manifest hash
and totals, steps, tokens seen, the target fingerprint, τ). An existing release is replaced only if
some τ metric both report improves by >= 0.05 (``--force`` overrides). Decoding loads the folder
wherever a head is accepted (``--heads eagle3=releases/heads/smollm2_eagle3``,
``--heads confu=releases/heads/smollm2_confu``) after checking the hashes and the target. The workdir,
the data releases and the release folder may be ``gs://`` URLs (the release is written locally and
uploaded, its manifest last).

A head another trainer wrote (the trainer-parity reference, docs/training.md) is released the same way:

    python -m launch.release_head --head runs/parity/reference/checkpoints/0 --target asset:smollm2-135m-instruct \
        --training runs/parity/reference_training.json --release releases/heads/smollm2_eagle3_speculators \
        --data releases/data/sharegpt_smollm2

bound to ``--target`` first (a head for another target is refused), exported in speculators' layout (it keeps
the head's norm placement), its ``training`` the JSON given (trainer, version, patches, settings).

The weights are stored xz-packed (``model.safetensors.xz``, manifest format 2: releases/README.md); every reader
of a release unpacks them into a cache. ``--repack`` stores an older (format 1) release that way, its content
checked unchanged; ``--unpack`` prints a folder of the plain files for an engine that reads the folder (vLLM):

    python -m launch.release_head --release releases/heads/smollm2_eagle3 --repack
    python -m launch.release_head --release releases/heads/smollm2_eagle3 --unpack   # -> the folder vLLM serves
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from confu_jax import storage
from confu_jax.runs.lineage import lineage

flags.DEFINE_string("workdir", None, "the launch.train workdir of an EAGLE-3 or ConFu head")
flags.DEFINE_string("head", None, "instead of --workdir: an EAGLE-3 head another trainer wrote (any layout "
                    "weights.eagle3_formats reads: speculators', the official); needs --target and --training")
flags.DEFINE_string("target", None, "--head: the target it was trained for (an asset, GGUF or HF directory): its "
                    "weights' fingerprint goes into the manifest and the head is bound to it before export")
flags.DEFINE_string("training", None, "a JSON file of what trained the head, put in the manifest's 'training' "
                    "(--head: required, with at least trainer, version, step, tokens_seen; --workdir: merged into "
                    "the run's record)")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_string("release", None, "release folder, e.g. releases/heads/smollm2_eagle3", required=True)
flags.DEFINE_string("data", "", "the data release(s) the head was trained on, comma-separated (each manifest is "
                    "hashed into ours; several: a list)")
flags.DEFINE_list("tau", [], "measured tau as METRIC=VALUE pairs (e.g. heldout_decode_chain3=1.62)")
flags.DEFINE_bool("force", False, "replace an existing release even without a tau gain of >= 0.05")
flags.DEFINE_bool("unpack", False, "print a folder holding the --release's files unpacked, as an engine reads "
                  "them (vLLM: --speculative-config model=<it>), after checking its hashes; nothing is written")
flags.DEFINE_bool("repack", False, "store the existing (format 1) --release with its weights xz-packed (format 2); "
                  "nothing else is read or written")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    import json

    from confu_jax.data.releases import git_commit
    from confu_jax.runs.head_release import (better_than_released, pack_release_files, repack_release,
                                             write_head_manifest)
    from confu_jax.runs.heads import export_trainable, load_trained_head, read_target_record
    from confu_jax.weights.eagle3_formats import eagle3_part, export_head

    if FLAGS.unpack:
        from confu_jax.runs.head_release import unpacked_release

        print(unpacked_release(FLAGS.release))
        return 0
    if FLAGS.repack:
        if storage.is_remote(FLAGS.release):
            raise app.UsageError("--repack works on a local release folder")
        m = repack_release(FLAGS.release)
        print(f"{FLAGS.release}: format {m['format_version']}, files "
              + ", ".join(f"{e['file']} ({e['bytes']} bytes)" for e in m["files"]))
        return 0
    tau = {}
    for pair in FLAGS.tau:
        k, eq, v = pair.partition("=")
        if not eq:
            raise app.UsageError(f"--tau: {pair!r} is not METRIC=VALUE")
        tau[k] = float(v)
    if bool(FLAGS.workdir) == bool(FLAGS.head):
        raise app.UsageError("give exactly one of --workdir (a launch.train run) and --head (another trainer's head)")
    ok, why = better_than_released(FLAGS.release, tau)
    if not ok and not FLAGS.force:
        print(f"not released: {why}", file=sys.stderr)
        return 1
    data = _data_records(FLAGS.data)
    if FLAGS.head:
        return _release_external(tau, data, why)
    workdir = storage.absolute(os.path.expanduser(FLAGS.workdir))
    head = load_trained_head(workdir, FLAGS.step)
    spec = head.spec
    record = read_target_record(workdir) or {}
    # written in a local staging folder, then put in place: the manifest last, files of the old
    # release that the new one lacks removed (storage.staged_dir; the same on gs://)
    with storage.staged_dir(FLAGS.release, replace=True) as tmp:
        if head.spec.head.has_future:  # ConFu: no published layout; its whole trainable tree
            export_trainable(workdir, tmp, step=head.step, dtype="bfloat16")
        else:
            spec, draft = eagle3_part(head.spec, head.trainable)
            export_head(tmp, "eagle3", spec, draft, head.draft_vocab["d2t"], head.draft_vocab["t2d"],
                        dtype="bfloat16", verifier=record.get("source"))
        run_config = json.loads(storage.read_text(os.path.join(workdir, "config.json")))
        chain = lineage(workdir, head.step)
        total = sum(c["tokens_seen"] or 0 for c in chain)
        training = {"workdir": workdir, "step": head.step, "tokens_seen": total or None,
                    "draft_vocab_size": spec.head.draft_vocab_size, "ttt_steps": run_config.get("draft", {}).get("ttt_steps")}
        if FLAGS.training:  # e.g. the trainer-parity settings
            training.update(json.loads(storage.read_text(FLAGS.training)))
        if len(chain) > 1:
            training["lineage"] = chain
        pack_release_files(tmp)
        write_head_manifest(tmp, name=os.path.basename(FLAGS.release.rstrip("/")),
                            files=sorted(f for f in storage.listdir(tmp) if f != "manifest.json"), data=data,
                            training=training, target={"source": record.get("source"),
                                                       "fingerprint": record.get("fingerprint")},
                            tau=tau, command=" ".join(sys.argv), commit=git_commit())
    sizes = {f: storage.getsize(os.path.join(FLAGS.release, f)) for f in storage.listdir(FLAGS.release)}
    print(f"released {workdir} step {head.step} to {FLAGS.release} ({why}): {sizes}")
    return 0


def _data_records(text: str):
    """The manifest's 'data': each data release the head read, its manifest hashed (one: that record alone)."""
    import hashlib
    import json

    data = []
    for rel in [d for d in text.split(",") if d]:
        with storage.open(os.path.join(rel, "manifest.json"), "rb") as f:
            raw = f.read()
        m = json.loads(raw)
        data.append({"release": rel, "manifest_sha256": hashlib.sha256(raw).hexdigest(),
                     "conversations": m.get("conversations"), "answer_tokens": m.get("answer_tokens")})
    return data[0] if len(data) == 1 else (data or None)


def _release_external(tau: dict, data, why: str) -> int:
    """A head another trainer wrote (the trainer-parity reference): bound to ``--target`` (which refuses a
    head for another target), exported in bf16 in speculators' layout without the target's embedding (the
    layout that keeps its norm placement; vLLM and our loop read it), manifest as for our heads with
    ``--training`` as its 'training'."""
    import json

    from confu_jax.assets import strip_asset
    from confu_jax.data.releases import git_commit
    from confu_jax.runs.head_release import pack_release_files, write_head_manifest
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.weights import load_model
    from confu_jax.weights.eagle3_formats import bind_to_target, export_head, load_head

    if not (FLAGS.target and FLAGS.training):
        raise app.UsageError("--head needs --target (what it drafts for) and --training (what trained it)")
    training = json.loads(storage.read_text(FLAGS.training))
    missing = [k for k in ("trainer", "version", "step", "tokens_seen") if k not in training]
    if missing:
        raise app.UsageError(f"--training {FLAGS.training}: expected keys trainer, version, step, tokens_seen; "
                             f"missing {missing}")
    cfg, params = load_model(strip_asset(FLAGS.target))
    spec, trainable, vocab = bind_to_target(load_head(FLAGS.head), cfg, params)
    with storage.staged_dir(FLAGS.release, replace=True) as tmp:
        export_head(tmp, "speculators", spec, trainable["draft"], vocab["d2t"], vocab["t2d"], dtype="bfloat16",
                    verifier=FLAGS.target)
        pack_release_files(tmp)
        write_head_manifest(tmp, name=os.path.basename(FLAGS.release.rstrip("/")),
                            files=sorted(f for f in storage.listdir(tmp) if f != "manifest.json"), data=data,
                            training=dict(training, head=FLAGS.head, draft_vocab_size=spec.head.draft_vocab_size),
                            target={"source": FLAGS.target, "fingerprint": target_fingerprint(params)},
                            tau=tau, command=" ".join(sys.argv), commit=git_commit())
    sizes = {f: storage.getsize(os.path.join(FLAGS.release, f)) for f in storage.listdir(FLAGS.release)}
    print(f"released {FLAGS.head} ({training['trainer']} {training['version']}) to {FLAGS.release} ({why}): {sizes}")
    return 0


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.release_head", main)
