"""The stages' pieces that run in their own process (``python -m experiments.gpu_campaign step <name>``),
and the ConFu export the steps and ``unpack`` share."""

from __future__ import annotations

import json
import os
import shutil
import time

from experiments.gpu_campaign.bundle import model_digest
from experiments.gpu_campaign.common import MODEL, Scale, write_json


def step_digest(args) -> int:
    write_json(args.out, model_digest(MODEL))
    return 0


def step_release(args) -> int:
    """Pack the generate_data output as a data release; answer tokens counted in parallel."""
    import multiprocessing

    from confu_jax.data import releases
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.weights import load_model
    from confu_jax.decode import self_distill
    from launch import generate_data as gd

    records = self_distill.read_records(args.input)
    if not records:
        raise SystemExit(f"{args.input}: no generated conversation to release")
    try:
        generation = self_distill.recorded_settings([args.input], legacy_parse=gd.parse_generation_command)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    _, params = load_model(generation["model"], generation["dtype"] or None)
    target = {"model": generation["model"], "fingerprint": target_fingerprint(params)}
    del params
    n_proc = max(1, min(16, (os.cpu_count() or 2) - 1))
    held_out = len(records) - max(1, len(records) // 10)  # the last 10%: draft-vocabulary coverage
    indexed = list(enumerate(records))
    chunks = [(indexed[i::n_proc], held_out) for i in range(n_proc)]
    with multiprocessing.get_context("spawn").Pool(n_proc, initializer=_count_init,
                                                    initargs=(generation["tokenizer"],)) as pool:
        counted = pool.map(_count_chunk, chunks)
    counts = {rid: n for part, _, _ in counted for rid, n in part}
    import collections

    freq, held = collections.Counter(), collections.Counter()
    for _, f, h in counted:
        freq.update(f)
        held.update(h)
    ranked = [t for t, _ in freq.most_common()]
    n_held = sum(held.values())
    coverage = {str(k): round(sum(held[t] for t in ranked[:k]) / max(1, n_held), 5) for k in (4096, 8192, 16384, 32768)}
    before = releases.read_manifest(args.release)["answer_tokens"] if releases.is_release(args.release) else 0
    t = time.time()
    stats = releases.append_release(args.release, records, count_tokens=lambda r: counts[str(r["id"])],
                                    target=target, tokenizer=generation["tokenizer"], generation=generation,
                                    name=args.release_name or None, level=int(args.level), commit=args.commit or None)
    manifest = releases.read_manifest(args.release)
    summary = {k: manifest[k] for k in ("name", "conversations", "answer_tokens", "bytes", "n_parts")}
    added_tokens = manifest["answer_tokens"] - before
    summary.update(added=stats["added"], added_answer_tokens=added_tokens,
                   generation_seconds=round(float(args.gen_seconds), 1),
                   answer_tokens_per_s=round(added_tokens / max(1e-9, float(args.gen_seconds)), 1),
                   pack_seconds=round(time.time() - t, 1), generation=generation,
                   draft_vocab_coverage={"held_out_answer_tokens": n_held, "distinct_tokens": len(ranked),
                                         "top_k": coverage})
    write_json(args.summary, summary)
    print(json.dumps(summary))
    return 0


_TOK = None


def _count_init(tokenizer_source: str) -> None:
    global _TOK
    from confu_jax.data.chat import ChatTokenizer

    _TOK = ChatTokenizer.load(tokenizer_source)


def _count_chunk(args) -> tuple:
    """Answer tokens per record (what launch.release_data counts: the assistant mask of the chat
    template) and answer-token frequencies of the records before / from ``held_out``."""
    import collections

    from confu_jax.data.formats import normalize_record

    indexed, held_out = args
    out, freq, held = [], collections.Counter(), collections.Counter()
    for i, r in indexed:
        conv, reason, detail, _ = normalize_record(r, str(r.get("id")))
        if conv is None:
            raise ValueError(f"record {r.get('id')!r}: {reason}: {detail}")
        ids, mask = _TOK.encode_chat(conv["messages"])
        answer = [t for t, m in zip(ids, mask) if m]
        out.append((str(r["id"]), len(answer)))
        (held if i >= held_out else freq).update(answer)
    return out, dict(freq), dict(held)


def export_confu(workdir: str, out: str, dtype: str = "bfloat16") -> dict:
    """A ConFu (or any) head of a launch.train workdir as a trainable-tree export
    (``confu_jax.runs.trainable_export``: every trainable leaf in ``dtype``, the draft vocabulary,
    the run's config and target record)."""
    from confu_jax.runs.heads import export_trainable

    return export_trainable(workdir, out, dtype=dtype)


def load_exported(directory: str):
    """``(config, trainable, draft_vocab, step)`` of an ``export_confu`` directory (float32 leaves)."""
    from confu_jax.runs.trainable_export import load_trainable_export

    head = load_trainable_export(directory)
    return head.config, head.trainable, head.draft_vocab, head.step


def rebuild_workdir(export_dir: str, workdir: str) -> str:
    """A launch.train-style workdir (config.json, target.json, checkpoints/<step> with the params and
    the draft vocabulary) from an ``export_confu`` directory, so ``decode_bench --heads confu=DIR``
    and ``launch.generate --draft_ckpt DIR`` load it here."""
    config, trainable, vocab, step = load_exported(export_dir)
    os.makedirs(workdir, exist_ok=True)
    for f in ("config.json", "target.json"):
        if os.path.isfile(os.path.join(export_dir, f)):
            shutil.copyfile(os.path.join(export_dir, f), os.path.join(workdir, f))
    from confu_jax.runs.checkpoint import save_head_checkpoint

    save_head_checkpoint(workdir, step, trainable, vocab["d2t"], vocab["t2d"])
    return workdir


def rebuild_eagle3_checkpoint(official_dir: str, run_dir: str, step: int) -> str:
    """Give the unpacked EAGLE-3 run folder (config.json, metrics.csv, init_from.json came back; the
    checkpoints stayed on the device) a checkpoint at ``step`` holding the official export's weights
    and draft vocabulary, so the run is a whole launch.train workdir here: ``launch.release_head``
    then releases it with its lineage (metrics.csv's positions plus what its init_from source had
    seen), ``WORKDIR@STEP`` decodes it. The weights are the export's (bf16, widened to the run's
    param dtype): the released head, not the device's float32 copy."""
    import jax
    import numpy as np

    from confu_jax.models.params import trainable_shapes
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import read_config
    from confu_jax.weights.eagle3_formats import load_head

    spec = model_spec_from_config(read_config(run_dir))
    imp = load_head(official_dir)
    want = trainable_shapes(spec)
    got = {"draft": imp.draft, **{k: {} for k, v in want.items() if k != "draft" and not v}}  # EAGLE-3: empty 'confu'
    if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(got):
        raise ValueError(f"{official_dir}: its tensors do not form the head {run_dir}/config.json describes "
                         f"(expected {jax.tree_util.tree_structure(want)}, got {jax.tree_util.tree_structure(got)})")
    params = jax.tree_util.tree_map(lambda w, a: np.asarray(a, w.dtype).reshape(w.shape), want, got)
    from confu_jax.runs.checkpoint import save_head_checkpoint

    save_head_checkpoint(run_dir, step, params, np.asarray(imp.d2t, np.int32), np.asarray(imp.t2d, bool))
    return run_dir


def auto_candidates(scale: Scale) -> str:
    """``launch.decode_bench --auto_candidates``: the plans budget auto measures, per drafter family (each
    costs a compile; families not named keep their defaults). The MTP module drafts at any depth with its
    one module: the head's plans; hybrid drafts chains."""
    from confu_jax.decode.plans import Chain, parse_plan

    head, lookup, cartesian = scale.auto_head_plans, scale.auto_lookup_plans, scale.auto_medusa_plans
    chains = ";".join(p for p in head.split(";") if p and isinstance(parse_plan(p), Chain))
    groups = {"head": head, "hybrid": chains,
              "mtp": head, "lookup": lookup, "medusa": cartesian, "mlp_speculator": cartesian, "dflash": cartesian}
    return ";".join(f"{family}={plans.replace(';', ',')}" for family, plans in groups.items() if plans)


def step_export_confu(args) -> int:
    print(json.dumps(export_confu(args.workdir, args.out)))
    return 0
