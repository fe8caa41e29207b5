"""DFlash training: the block objective on the frozen target's taps (docs/DESIGN.md §11 "DFlash").

The objective is SpecForge's DFlash recipe (sgl-project/SpecForge
``specforge/algorithms/common/dflash_family_model.py`` ``OnlineDFlashModel``, loss_type ``dflash``, at
commit a6b6b0230009d15ec2a97a57384e6f53f0f96946; z-lab has not published its own trainer), with the
target frozen:

* the target runs once per row (``real_forward``) and gives its taps at every position (the
  context features, ``models.dflash``);
* ``num_anchors`` anchors a per row are drawn uniformly without replacement among the positions t
  with x[t] and x[t+1] answer tokens (``_sample_anchor_positions``: "anchors whose clean token and first
  target are supervised"; packed rows: both in one conversation), fresh every step;
* block i = [x[a_i], M, ..., M] (``block_size`` tokens) at positions a_i..a_i+bs-1 sees the context
  strictly before its anchor (``kv_idx < anchor``, within the anchor's conversation) and its own block
  bidirectionally (``create_dflash_block_mask``); all blocks of a row run in one draft forward;
* block position k = 1..bs-1 predicts x[a_i+k] (``label_indices = anchor + k``; position 0, the clean
  anchor, is not trained), weight w_k = exp(-(k-1)/γ) (``loss_decay_gamma``; none: 1) times the loss
  mask of x[a_i+k] (answer token, inside the row and the anchor's conversation)::

      L = Σ w · CE(lm_head(draft(block)), x[a+k]) / Σ w

``loss_type`` "dpace" (and its two ablations) is SpecForge's **D-PACE** objective (arXiv 2605.18810; the
same file, ``_dpace_weight``; ``examples/configs/qwen3-8b-dpace-online.yaml``): in place of the fixed decay,
each position's CE is weighted by what getting it right is worth to the accepted prefix, from the draft's
own probability of the label q_k (detached), smoothed s_k = (1 - α) q_k + α (``dpace_alpha``; 1 at masked
positions)::

      P_k = Π_{j<=k} s_j                      (cumulative confidence: "dpace-cumulative-confidence-only")
      w_k = Σ_{j>=k} P_j · valid_j            ("dpace": the expected accepted length the position carries)
      w_k = Σ_{j>=k} P_j · valid_j / P_k      ("dpace-continuation-value-only")
      L = Σ valid · w · CE / rows             (SpecForge divides by the batch's rows, not by Σ w)

Trained: the whole draft (fc, hidden_norm, its layers, its final norm); the embedding (of the block
tokens, M included) and the LM head are the target's, frozen. The anchors come from the step's rng,
so an exact resume replays them (the train loop derives it from the step).

Evaluation (held-out batches, fresh anchors from the eval rng): ``loss``, ``ce/head{i}`` / ``acc/head{i}``
for block position i+1 (the families' names), and ``acceptance_length`` = 1 + the mean leading run of
right positions per block (SpecForge's ``compute_accept_len`` + 1): what a greedy ``chain:bs-1`` accepts
at those anchors when the text is the target's own greedy output.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models.dflash import block_logits, default_taps, draft_blocks, draft_config, init_dflash
from confu_jax.models.spec import model_spec_from_config
from confu_jax.models.target import real_forward
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.acceptance import masked_head_terms
from confu_jax.train.rows import batch_arrays, row_layout, same_segment_ahead, sample_anchors, shift_ahead
from confu_jax.train.task import TrainTask, frozen_target_task
from confu_jax.train.target_loading import target_name


def default_dflash_config() -> ml_collections.ConfigDict:
    """``config.dflash`` (SpecForge's ``examples/configs/qwen3-8b-dflash-online.yaml`` where it sets one)."""
    c = ml_collections.ConfigDict()
    c.num_layers = 3  # draft layers (the published drafters: 5 over Qwen3-8B's 36); the target's layer shape
    c.block_size = 16  # bs: the root + bs-1 drafted tokens
    c.mask_token_id = 0  # M: a token whose (frozen) target embedding marks the masked positions
    c.num_anchors = 512  # blocks per row
    c.loss_decay_gamma = 7.0  # w_k = exp(-(k-1)/γ); 0: unweighted (loss_type "dflash")
    c.loss_type = "dflash"  # or D-PACE: "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"
    c.dpace_alpha = 0.5  # D-PACE's smoothing: s_k = (1 - α) q_k + α
    c.init_std = 0.02
    c.causal_head = False  # JetSpec's causal head: each block position sees the block up to itself
    return c


def apply_dflash_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into a DFlash config (the head sections stay, unread;
    ``draft.tap_layers`` None = the reference's default 3 target layers of whatever target the run loads)."""
    config.train.task = "dflash"  # train.tasks.TASKS
    config.dflash = default_dflash_config()
    return config


def apply_jetspec_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A JetSpec config from a base or DFlash config (hao-ai-lab/JetSpec @2c7b3fa; arXiv 2606.18394): DFlash's
    draft and objective with the causal head (``dflash.causal_head``: block position k attends the context and block positions
    0..k, the reference's ``_build_dflash_causal_attention_mask``). JetSpec's trainer is not published
    (its head is "vendored from PTD/causal_parallel_drafting"); the objective here is DFlash's
    (SpecForge's recipe) under that mask."""
    if "dflash" not in config:
        apply_dflash_defaults(config)
    config.train.task = "jetspec"  # train.tasks.TASKS
    config.dflash.causal_head = True
    return config


def dflash_spec(config):
    """The ModelSpec of a DFlash config: its draft's layer config as ``draft_model``, its taps
    (``draft.tap_layers``, else ``models.dflash.default_taps`` of the target)."""
    spec = model_spec_from_config(config)
    taps = spec.taps if config.draft.get("tap_layers", None) is not None else default_taps(spec.target.n_layers)
    return dataclasses.replace(spec, head=dataclasses.replace(spec.head, tap_layers=tuple(taps)),
                               draft_model=draft_config(spec.target, int(config.dflash.num_layers)))


LOSS_TYPES = ("dflash", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")


def dpace_weights(prob_bnk: jax.Array, valid_bnk: jax.Array, alpha: float, loss_type: str = "dpace") -> jax.Array:
    """D-PACE's position weights [B, N, bs] (module docstring), detached: ``prob_bnk`` the draft's probability
    of each label, ``valid_bnk`` the trained positions (masked ones: a factor 1 in the products, 0 in the sums)."""
    prob_bnk = jax.lax.stop_gradient(prob_bnk)
    valid = valid_bnk.astype(jnp.float32)
    smooth = jnp.where(valid_bnk, (1.0 - alpha) * prob_bnk + alpha, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1)
    if loss_type == "dpace-cumulative-confidence-only":
        return prefix
    suffix = jnp.flip(jnp.cumsum(jnp.flip(prefix * valid, -1), -1), -1)
    if loss_type == "dpace":
        return suffix
    if loss_type == "dpace-continuation-value-only":
        return suffix / jnp.maximum(prefix, jnp.finfo(prefix.dtype).tiny)
    raise ValueError(f"config.dflash.loss_type: expected one of {LOSS_TYPES}, got {loss_type!r}")


def block_accept_length(hit_bnk: jax.Array, valid_bnk: jax.Array, block_valid_bn: jax.Array) -> jax.Array:
    """1 + the mean over valid blocks of the leading run of right positions (invalid positions count as
    right inside the run and add nothing: SpecForge's ``compute_accept_len``)."""
    ok = (hit_bnk | ~valid_bnk).astype(jnp.int32)
    run = jnp.sum(jnp.cumprod(ok, axis=-1) * valid_bnk, axis=-1).astype(jnp.float32)
    w = block_valid_bn.astype(jnp.float32)
    return 1.0 + jnp.sum(run * w) / jnp.maximum(w.sum(), 1.0)


class PaddedBlocks(NamedTuple):
    """What the losses of the block families that train on padded rows (DSpark, DFlash2, Domino) start from."""

    tokens_bn: jax.Array
    mask_bn: jax.Array  # the batch's loss mask
    target: object  # models.target.real_forward's output (taps, hidden states), on stopped target params
    target_params: dict  # stop_gradient'ed: the target is frozen
    anchors_bn: jax.Array  # [B, N] each block's anchor position a
    block_valid_bn: jax.Array  # [B, N] the anchor was sampled (a row with fewer candidates has fewer blocks)
    h_bnkd: jax.Array  # [B, N, bs, d] the backbone's hidden state of each block slot


def padded_block_forward(name: str, spec, backbone: dict, target_params, batch, rng, *, block_size: int,
                         num_anchors: int, mask_token_id: int, min_block: int = 2) -> PaddedBlocks:
    """The start every padded-row block family's loss shares: the frozen target's forward (taps), ``num_anchors``
    anchors a row among positions t with x[t] and x[t+1] in the loss mask, and the backbone over each anchor's
    block of ``block_size`` slots (``models.dflash.draft_blocks``). Packed rows are refused (these families'
    references train on padded rows); ``name`` says whose loss refused a bad batch."""
    tokens, mask = batch_arrays(batch)
    n = tokens.shape[1]
    if block_size < min_block or block_size >= n:
        raise ValueError(f"{name}: block_size={block_size} must be in [{min_block}, {n - 1}] for rows of {n} tokens")
    layout = row_layout(batch)
    if layout.segment_ids_bn is not None:
        raise ValueError(f"{name} trains on padded rows; turn config.data.pack off")
    target_params = jax.lax.stop_gradient(target_params)
    tgt = real_forward(spec, target_params, tokens, layout.positions_bn, return_logits=False)
    taps = jax.lax.stop_gradient(tgt.taps_btc)
    anchors, block_valid = sample_anchors(rng, mask & shift_ahead(mask, 1, False), num_anchors)  # [B,N]
    h = draft_blocks(backbone, spec.draft_model, spec.target, target_params, taps, tokens, anchors,
                     mask_token_id, block_size, layout.positions_bn)  # [B,N,bs,d]
    return PaddedBlocks(tokens, mask, tgt, target_params, anchors, block_valid, h)


def over_anchor_chunks(fn, anchor_chunk: int, *xs_bn):
    """``fn(*xs)`` -> a tuple of [B, N, ...] per-slot terms, computed ``anchor_chunk`` anchors at a time and
    rematerialised chunk by chunk in the backward pass (``jax.checkpoint`` inside ``lax.map``), so that a loss's
    [B, c, bs, V] logits of one chunk are alive at once, not the [B, N, bs, V] of every anchor (DFlash2 and Domino
    hold several such tensors: at Llama-3.1-8B's vocabulary and 512 anchors, gigabytes a row). Every ``xs`` is
    [B, N, ...] (N anchors); ``fn`` must treat anchors independently. Chunks hold the largest divisor of N that is
    at most ``anchor_chunk``; 0 or >= N: one chunk (the whole ``fn`` under ``jax.checkpoint``)."""
    n = xs_bn[0].shape[1]
    f = jax.checkpoint(fn)
    if anchor_chunk <= 0 or anchor_chunk >= n:
        return f(*xs_bn)
    anchor_chunk = max(d for d in range(1, anchor_chunk + 1) if n % d == 0)
    c = n // anchor_chunk

    def split(x):  # [B, N, ...] -> [C, B, N/C, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], c, anchor_chunk, *x.shape[2:]), 1, 0)

    outs = jax.lax.map(lambda chunk: f(*chunk), tuple(split(x) for x in xs_bn))
    return jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], n, *y.shape[3:]), outs)


def dflash_loss(spec, p, target_params, batch, rng, *, block_size: int, num_anchors: int, mask_token_id: int,
                gamma: float, causal: bool = False, loss_type: str = "dflash", dpace_alpha: float = 0.5):
    """(loss, metrics) of one batch (module docstring)."""
    tokens, mask = batch_arrays(batch)
    b, n = tokens.shape
    if block_size < 2 or block_size >= n:
        raise ValueError(f"DFlash: block_size={block_size} must be in [2, {n - 1}] for rows of {n} tokens")
    layout = row_layout(batch)
    tgt = real_forward(spec, target_params, tokens, layout.positions_bn, return_logits=False,
                       segment_ids_bt=layout.segment_ids_bn)
    taps = jax.lax.stop_gradient(tgt.taps_btc)
    cand = mask & shift_ahead(mask, 1, False)
    if layout.segment_ids_bn is not None:
        cand = cand & same_segment_ahead(layout.segment_ids_bn, 1)
    anchors, block_valid = sample_anchors(rng, cand, num_anchors)  # [B,N]
    h = draft_blocks(p, spec.draft_model, spec.target, target_params, taps, tokens, anchors, mask_token_id,
                     block_size, layout.positions_bn, layout.segment_start_bn, causal=causal)  # [B,N,bs,d]
    k = jnp.arange(block_size)
    idx = anchors[..., None] + k  # [B,N,bs]
    inside = idx < n
    safe = jnp.minimum(idx, n - 1)
    rows = jnp.arange(b)[:, None, None]
    labels = tokens[rows, safe]
    valid = block_valid[..., None] & inside & (k > 0) & mask[rows, safe]
    if layout.segment_ids_bn is not None:
        valid = valid & (layout.segment_ids_bn[rows, safe] == layout.segment_ids_bn[rows, anchors[..., None]])
    vocab = spec.target.vocab_size

    @jax.checkpoint  # the [B, N, bs, V] logits are recomputed in the backward pass
    def terms(h, labels):
        flat = block_logits(spec.target, target_params, h.reshape(b, -1, h.shape[-1]))
        logp = jax.nn.log_softmax(to_target_vocab(flat, vocab).reshape(h.shape[:3] + (-1,)), -1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1)

    nll, top1 = terms(h, labels)
    if loss_type == "dflash":
        decay = jnp.exp(-jnp.maximum(k - 1, 0).astype(jnp.float32) / gamma) if gamma > 0 else jnp.ones((block_size,))
        w = valid.astype(jnp.float32) * decay
        loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-9)
    else:  # D-PACE
        w = valid.astype(jnp.float32) * dpace_weights(jnp.exp(-nll), valid, dpace_alpha, loss_type)
        loss = jnp.sum(nll * w) / b
    metrics, hits = {}, []
    for i in range(1, block_size):
        _, hit = masked_head_terms(metrics, f"head{i - 1}", nll[..., i], top1[..., i], labels[..., i], valid[..., i])
        hits.append(hit)
    metrics["acceptance_length"] = block_accept_length(jnp.stack(hits, -1), valid[..., 1:], block_valid)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of a DFlash config (``configs/tiny_dflash.py``, ``configs/smollm2_dflash.py``)."""
    dc = config.dflash
    bs, anchors, gamma = int(dc.block_size), int(dc.num_anchors), float(dc.loss_decay_gamma or 0.0)
    mask_id = int(dc.mask_token_id)
    causal = bool(dc.get("causal_head", False))
    loss_type, alpha = str(dc.get("loss_type", "dflash")), float(dc.get("dpace_alpha", 0.5))
    if bs < 2 or anchors < 1 or int(dc.num_layers) < 1:
        raise ValueError(f"config.dflash: need block_size >= 2, num_anchors >= 1, num_layers >= 1; got {bs}, "
                         f"{anchors}, {dc.num_layers}")
    if loss_type not in LOSS_TYPES or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"config.dflash: loss_type must be one of {LOSS_TYPES} and dpace_alpha in [0, 1]; got "
                         f"{loss_type!r}, {alpha}")
    pd = jnp.dtype(config.draft.get("param_dtype", "float32"))

    def build(spec, target_host):
        if not 0 <= mask_id < spec.target.vocab_size:
            raise ValueError(f"config.dflash.mask_token_id={mask_id} outside the target's vocabulary "
                             f"({spec.target.vocab_size})")
        n_taps = len(spec.taps)

        def init_params(rng):
            return {"draft": {"dflash": init_dflash(rng, spec.draft_model, n_taps, init_std=float(dc.init_std),
                                                    param_dtype=pd)}}

        def loss_fn(trainable, frozen, batch, rng):
            return dflash_loss(spec, trainable["draft"]["dflash"], frozen["target"], batch, rng, block_size=bs,
                               num_anchors=anchors, mask_token_id=mask_id, gamma=gamma, causal=causal,
                               loss_type=loss_type, dpace_alpha=alpha)

        return init_params, loss_fn, (f"{'JetSpec (causal head)' if causal else 'DFlash'}: {dc.num_layers} "
                                      f"{target_name(config)!r}-shaped layers over "
                                      f"taps {spec.taps}, blocks of {bs} (mask {mask_id}), {anchors} anchors "
                                      f"a row, " + (f"decay γ={gamma}" if loss_type == "dflash" else
                                                    f"{loss_type} α={alpha}"))

    return frozen_target_task(config, pack_ok=True, what="DFlash", build=build, spec_fn=dflash_spec)
