"""Store the target's features for offline EAGLE-3 training (docs/DESIGN.md §4 "Offline target features").

    python -m launch.target_features --config configs/smollm2_eagle3.py --out runs/feats --top_k 64
    python -m launch.train --config configs/smollm2_eagle3.py --workdir runs/e3 \\
        --config.data.target_features=runs/feats

Runs the frozen target once over every usable conversation of the config's ``data.train_files``
(file order, chat template, truncation to ``data.max_length``, ``data.min_loss_tokens`` filter: the
rows training would see) and stores, per token, the three feature taps and the teacher over the
draft vocabulary (top-k log-probabilities and ids, both log-sum-exps, the full-vocabulary argmax)
in safetensors shards with a JSON index (format: ``confu_jax.data.target_features``). The draft
vocabulary is counted as a training run of the same config would count it and stored beside the
shards; training with ``--config.data.target_features`` uses that one. Re-running with the same
``--out`` resumes after the last complete shard; other settings are refused. The target runs on
packed rows by default (``--pack``: several conversations a row, each attending only itself), which
skips the padding a row of one conversation would compute.
"""

from __future__ import annotations

import logging as pylog

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config (configs/<target>_eagle3.py): target, data files, row length, draft "
    "vocabulary settings; override fields with --config.X=...", lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Store directory (created; an existing store is resumed).")
_TOP_K = flags.DEFINE_integer("top_k", 64, "Teacher entries kept per token (largest log-probabilities over the "
                              "draft vocabulary); = draft_vocab_size keeps the teacher whole.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                           "Stored dtype of the taps and the top-k log-probabilities.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per target forward.")
_PACK = flags.DEFINE_boolean("pack", True, "Several conversations per row of the target forward (segment ids, "
                             "positions from 0 per conversation), so padding is not computed; --nopack: one "
                             "conversation a row. The stored rows are the same either way (to float rounding).")
_ROWS_PER_SHARD = flags.DEFINE_integer("rows_per_shard", 256, "Rows per safetensors shard (the resume unit).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    if _CONFIG.value is None or not _OUT.value:
        raise app.UsageError("--config and --out are required")
    pylog.getLogger().setLevel(pylog.INFO)
    from confu_jax.data.target_features import bytes_per_token, kv_bytes_per_token
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.target_features import write_store
    from confu_jax.train.task import resolve_run_config

    config = resolve_run_config(_CONFIG.value)  # resolved once: write_store and the size line read the same value
    writer = write_store(config, _OUT.value, top_k=_TOP_K.value, dtype=_DTYPE.value, batch_size=_BATCH.value,
                         rows_per_shard=_ROWS_PER_SHARD.value, pack=_PACK.value)
    s = writer.settings
    per_tok = bytes_per_token(s.d_model, s.top_k, s.draft_vocab_size, s.dtype, len(s.taps))
    t = model_spec_from_config(config).target
    kv = kv_bytes_per_token(t.n_layers, t.n_kv_heads, t.head_dim)
    tokens = sum(sh["tokens"] for sh in writer.shards)
    logging.info("%s: %d rows, %d tokens in %d shards; %d B/token = %.2f GB per million tokens "
                 "(per-layer bf16 K/V would add %d B/token = %.2f GB per million tokens)",
                 _OUT.value, writer.rows_done, tokens, len(writer.shards), per_tok, per_tok / 1e3, kv, kv / 1e3)


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.target_features", main)
