"""Domino training: DFlash's block objective read with ``shift_label``, the GRU's corrected logits blended with the
backbone's (docs/DESIGN.md §11 "Domino").

The reference is SpecForge @a6b6b023 ``OnlineDominoModel.forward`` (``specforge/algorithms/common/
dflash_family_model.py``) with ``DominoTrainStrategy`` (``specforge/training/strategies/base.py``,
``linear_lambda_base``) and ``examples/configs/qwen3-8b-domino-online.yaml``; with the target frozen,

* ``num_anchors`` anchors a per row, uniformly without replacement among the positions t with x[t] and x[t+1]
  answer tokens (fresh every step from the step's rng); block = [x[a], M, ..., M] (``block_size`` slots) at
  positions a..a+bs−1, seeing the context strictly before a and itself bidirectionally
  (``models.dflash.draft_blocks``);
* slot k predicts x[a+k+1] (``shift_label``: labels at offsets 1..bs); its base logits b_k are the target's LM head
  over the backbone, its final logits f_k = b_k + embed_proj([h_k ; s_k]) for k >= ``pure_draft_prefix_len``, s_k the
  GRU's state after the target's embeddings of the block's ground-truth tokens x[a..a+k] (teacher forcing);
* L = (1 − λ)·Σ w_k·CE(f_k, x[a+k+1]) / Σ m_k + λ·Σ w_k·CE(b_k, x[a+k+1]) / Σ m_k with m_k = 1 where x[a+k+1] is
  an answer token inside the row, w_k = m_k·exp(−k/γ); λ decays linearly from ``lambda_base_start`` to 0 over the
  first ``lambda_base_decay_ratio`` of ``train.steps`` (SpecForge's ``linear_lambda_base``, read from the step the
  train step passes in the batch).

Trained: the backbone, the GRU and its projection; the embedding and the LM head are the target's, frozen. Padded
rows only (as DSpark).

Metrics: ``loss``, ``final_loss``, ``base_loss``, ``lambda_base``, ``acc/head{k}`` (slot k's corrected argmax =
x[a+k+1]), ``acceptance_length`` / ``base_acceptance_length`` (1 + the leading run of right argmaxes per block,
corrected / base: SpecForge's ``accept_len`` / ``base_accept_len``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models import domino as M
from confu_jax.models.dflash import block_logits, embed_block
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.dflash_task import block_accept_length, over_anchor_chunks, padded_block_forward
from confu_jax.train.dspark_task import dspark_spec
from confu_jax.train.target_loading import target_name
from confu_jax.train.task import TrainTask, frozen_target_task


def default_domino_config() -> ml_collections.ConfigDict:
    """``config.domino`` (SpecForge's ``configs/qwen3-8b-domino.json`` and ``qwen3-8b-domino-online.yaml``)."""
    c = ml_collections.ConfigDict()
    c.num_layers = 3  # backbone layers (the target's layer shape; the published drafter: 5 over Qwen3-8B's 36)
    c.block_size = 16  # bs: slots a block holds (bs - 1 drafted at decode)
    c.mask_token_id = 0
    c.num_anchors = 256
    c.anchor_chunk = 64  # anchors whose [bs, V] loss terms are alive at once (train.dflash_task.over_anchor_chunks)
    c.loss_decay_gamma = 7.0  # w_k = exp(-k/γ)
    c.gru_hidden_dim = 1024
    c.emb_dim = 256
    c.pure_draft_prefix_len = 1  # slots below keep the backbone's logits
    c.lambda_base_start = 1.0
    c.lambda_base_decay_ratio = 1.0  # λ reaches 0 at this fraction of train.steps
    c.init_std = 0.02
    return c


def apply_domino_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into a Domino config (the head sections stay, unread)."""
    config.train.task = "domino"  # train.tasks.TASKS
    config.domino = default_domino_config()
    return config


def lambda_base(step, total_steps: int, start: float, decay_ratio: float):
    """SpecForge's ``linear_lambda_base``: λ from ``start`` to 0 over the first ``decay_ratio·total_steps`` steps."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    progress = jnp.minimum(jnp.asarray(step, jnp.float32) / decay_steps, 1.0)
    return jnp.clip(start * (1.0 - progress), 0.0, 1.0)


def domino_loss(spec, p, target_params, batch, rng, *, block_size: int, num_anchors: int, mask_token_id: int,
                gamma: float, prefix_len: int, lam, anchor_chunk: int = 0):
    """(loss, metrics) of one batch of padded rows (module docstring); ``lam``: λ this step."""
    blk = padded_block_forward("Domino", spec, M.backbone(p), target_params, batch, rng, block_size=block_size,
                               num_anchors=num_anchors, mask_token_id=mask_token_id)
    tokens, mask, tgt, target_params = blk.tokens_bn, blk.mask_bn, blk.target, blk.target_params
    anchors, block_valid, h = blk.anchors_bn, blk.block_valid_bn, blk.h_bnkd
    b, n = tokens.shape
    k = jnp.arange(block_size)
    idx = anchors[..., None] + k  # slot k sits at a+k and predicts x[a+k+1]
    rows = jnp.arange(b)[:, None, None]
    label_at = jnp.minimum(idx + 1, n - 1)
    valid = block_valid[..., None] & (idx + 1 < n) & mask[rows, label_at]
    labels = tokens[rows, label_at]
    prev = tokens[rows, jnp.minimum(idx, n - 1)]  # the block's ground truth at each slot's own position
    vocab = spec.target.vocab_size

    def terms(h, prev, labels):  # one chunk of anchors ([B, c, bs, V] logits, recomputed in the backward pass)
        base = to_target_vocab(block_logits(spec.target, target_params, h.reshape(b, -1, h.shape[-1])), vocab)
        base = base.reshape(h.shape[:3] + (-1,)).astype(jnp.float32)
        final = M.block_logits(p, base, h, embed_block(target_params, prev), prefix_len)

        def ce(logits):
            return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]

        return ce(final), ce(base), jnp.argmax(final, -1) == labels, jnp.argmax(base, -1) == labels

    final_ce, base_ce, hit, base_hit = over_anchor_chunks(terms, anchor_chunk, h, prev, labels)
    m = valid.astype(jnp.float32)
    w = m * (jnp.exp(-k.astype(jnp.float32) / gamma) if gamma > 0 else 1.0)
    denom = jnp.sum(w) + 1e-6
    final_loss, base_loss = jnp.sum(final_ce * w) / denom, jnp.sum(base_ce * w) / denom
    loss = (1.0 - lam) * final_loss + lam * base_loss
    metrics = {"final_loss": final_loss, "base_loss": base_loss, "lambda_base": jnp.asarray(lam, jnp.float32)}
    for i in range(block_size):
        mi = m[..., i]
        metrics[f"acc/head{i}"] = jnp.sum(hit[..., i] * mi) / jnp.maximum(jnp.sum(mi), 1.0)
    metrics["acceptance_length"] = block_accept_length(hit, valid, block_valid)
    metrics["base_acceptance_length"] = block_accept_length(base_hit, valid, block_valid)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of a Domino config (``configs/tiny_domino.py``, ``configs/smollm2_domino.py``)."""
    dc = config.domino
    bs, anchors, gamma = int(dc.block_size), int(dc.num_anchors), float(dc.loss_decay_gamma or 0.0)
    mask_id, prefix = int(dc.mask_token_id), int(dc.pure_draft_prefix_len)
    hh, emb = int(dc.gru_hidden_dim), int(dc.emb_dim)
    if bs < 2 or anchors < 1 or int(dc.num_layers) < 1 or hh < 1 or emb < 1 or not 0 <= prefix < bs:
        raise ValueError(f"config.domino: need block_size >= 2, num_anchors, num_layers, gru_hidden_dim, emb_dim >= 1 "
                         f"and 0 <= pure_draft_prefix_len < block_size; got {bs}, {anchors}, {dc.num_layers}, {hh}, "
                         f"{emb}, {prefix}")
    total = int(config.train.steps)
    start, ratio = float(dc.lambda_base_start), float(dc.lambda_base_decay_ratio)
    pd = jnp.dtype(config.draft.get("param_dtype", "float32"))

    def build(spec, target_host):
        if not 0 <= mask_id < spec.target.vocab_size:
            raise ValueError(f"config.domino.mask_token_id={mask_id} outside the target's vocabulary "
                             f"({spec.target.vocab_size})")

        def init_params(rng):
            return {"draft": {"domino": M.init_domino(rng, spec.draft_model, len(spec.taps), spec.target.vocab_size,
                                                      gru_hidden_dim=hh, emb_dim=emb, init_std=float(dc.init_std),
                                                      param_dtype=pd)}}

        def loss_fn(trainable, frozen, batch, rng):
            step = batch.get("step", total) if isinstance(batch, dict) else total  # eval: the schedule's end
            return domino_loss(spec, trainable["draft"]["domino"], frozen["target"], batch, rng, block_size=bs,
                               num_anchors=anchors, mask_token_id=mask_id, gamma=gamma, prefix_len=prefix,
                               lam=lambda_base(step, total, start, ratio), anchor_chunk=int(dc.get("anchor_chunk", 0)))

        return init_params, loss_fn, (f"Domino: {dc.num_layers} {target_name(config)!r}-shaped layers over taps "
                                      f"{spec.taps}, a GRU of {hh} and a projection through {emb}, blocks of {bs} "
                                      f"(mask {mask_id}), {anchors} anchors a row, decay γ={gamma}, λ_base "
                                      f"{start} → 0 over {ratio:g} of {total} steps")

    return frozen_target_task(config, pack_ok=False, what="Domino", build=build, spec_fn=domino_spec)


def domino_spec(config):
    """The ModelSpec of a Domino config (DSpark's reading of the same fields: backbone layers, taps)."""
    return dspark_spec(config, section="domino")
