"""DSpark training: DFlash's block objective read the DSpark way, with the Markov head and the confidence head
(arXiv 2607.05147; docs/DESIGN.md §11 "DSpark").

The reference is speculators' ``DSparkDraftModel.forward`` (``models/dspark/core.py``) over DFlash's
``_backbone_forward`` (``models/dflash/core.py``) with ``sample_from_anchor``, and its loss
(``models/dspark/metrics.py``, ``losses/utils.py``): with the target frozen,

* ``num_anchors`` anchors a per row, uniformly without replacement among the positions t with x[t] and x[t+1]
  answer tokens (fresh every step from the step's rng); block = [x[a], M, ..., M] (``block_size`` slots) at
  positions a..a+bs-1, seeing the context strictly before a and itself bidirectionally (DFlash's
  ``models.dflash.draft_blocks``);
* slot k predicts x[a+k+1]: its logits are the backbone's through the target's LM head plus the Markov bias from
  the block's **ground-truth** token at its own position (x[a+k]: teacher forcing, speculators' ``prev_token_ids
  = block_tokens``); the teacher is the target's distribution at position a+k;
* L = Σ w_k·KL(p ‖ q) / Σ m_k + α·Σ w_k·BCE(conf_k, 1 − TV(q, p)) / Σ m_k, with m_k = 1 where x[a+k+1] is an
  answer token inside the row, w_k = m_k·exp(−k/γ) (``dflash_loss_decay`` with ``sample_from_anchor``: slot 0 has
  weight 1) — speculators' ``compound_loss`` with its default ``kl_div`` and ``_masked_decayed_mean``; the
  confidence target 1 − TV (the analytical acceptance rate) carries no gradient.

Trained: the backbone, the Markov head, the confidence head; the embedding and the LM head are the target's,
frozen (speculators loads both from the verifier for a full-vocabulary draft). Padded rows only.

Metrics: ``loss``, ``kl``, ``confidence_bce``, ``acc/head{k}`` (slot k's argmax = the target's), ``accept_rate``
(mean 1 − TV), ``acceptance_length`` — 1 + the mean over blocks of Σ_k Π_{i≤k} (1 − TV_i) (speculators'
``accept_len``: what the sampled rule accepts) — and ``greedy_acceptance_length`` (1 + the leading run of right
argmaxes: what a greedy ``chain:bs`` accepts where the text is the target's own greedy output).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models import dspark as D
from confu_jax.models.dflash import block_logits, default_taps, draft_config
from confu_jax.models.spec import model_spec_from_config
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.dflash_task import block_accept_length, padded_block_forward
from confu_jax.train.task import TrainTask, frozen_target_task
from confu_jax.train.target_loading import target_name


def default_dspark_config() -> ml_collections.ConfigDict:
    """``config.dspark`` (speculators' ``from_training_args`` / ``get_trainer_kwargs`` defaults)."""
    c = ml_collections.ConfigDict()
    c.num_layers = 3  # backbone layers (the target's layer shape)
    c.block_size = 16  # bs: slots a block drafts (the anchor's included)
    c.mask_token_id = 0
    c.num_anchors = 512  # blocks a row
    c.loss_decay_gamma = 4.0  # w_k = exp(-k/γ)
    c.markov_rank = 256
    c.markov_head_type = "vanilla"  # vanilla | gated | rnn
    c.enable_confidence_head = True
    c.confidence_head_with_markov = True
    c.confidence_head_alpha = 1.0
    c.init_std = 0.02
    return c


def apply_dspark_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into a DSpark config (the head sections stay, unread)."""
    config.train.task = "dspark"  # train.tasks.TASKS
    config.dspark = default_dspark_config()
    return config


def dspark_spec(config, section: str = "dspark"):
    """The ModelSpec of a DSpark config (or DFlash2's, ``section``): its backbone's layer config as ``draft_model``,
    its taps (``draft.tap_layers``, else DFlash's default layers of the target)."""
    spec = model_spec_from_config(config)
    taps = spec.taps if config.draft.get("tap_layers", None) is not None else default_taps(spec.target.n_layers)
    return dataclasses.replace(spec, head=dataclasses.replace(spec.head, tap_layers=tuple(taps)),
                               draft_model=draft_config(spec.target, int(config[section].num_layers)))


def block_outputs(spec, p: dict, target_params, h: jax.Array, prev: jax.Array):
    """(logits [B,N,bs,V] float32: the target's LM head over the backbone's states ``h`` [B,N,bs,d] plus the
    Markov bias from ``prev`` [B,N,bs] — each slot's token at its own position —, confidences [B,N,bs] or None)."""
    b = h.shape[0]
    vocab = spec.target.vocab_size
    e = D.prev_embedding(p, prev)  # [B,N,bs,r]
    state, biases = None, []
    for slot in range(h.shape[2]):  # the rnn head's state runs along the block
        bias, state = D.markov_bias(p, e[:, :, slot], h[:, :, slot], state)
        biases.append(bias)
    flat = block_logits(spec.target, target_params, h.reshape(b, -1, h.shape[-1]))
    logits = (to_target_vocab(flat, vocab).reshape(h.shape[:3] + (-1,)).astype(jnp.float32)
              + to_target_vocab(jnp.stack(biases, 2), vocab))
    return logits, (D.confidence(p, h, e) if "confidence" in p else None)


def dspark_loss(spec, p, target_params, batch, rng, *, block_size: int, num_anchors: int, mask_token_id: int,
                gamma: float, alpha: float):
    """(loss, metrics) of one batch of padded rows (module docstring)."""
    blk = padded_block_forward("DSpark", spec, D.backbone(p), target_params, batch, rng, block_size=block_size,
                               num_anchors=num_anchors, mask_token_id=mask_token_id, min_block=1)
    tokens, mask, tgt, target_params = blk.tokens_bn, blk.mask_bn, blk.target, blk.target_params
    anchors, block_valid, h = blk.anchors_bn, blk.block_valid_bn, blk.h_bnkd
    b, n = tokens.shape
    k = jnp.arange(block_size)
    idx = anchors[..., None] + k  # slot k sits at a+k and predicts x[a+k+1]
    rows = jnp.arange(b)[:, None, None]
    valid = block_valid[..., None] & (idx + 1 < n) & mask[rows, jnp.minimum(idx + 1, n - 1)]
    prev = tokens[rows, jnp.minimum(idx, n - 1)]  # the block's ground truth at each slot's own position
    vocab = spec.target.vocab_size
    hidden_t = jax.lax.stop_gradient(tgt.hidden_btd)

    @jax.checkpoint  # the [B, N, bs, V] logits are recomputed in the backward pass
    def terms(p, h):
        logits, conf = block_outputs(spec, p, target_params, h, prev)
        logq = jax.nn.log_softmax(logits, -1)
        t_h = hidden_t[jnp.arange(b)[:, None], jnp.minimum(idx, n - 1).reshape(b, -1)]
        logp = jax.nn.log_softmax(to_target_vocab(block_logits(spec.target, target_params, t_h), vocab), -1)
        logp = jax.lax.stop_gradient(logp.reshape(logq.shape))
        kl = jnp.sum(jnp.exp(logp) * (logp - logq), -1)
        accept = jax.lax.stop_gradient(jnp.sum(jnp.minimum(jnp.exp(logq), jnp.exp(logp)), -1))  # 1 - TV
        return kl, accept, conf, jnp.argmax(logq, -1) == jnp.argmax(logp, -1)

    kl, accept, conf, hit = terms(p, h)
    m = valid.astype(jnp.float32)
    w = m * jnp.exp(-k.astype(jnp.float32) / gamma) if gamma > 0 else m
    denom = jnp.maximum(jnp.sum(m), 1e-8)
    kl_loss = jnp.sum(kl * w) / denom
    loss, metrics = kl_loss, {"kl": kl_loss}
    if conf is not None:
        c = jnp.clip(conf, 1e-7, 1 - 1e-7)
        bce = -(accept * jnp.log(c) + (1 - accept) * jnp.log1p(-c))
        metrics["confidence_bce"] = jnp.sum(bce * w) / denom
        metrics["confidence_abs_error"] = jnp.sum(jnp.abs(conf - accept) * m) / denom
        loss = loss + alpha * metrics["confidence_bce"]
    metrics["accept_rate"] = jnp.sum(accept * m) / denom
    for i in range(block_size):
        mi = m[..., i]
        metrics[f"acc/head{i}"] = jnp.sum(hit[..., i] * mi) / jnp.maximum(jnp.sum(mi), 1.0)
    blocks = block_valid & valid[..., 0]
    run = jnp.sum(jnp.cumprod(accept * m, axis=-1), axis=-1)
    metrics["acceptance_length"] = 1.0 + jnp.sum(run * blocks) / jnp.maximum(jnp.sum(blocks), 1.0)
    metrics["greedy_acceptance_length"] = block_accept_length(hit, valid, block_valid)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of a DSpark config (``configs/tiny_dspark.py``, ``configs/smollm2_dspark.py``)."""
    dc = config.dspark
    bs, anchors, gamma = int(dc.block_size), int(dc.num_anchors), float(dc.loss_decay_gamma or 0.0)
    mask_id, kind, rank = int(dc.mask_token_id), str(dc.markov_head_type), int(dc.markov_rank)
    if bs < 1 or anchors < 1 or int(dc.num_layers) < 1 or rank < 1 or kind not in D.HEAD_TYPES:
        raise ValueError(f"config.dspark: need block_size >= 1, num_anchors >= 1, num_layers >= 1, markov_rank >= 1 "
                         f"and markov_head_type in {D.HEAD_TYPES}; got {bs}, {anchors}, {dc.num_layers}, {rank}, "
                         f"{kind!r}")
    pd = jnp.dtype(config.draft.get("param_dtype", "float32"))

    def build(spec, target_host):
        if not 0 <= mask_id < spec.target.vocab_size:
            raise ValueError(f"config.dspark.mask_token_id={mask_id} outside the target's vocabulary "
                             f"({spec.target.vocab_size})")

        def init_params(rng):
            return {"draft": {"dspark": D.init_dspark(
                rng, spec.draft_model, len(spec.taps), spec.target.vocab_size, rank=rank, kind=kind,
                confidence=bool(dc.enable_confidence_head), confidence_with_markov=bool(dc.confidence_head_with_markov),
                init_std=float(dc.init_std), param_dtype=pd)}}

        def loss_fn(trainable, frozen, batch, rng):
            return dspark_loss(spec, trainable["draft"]["dspark"], frozen["target"], batch, rng, block_size=bs,
                               num_anchors=anchors, mask_token_id=mask_id, gamma=gamma,
                               alpha=float(dc.confidence_head_alpha))

        return init_params, loss_fn, (f"DSpark: {dc.num_layers} {target_name(config)!r}-shaped layers over taps "
                                      f"{spec.taps}, blocks of {bs} (mask {mask_id}), {kind} Markov head rank {rank}"
                                      f"{', confidence head' if dc.enable_confidence_head else ''}, {anchors} anchors "
                                      f"a row, decay γ={gamma}")

    return frozen_target_task(config, pack_ok=False, what="DSpark", build=build, spec_fn=dspark_spec)
