"""Pack self-distilled conversations into a data release in the repo (``confu_jax.data.releases``).

    python -m launch.release_data --input ~/.cache/confu_jax/data/sharegpt_selfdistill.jsonl \
        --release releases/data/<name> [--part_mb 10] [--generation_command "python -m launch.generate_data ..."]

Appends the input's conversations that the release does not hold yet as new parts (each at most
``--part_mb`` MB of zstandard-compressed JSON lines) and then replaces ``manifest.json`` atomically;
existing parts are verified against their hashes and never rewritten, an id already released is
never added again. Inputs and the release may be ``gs://`` URLs (docs/scale.md "Cloud Storage
paths"): each object is uploaded whole, the manifest last, and an object store's release is appended
unlocked. Rerun it as often as the input grows: each run adds only what is new. The input is only
read (a ``launch.generate_data`` run may still be appending to it: its torn last line is ignored),
in file order; several inputs (``--input a.jsonl,b.jsonl``, e.g. shard outputs) are packed in the
order given.

The manifest records how the data was made: the generating command comes from the input's
``<input>.runs.jsonl`` (written by ``launch.generate_data`` at every start; its runs must agree on
the settings that shape the text) or from ``--generation_command`` (outputs of runs from before that
file existed); temperature, top-p, max_new_tokens, max_prompt_len and max_turns are parsed from it.
The target's weights fingerprint (``runs.heads.target_fingerprint``, the one training records in
``target.json``) is computed by loading the target (a few seconds for SmolLM2); answer tokens are
counted with the target's chat tokenizer (assistant-mask tokens, what training's loss sees). Data
made with other settings or another target is refused: that is another release.

Prints one JSON line: what was added, the new parts and the release's totals.
"""

from __future__ import annotations

import json
import logging

from absl import app, flags

from confu_jax import storage
from confu_jax.decode import self_distill
from launch import generate_data as gd

log = logging.getLogger("release_data")

flags.DEFINE_list("input", None, "generate_data JSONL output(s), packed in this order", required=True)
flags.DEFINE_string("release", None, "release folder (releases/data/<name>); created on the first run", required=True)
flags.DEFINE_string("name", "", "release name in a new manifest (default: the folder's name)")
flags.DEFINE_float("part_mb", 10.0, "largest compressed part, in MB (10^6 bytes)")
flags.DEFINE_integer("level", 19, "zstandard compression level")
flags.DEFINE_string("generation_command", "", "the launch.generate_data command that wrote the input "
                    "(default: read from <input>.runs.jsonl)")
flags.DEFINE_bool("fingerprint", True, "record the target's weights fingerprint (loads the target)")
FLAGS = flags.FLAGS


def generation_settings(inputs, command: str = "") -> dict:
    """The generation settings for the manifest: parsed from ``command`` when given, else those every
    run recorded beside the inputs (``<input>.runs.jsonl``), which must agree on the recipe."""
    if command:
        return gd.parse_generation_command(command)
    try:
        return self_distill.recorded_settings(inputs, legacy_parse=gd.parse_generation_command)
    except ValueError as e:
        raise app.UsageError(f"{e} (--generation_command)") from None


def answer_token_counter(tokenizer):
    """``count(record)``: the assistant-mask tokens of a generated record under ``tokenizer``'s chat
    template (each assistant turn's text and its end-of-turn token)."""
    from confu_jax.data.formats import normalize_record

    def count(record: dict) -> int:
        conv, reason, detail, _ = normalize_record(record, str(record.get("id")))
        if conv is None:
            raise ValueError(f"record {record.get('id')!r}: {reason}: {detail}")
        _, mask = tokenizer.encode_chat(conv["messages"])
        return int(sum(mask))

    return count


def read_inputs(inputs) -> list[dict]:
    """Every complete record of the inputs, checked to be usable conversations (a torn last line,
    e.g. of a run still writing, is ignored)."""
    from confu_jax.data.formats import normalize_record

    records = []
    for path in inputs:
        if not storage.isfile(path):
            raise app.UsageError(f"--input {path} does not exist")
        recs = self_distill.read_records(path)
        for lineno, rec in enumerate(recs, start=1):
            conv, reason, detail, _ = normalize_record(rec, f"{path}:{lineno}")
            if conv is None:
                raise ValueError(f"{path}:{lineno}: not a usable conversation ({reason}: {detail})")
        log.info("%s: %d conversations", path, len(recs))
        records += recs
    return records


def main(argv):
    del argv
    from confu_jax.data import releases
    from confu_jax.data.chat import ChatTokenizer

    settings = generation_settings(FLAGS.input, FLAGS.generation_command)
    records = read_inputs(FLAGS.input)
    target = {"model": settings["model"], "fingerprint": None}
    if FLAGS.fingerprint:
        from confu_jax.runs.heads import target_fingerprint
        from confu_jax.weights import load_model

        _, params = load_model(settings["model"], settings["dtype"] or None)
        target["fingerprint"] = target_fingerprint(params)
        del params
    # the answer tokens training will see: the template rendered with the kwargs the data was generated with
    tokenizer = ChatTokenizer.load(settings["tokenizer"], template_kwargs=settings.get("chat_template_kwargs"))
    stats = releases.append_release(
        FLAGS.release, records, count_tokens=answer_token_counter(tokenizer), target=target,
        tokenizer=settings["tokenizer"], generation=settings, name=FLAGS.name or None,
        part_bytes=int(FLAGS.part_mb * 1e6), level=FLAGS.level)
    manifest = releases.read_manifest(FLAGS.release)
    totals = {k: manifest[k] for k in ("conversations", "answer_tokens", "bytes", "n_parts")}
    print(json.dumps({"release": FLAGS.release, "input_records": len(records), **stats, "totals": totals}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from confu_jax.user_errors import run

    run("launch.release_data", main)
