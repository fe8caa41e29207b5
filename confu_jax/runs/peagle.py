"""A trained P-EAGLE run (``launch.train`` with ``configs/*_peagle.py``) written in speculators' ``peagle``
layout (``weights.peagle_format``), what vLLM's ``eagle3`` proposer serves with parallel drafting.

Why here: a P-EAGLE run is a head run (``runs.heads``: config, checkpoints, the draft vocabulary, the
target record); its export needs the target's embedding (speculators' loader reads ``embed_tokens.weight``
from the file), so ``launch.export_head`` loads the run's target first (``reads_target``).
"""

from __future__ import annotations

import numpy as np

from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


def _write_peagle(workdir, out, *, step=None, dtype=None, target, target_source, warn=None, verifier=None) -> str:
    from confu_jax.models.spec import ModelSpec
    from confu_jax.models.target import embedding_table
    from confu_jax.runs.heads import check_head_target, load_trained_head, read_target_record
    from confu_jax.weights.peagle_format import export_peagle

    cfg, tp = target
    h = load_trained_head(workdir, step)
    if not h.spec.head.parallel:
        raise ValueError(f"{workdir} holds a {h.spec.head.variant!r} head; --format peagle writes P-EAGLE heads "
                         "(variant 'peagle'): export it as eagle3 / speculators")
    check_head_target(h, workdir, cfg, tp, target_source)
    draft = h.trainable["draft"]
    embed = np.asarray(draft["embed_tokens"] if "embed_tokens" in draft else embedding_table(tp))
    peagle = h.config.get("peagle", None)
    depth = int(peagle.num_depths) if peagle is not None else 8
    dtype = dtype or target_dtype(target_source)
    record = read_target_record(workdir) or {}
    export_peagle(out, ModelSpec(cfg, h.spec.head), draft, h.draft_vocab["d2t"], h.draft_vocab["t2d"], embed=embed,
                  dtype=dtype, verifier=verifier or record.get("source") or target_source, depth=depth)
    return (f"exported {workdir} (step {h.step}, P-EAGLE head, {depth} depths, mask {h.spec.head.mask_token_id}) to "
            f"{out} in speculators' peagle layout ({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="peagle", write=_write_peagle, reads_target=True, options=("verifier",),
                             help="speculators' peagle layout (vLLM's eagle3 with parallel drafting; a P-EAGLE run)")
