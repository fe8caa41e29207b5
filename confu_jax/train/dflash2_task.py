"""DFlash2 training: DFlash's block objective on the frozen target's distribution plus the candidate selector's
(docs/DESIGN.md §11 "DFlash2").

The reference is speculators 0.9's ``DFlash2DraftModel.forward`` (``models/dflash2/core.py``) over DFlash's
``_backbone_forward`` (``models/dflash/core.py``, ``sample_from_anchor`` false) and its loss
(``models/dflash2/metrics.py``, ``losses/utils.py``): with the target frozen,

* ``num_anchors`` anchors a per row, uniformly without replacement among the positions t with x[t] and x[t+1]
  answer tokens (fresh every step from the step's rng); block = [x[a], M, ..., M] (``block_size`` slots) at
  positions a..a+bs−1, seeing the context strictly before a and itself bidirectionally, with DFlash2's
  convolutions inside the block (``models.dflash.draft_blocks``);
* slot k >= 1 predicts x[a+k]; its **unary** logits u_k are the backbone's through the target's LM head, its
  teacher p_k the target's distribution at a+k−1 (speculators' ``targets`` = the verifier's logits rolled by one);
* the **selector** reranks the unary top-K (``selector_training_candidates``: the teacher's argmax injected at rank
  K−1 where the top-K lacks it) with the block's ground-truth predecessor x[a+k−1] (teacher forcing:
  ``_predecessor_ids``), scores u[c] + ⟨P[x[a+k−1]] ⊙ W h_k, S[c]⟩, and is trained by cross-entropy toward the
  teacher's argmax among the K;
* L = Σ w_k·KL(p_k ‖ q_k) / Σ m_k + α·Σ w_k·CE_K / Σ m_k, with m_k = 1 where x[a+k] is an answer token inside the
  row, w_k = m_k·exp(−(k−1)/γ) for k >= 1 and 0 at the anchor slot (``dflash_loss_decay``); speculators' defaults
  γ = 4, α = 1 (``selector_loss_alpha``), the ``kl_div`` unary loss.

Trained: the backbone (convolutions included), the selector; the embedding and the LM head are the target's,
frozen. Padded rows only (as DSpark).

Metrics: ``loss``, ``kl``, ``selector_ce``, ``acc/head{i}`` (slot i+1's selector choice = the teacher's argmax
under teacher forcing, where the unary top-K held it: what serving can pick), ``recall_at_k`` (the top-K held the
teacher's argmax), ``acceptance_length`` (1 + the leading run of those right choices per block: speculators'
``eal``, what a greedy ``chain:bs-1`` accepts where the text is the target's own greedy output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models import dflash2 as D2
from confu_jax.models.dflash import block_logits
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.dflash_task import block_accept_length, over_anchor_chunks, padded_block_forward
from confu_jax.train.dspark_task import dspark_spec
from confu_jax.train.target_loading import target_name
from confu_jax.train.task import TrainTask, frozen_target_task


def default_dflash2_config() -> ml_collections.ConfigDict:
    """``config.dflash2`` (speculators' ``from_training_args`` / ``get_trainer_kwargs`` defaults)."""
    c = ml_collections.ConfigDict()
    c.num_layers = 3  # backbone layers (the target's layer shape)
    c.block_size = 16  # bs: the root + bs-1 drafted tokens
    c.mask_token_id = 0
    c.num_anchors = 512  # blocks a row
    c.anchor_chunk = 64  # anchors whose [bs, V] loss terms are alive at once (train.dflash_task.over_anchor_chunks)
    c.loss_decay_gamma = 4.0  # w_k = exp(-(k-1)/γ)
    c.conv_kernel_size = 2
    c.conv_group_size = 16
    c.selector_rank = 256
    c.selector_top_k = 16
    c.selector_loss_alpha = 1.0
    c.init_std = 0.02
    return c


def apply_dflash2_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into a DFlash2 config (the head sections stay, unread)."""
    config.train.task = "dflash2"  # train.tasks.TASKS
    config.dflash2 = default_dflash2_config()
    return config


def dflash2_spec(config):
    """The ModelSpec of a DFlash2 config (DSpark's reading of the same fields: backbone layers, taps)."""
    return dspark_spec(config, section="dflash2")


def dflash2_loss(spec, p, target_params, batch, rng, *, block_size: int, num_anchors: int, mask_token_id: int,
                 gamma: float, top_k: int, alpha: float, anchor_chunk: int = 0):
    """(loss, metrics) of one batch of padded rows (module docstring)."""
    blk = padded_block_forward("DFlash2", spec, D2.backbone(p), target_params, batch, rng, block_size=block_size,
                               num_anchors=num_anchors, mask_token_id=mask_token_id)
    tokens, mask, tgt, target_params = blk.tokens_bn, blk.mask_bn, blk.target, blk.target_params
    anchors, block_valid, h = blk.anchors_bn, blk.block_valid_bn, blk.h_bnkd
    b, n = tokens.shape
    k = jnp.arange(block_size)
    idx = anchors[..., None] + k  # slot k sits at a+k and predicts x[a+k]
    rows = jnp.arange(b)[:, None, None]
    safe = jnp.minimum(idx, n - 1)
    valid = block_valid[..., None] & (k > 0) & (idx < n) & mask[rows, safe]
    prev = tokens[rows, jnp.maximum(safe - 1, 0)]  # the ground truth before each slot's own position
    vocab = spec.target.vocab_size
    hidden_t = jax.lax.stop_gradient(tgt.hidden_btd)

    def terms(h, safe, prev):  # one chunk of anchors ([B, c, bs, V] logits, recomputed in the backward pass)
        unary = to_target_vocab(block_logits(spec.target, target_params, h.reshape(b, -1, h.shape[-1])), vocab)
        unary = unary.reshape(h.shape[:3] + (-1,)).astype(jnp.float32)
        logq = jax.nn.log_softmax(unary, -1)
        t_h = hidden_t[jnp.arange(b)[:, None], jnp.maximum(safe - 1, 0).reshape(b, -1)]
        logp = jax.nn.log_softmax(to_target_vocab(block_logits(spec.target, target_params, t_h), vocab), -1)
        logp = jax.lax.stop_gradient(logp.reshape(logq.shape))
        kl = jnp.sum(jnp.exp(logp) * (logp - logq), -1)
        teacher = jnp.argmax(logp, -1)
        cand, _ = D2.top_candidates(jax.lax.stop_gradient(unary), top_k)
        cand, rank, contains = D2.training_candidates(cand, teacher)
        ctx = D2.selector_context(p, D2.project(p, h), prev)
        scores = D2.candidate_scores(p, jnp.take_along_axis(unary, cand, -1), cand, ctx)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(scores, -1), rank[..., None], -1)[..., 0]
        right = (jnp.argmax(scores, -1) == rank) & contains
        return kl, ce, right, contains

    kl, ce, right, contains = over_anchor_chunks(terms, anchor_chunk, h, safe, prev)
    m = valid.astype(jnp.float32)
    w = m * (jnp.exp(-jnp.maximum(k - 1, 0).astype(jnp.float32) / gamma) if gamma > 0 else 1.0)
    denom = jnp.maximum(jnp.sum(m), 1e-8)
    kl_loss, sel_loss = jnp.sum(kl * w) / denom, jnp.sum(ce * w) / denom
    loss = kl_loss + alpha * sel_loss
    metrics = {"kl": kl_loss, "selector_ce": sel_loss, "recall_at_k": jnp.sum(contains * m) / denom}
    for i in range(1, block_size):
        mi = m[..., i]
        metrics[f"acc/head{i - 1}"] = jnp.sum(right[..., i] * mi) / jnp.maximum(jnp.sum(mi), 1.0)
    metrics["acceptance_length"] = block_accept_length(right[..., 1:], valid[..., 1:], block_valid)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of a DFlash2 config (``configs/tiny_dflash2.py``, ``configs/smollm2_dflash2.py``)."""
    dc = config.dflash2
    bs, anchors, gamma = int(dc.block_size), int(dc.num_anchors), float(dc.loss_decay_gamma or 0.0)
    mask_id, top_k = int(dc.mask_token_id), int(dc.selector_top_k)
    shapes = {"kernel_size": int(dc.conv_kernel_size), "group_size": int(dc.conv_group_size),
              "rank": int(dc.selector_rank)}
    if bs < 2 or anchors < 1 or int(dc.num_layers) < 1 or top_k < 1 or min(shapes.values()) < 1:
        raise ValueError(f"config.dflash2: need block_size >= 2, num_anchors, num_layers, selector_top_k, "
                         f"conv_kernel_size, conv_group_size, selector_rank >= 1; got {bs}, {anchors}, "
                         f"{dc.num_layers}, {top_k}, {shapes}")
    pd = jnp.dtype(config.draft.get("param_dtype", "float32"))

    def build(spec, target_host):
        if not 0 <= mask_id < spec.target.vocab_size or top_k > spec.target.vocab_size:
            raise ValueError(f"config.dflash2: mask_token_id={mask_id} and selector_top_k={top_k} must lie within "
                             f"the target's vocabulary ({spec.target.vocab_size})")
        if spec.target.d_model % shapes["group_size"]:
            raise ValueError(f"config.dflash2.conv_group_size={shapes['group_size']} must divide the target's width "
                             f"{spec.target.d_model}")

        def init_params(rng):
            return {"draft": {"dflash2": D2.init_dflash2(rng, spec.draft_model, len(spec.taps), spec.target.vocab_size,
                                                         init_std=float(dc.init_std), param_dtype=pd, **shapes)}}

        def loss_fn(trainable, frozen, batch, rng):
            return dflash2_loss(spec, trainable["draft"]["dflash2"], frozen["target"], batch, rng, block_size=bs,
                                num_anchors=anchors, mask_token_id=mask_id, gamma=gamma, top_k=top_k,
                                alpha=float(dc.selector_loss_alpha), anchor_chunk=int(dc.get("anchor_chunk", 0)))

        return init_params, loss_fn, (f"DFlash2: {dc.num_layers} {target_name(config)!r}-shaped layers over taps "
                                      f"{spec.taps}, convolutions of {shapes['kernel_size']} taps in groups of "
                                      f"{shapes['group_size']}, blocks of {bs} (mask {mask_id}), a selector of rank "
                                      f"{shapes['rank']} over the top {top_k}, {anchors} anchors a row, decay γ={gamma}")

    return frozen_target_task(config, pack_ok=False, what="DFlash2", build=build, spec_fn=dflash2_spec)
