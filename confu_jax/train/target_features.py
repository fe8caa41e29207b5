"""Computing and using offline target features (the store format: ``confu_jax.data.target_features``).

``compute_features`` is the target's part of the EAGLE-3 objective — the real-token pass's taps and
the teacher statistics, exactly as ``confu_loss`` computes them online — reduced to what is stored
(top-k of the teacher). ``write_store`` runs it over the training conversations of a config
(``launch.target_features``), resumably. ``offline_data`` is the training side: batches from a
store for ``config.data.target_features``, with the draft vocabulary the teacher was made with.

Why EAGLE-3 only: ConFu's contemplate queries attend the target's per-layer K/V, which would cost
2·L·Hkv·hd·2 bytes per token in bf16 (SmolLM2-135M: 23 040 B, 6.2x the stored taps; Llama-3.1-8B:
131 072 B, 5.3x) and still leave the contemplate pass itself (K_train queries through every target
layer, with trainable soft prompts and MoE_con) to run each step; see docs/DESIGN.md §4
"Offline target features" for the store-vs-recompute arithmetic.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.data import target_features as tf
from confu_jax.models.spec import ModelSpec
from confu_jax.models.target import real_forward
from confu_jax.train.teacher import teacher_stats

log = logging.getLogger(__name__)


def compute_features(spec: ModelSpec, target_params: dict, draft_vocab: dict, tokens_bn: jax.Array,
                     top_k: int, vocab_chunk: int, positions_bn: Optional[jax.Array] = None,
                     segment_ids_bn: Optional[jax.Array] = None) -> dict:
    """[B,N,...] arrays of :data:`confu_jax.data.target_features.ROW_KEYS` (but tokens / loss mask)
    for right-padded rows, or packed ones (``segment_ids_bn`` / ``positions_bn``: each
    conversation attends only itself, positions from 0), from the same target pass and teacher code
    the online loss runs."""
    if not 1 <= top_k <= spec.head.draft_vocab_size:
        raise ValueError(f"top_k must be in [1, draft_vocab_size={spec.head.draft_vocab_size}], got {top_k}")
    out = real_forward(spec, target_params, tokens_bn, positions_bn, return_logits=False,
                       segment_ids_bt=segment_ids_bn)
    st = teacher_stats(spec, target_params, draft_vocab, out.hidden_btd, vocab_chunk)
    logp_bnv = st.logits_bnv - st.lse_draft_bn[..., None]
    top_lp, top_ids = jax.lax.top_k(logp_bnv, top_k)
    return {"h_cat": out.taps_btc, "teacher_topk_logp": top_lp, "teacher_topk_ids": top_ids.astype(jnp.int32),
            "teacher_argmax": st.argmax_bn, "teacher_lse_draft": st.lse_draft_bn,
            "teacher_lse_full": st.lse_full_bn}


def write_rows(writer: tf.FeatureWriter, spec: ModelSpec, target_params, vocab, rows: Iterable[dict], *,
               batch_size: int, vocab_chunk: int, log_every: int = 0, pack: bool = False) -> int:
    """Append ``rows`` (padded dicts with 'tokens', 'loss_mask', 'attention_mask', in a fixed order)
    to ``writer``, skipping the ``writer.rows_done`` already stored (resume). Returns rows written.

    ``pack``: run the target on rows of [batch_size, max_length] that each hold several
    conversations (segment ids and restarting positions, as training packs them), so padding is not
    computed; each conversation's features are the same as computed alone (to float rounding). The
    next conversations in order are placed first fit until one fits nowhere, so a forward always
    completes a prefix of what is pending and the store stays in row order."""
    s = writer.settings
    n_len = s.max_length
    dv = {"d2t": jnp.asarray(vocab.d2t, jnp.int32), "t2d": jnp.asarray(vocab.t2d)}
    fn = jax.jit(lambda p, t, pos, seg: compute_features(spec, p, dv, t, s.top_k, vocab_chunk, pos, seg))
    skip, written, pending = writer.rows_done, 0, []

    def add(r, feats, b, lo, n):
        nonlocal written
        writer.add({"tokens": r["tokens"][:n], "loss_mask": r["loss_mask"][:n],
                    **{k: v[b, lo:lo + n] for k, v in feats.items()}})
        written += 1
        if log_every and written % log_every == 0:
            log.info("target features: %d rows written (%d resumed)", written, skip)

    def flush(batch_rows) -> int:  # writes a prefix of batch_rows; returns its length
        lengths = [int(np.asarray(r["attention_mask"]).sum()) for r in batch_rows]
        if not pack:
            tokens = np.stack([r["tokens"] for r in batch_rows])
            if len(batch_rows) < batch_size:  # one static shape: pad the last batch with copies
                tokens = np.concatenate([tokens, np.repeat(tokens[:1], batch_size - len(batch_rows), 0)])
            feats = jax.device_get(fn(target_params, jnp.asarray(tokens), None, None))
            for i, r in enumerate(batch_rows):
                add(r, feats, i, 0, lengths[i])
            return len(batch_rows)
        fill, placed = [0] * batch_size, []
        for n in lengths:
            b = next((j for j in range(batch_size) if fill[j] + n <= n_len), None)
            if b is None:
                break
            placed.append((b, fill[b]))
            fill[b] += n
        tokens, pos, seg = (np.zeros((batch_size, n_len), np.int32) for _ in range(3))
        seen = [0] * batch_size
        for (b, lo), n, r in zip(placed, lengths, batch_rows):
            seen[b] += 1
            tokens[b, lo:lo + n], pos[b, lo:lo + n], seg[b, lo:lo + n] = r["tokens"][:n], np.arange(n), seen[b]
        feats = jax.device_get(fn(target_params, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
        for (b, lo), n, r in zip(placed, lengths, batch_rows):
            add(r, feats, b, lo, n)
        return len(placed)

    # packed: gather conversations until they could fill the batch's rows, then write what fits
    enough = (lambda p: sum(int(np.asarray(r["attention_mask"]).sum()) for r in p) >= batch_size * n_len) \
        if pack else (lambda p: len(p) == batch_size)
    for i, r in enumerate(rows):
        if i < skip:
            continue
        if r["tokens"].shape[0] != n_len:
            raise ValueError(f"row {i}: {r['tokens'].shape[0]} tokens, the store's rows are {n_len}")
        pending.append(r)
        if enough(pending):
            pending = pending[flush(pending):]
    while pending:
        pending = pending[flush(pending):]
    writer.flush()
    return written


def _conversation_rows(config, tokenizer, conversations) -> Iterator[dict]:
    from confu_jax.data import pipeline

    d = config.data
    for c in conversations:
        r = pipeline.encode_example(c["messages"], tokenizer, int(d.max_length), int(d.min_loss_tokens))
        if r is not None:
            yield r


def write_store(config, out_dir: str, *, top_k: int, dtype: str, batch_size: int, rows_per_shard: int,
                log_every: int = 100, pack: bool = False) -> tf.FeatureWriter:
    """Features of every usable conversation of ``config.data.train_files``, in file order, with the
    draft vocabulary a training run of ``config`` would count (training conversations only)."""
    from confu_jax.data import formats, pipeline
    from confu_jax.data.draft_vocab import draft_vocab_for_training
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.train.real_data import training_tokenizer
    from confu_jax.train.target_loading import load_target
    from confu_jax.train.task import resolve_run_config

    config = resolve_run_config(config)  # a config without a preset is sized by its checkpoint; the batch by the devices
    spec, target_host = load_target(config, model_spec_from_config(config))
    if config.model.source == "random":
        raise ValueError("target features need conversations and a tokenizer: config.model.source='random' "
                         "trains on self-distilled data instead")
    data = config.data
    tokenizer = training_tokenizer(config)  # with data.chat_template_kwargs, as training renders its rows
    conversations, report = formats.load_conversations(
        pipeline.train_files(data), on_bad_record=data.on_bad_record, max_records=data.max_records or None)
    log.info("target features over: %s", report.summary())
    n_eval = min(int(config.objective.eval_records), len(conversations) // 2)
    vocab = draft_vocab_for_training(data, tokenizer, spec.target.vocab_size,
                                     conversations=conversations[:len(conversations) - n_eval])
    settings = tf.StoreSettings(target_fingerprint=target_fingerprint(target_host), source=str(config.model.source),
                                max_length=int(data.max_length), top_k=int(top_k), dtype=dtype,
                                d_model=spec.target.d_model, taps=tuple(int(t) for t in spec.taps),
                                draft_vocab_size=spec.head.draft_vocab_size, vocab_size=spec.target.vocab_size)
    writer = tf.FeatureWriter(out_dir, settings, vocab, rows_per_shard)
    write_rows(writer, spec, jax.device_put(target_host), vocab, _conversation_rows(config, tokenizer, conversations),
               batch_size=batch_size, vocab_chunk=int(config.objective.vocab_chunk), log_every=log_every, pack=pack)
    return writer


def check_store(store: tf.FeatureStore, config, spec: ModelSpec, fingerprint: str) -> None:
    """A store is used only for the run it was written for (target, row length, taps, vocab sizes)."""
    s = store.settings
    want = {"target_fingerprint": fingerprint, "max_length": int(config.data.max_length),
            "taps": tuple(int(t) for t in spec.taps), "draft_vocab_size": spec.head.draft_vocab_size,
            "vocab_size": spec.target.vocab_size, "d_model": spec.target.d_model}
    bad = {k: (getattr(s, k), v) for k, v in want.items() if getattr(s, k) != v}
    if bad:
        raise ValueError(f"config.data.target_features={store.directory}: written for another run "
                         f"(stored, this run): {bad}")


def offline_data(config, spec: ModelSpec, fingerprint: str):
    """(draft vocab, train_iterator, eval_batches, rows per epoch) from ``config.data.target_features``.

    The last ``objective.eval_records`` rows (at most half) are held out for evaluation; training
    reads the first ``data.train_rows`` of the rest (0 = all of them), reshuffled every epoch. A
    subset repeated over epochs against the whole store read once, at equal steps, measures what
    reusing data costs (docs/RESULTS.md "Multi-epoch training")."""
    from confu_jax.train.real_data import process_rows

    store = tf.FeatureStore(config.data.target_features)
    check_store(store, config, spec, fingerprint)
    n_eval = min(int(config.objective.eval_records), len(store) // 2)
    n_stored = len(store) - n_eval
    n_train = int(config.data.get("train_rows", 0) or 0) or n_stored
    if n_train > n_stored:
        raise ValueError(f"config.data.train_rows={n_train}: the store {store.directory} holds {n_stored} "
                         f"training rows ({len(store)} rows, the last {n_eval} held out)")
    pack = bool(config.data.get("pack", False))
    g = int(config.data.global_batch_size)
    if n_train < g:
        raise ValueError(f"config.data.target_features={store.directory}: {n_train} training rows < "
                         f"data.global_batch_size={g}")

    def train_iterator(pidx, pcount):
        ds = tf.feature_dataset(store, per_host_batch_size=g // pcount, process_index=pidx, process_count=pcount,
                                seed=int(config.train.seed), shuffle=bool(config.data.shuffle),
                                rows=range(0, n_train), pack=pack, pack_bins=int(config.data.get("pack_bins", 0)),
                                pack_length=int(config.data.get("pack_length", 0)))
        return iter(ds)

    def eval_batches(pidx, pcount):
        rows = [store[i] for i in range(n_stored, len(store))]
        out = []
        for i in range(min(int(config.objective.eval_batches), len(rows) // g)):
            out.append(process_rows({k: np.stack([r[k] for r in rows[i * g:(i + 1) * g]]) for k in rows[0]},
                                    pidx, pcount))
        return out

    # packed rows hold a varying number of conversations: no fixed rows per epoch to log
    return store.draft_vocab(), train_iterator, eval_batches, None if pack else n_train
