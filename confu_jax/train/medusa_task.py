"""Medusa-1 training: K heads on the frozen target's last hidden state (docs/DESIGN.md §11 "Medusa").

Why this objective: Medusa-1 trains only the heads (the backbone is frozen, so its outputs — and the
speculative loop's losslessness — are untouched). The target runs once per row
(``real_forward``), giving h[t] = its final-normed hidden state at every position; head k
(0-based, ``models.medusa``) at position t is trained to predict x[t+k+2] with cross-entropy, and
the heads' losses are summed with weights λ^k::

    loss = Σ_k  λ^k · mean_{t : m[t+k+2]}  CE( head_k(h[t]), x[t+k+2] )

λ = ``config.medusa.decay_coefficient`` (0.8: the reference recipe's ``medusa_decay_coefficient``,
FasterDecoding's axolotl fork ``src/axolotl/utils/models.py``; the legacy trainer
``medusa/train/train_legacy.py`` ``CustomizedTrainer.compute_loss`` is the same loop with λ = 1,
``medusa_logits = logits[i, :, : -(2 + i)]`` against ``labels[..., 2 + i :]``). m = the loss mask
(answer tokens; padding excluded). In this project the training answers are already the target's
own greedy outputs (self-distilled data), which is Medusa's self-distillation recipe with hard
labels. ``config.medusa.distill = True`` swaps the hard labels for the target's own distribution at
t+k+1 (KL(p_target(·|x≤t+k+1) ‖ head_k(h[t])), the soft-label form of Medusa's self-distillation),
same weights and mask.

Evaluation (held-out batches): ``loss``, ``ce/head{k}``, ``acc/head{k}`` (top-1 of head k equal to
x[t+k+2], over the positions where x[t+k+2] is an answer token) and ``acceptance_length``: from every
position t whose next token is an answer token, 1 + the leading run of heads 0.. that are right —
what a greedy ``chain:K`` would accept there on this text (exact when the text is the target's own
greedy output). Exact resumption comes from the train loop (``train.loop``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models.medusa import init_medusa, medusa_logits
from confu_jax.models.target import real_forward
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.acceptance import heads_acceptance_length, masked_head_terms
from confu_jax.train.teacher import lm_head_layout
from confu_jax.train.task import TrainTask, frozen_target_task
from confu_jax.train.target_loading import target_name


def default_medusa_config() -> ml_collections.ConfigDict:
    """``config.medusa``."""
    c = ml_collections.ConfigDict()
    c.num_heads = 4  # medusa_num_heads (the reference's default is 5; decode depth <= num_heads)
    c.num_layers = 1  # medusa_num_layers (ResBlocks per head; every published head has 1)
    c.decay_coefficient = 0.8  # λ: head k's loss weight λ^k (reference medusa_decay_coefficient)
    c.distill = False  # True: KL to the target's own distribution instead of CE on the data's tokens
    return c


def apply_medusa_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into a Medusa config (the head sections stay, unread)."""
    config.train.task = "medusa"  # train.tasks.TASKS
    config.medusa = default_medusa_config()
    return config


def medusa_loss(spec, heads, target_params, batch, *, decay: float, distill: bool = False):
    """(loss, metrics) of one batch (module docstring); metrics: ``ce/head{k}``, ``acc/head{k}``,
    ``count/head{k}`` and the chain ``acceptance_length``."""
    tokens = batch["tokens"]
    b, n = tokens.shape
    mask = batch["loss_mask"].astype(bool)
    if "attention_mask" in batch:
        mask = mask & batch["attention_mask"].astype(bool)
    tgt = real_forward(spec, target_params, tokens, return_logits=distill)
    h_bnd = jax.lax.stop_gradient(tgt.hidden_btd)
    teacher_logp = None if not distill else jax.nn.log_softmax(jax.lax.stop_gradient(tgt.logits_btv), -1)
    n_heads = heads["lm_head"]["kernel"].shape[0]
    vocab = spec.target.vocab_size
    loss = jnp.zeros((), jnp.float32)
    metrics, hits = {}, []
    for k in range(n_heads):
        shift = k + 2
        if shift >= n:
            raise ValueError(f"Medusa head {k} predicts {shift} tokens ahead; training rows hold only {n} tokens")
        head_k = jax.tree_util.tree_map(lambda x, k=k: x[k:k + 1], heads)

        @jax.checkpoint  # the [B, N, V] logits of one head are recomputed in the backward pass
        def head_terms(head_k, h, labels, teacher):
            logp = jax.nn.log_softmax(to_target_vocab(medusa_logits(head_k, h)[0], vocab), axis=-1)
            if teacher is None:
                nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
            else:
                p = jnp.exp(teacher)
                nll = jnp.sum(jnp.where(p > 0, p * (teacher - jnp.maximum(logp, -1e30)), 0.0), axis=-1)
            return nll, jnp.argmax(logp, axis=-1)

        labels = tokens[:, shift:]
        teacher = None if teacher_logp is None else teacher_logp[:, shift - 1:n - 1]
        nll, top1 = head_terms(head_k, h_bnd[:, :n - shift], labels, teacher)
        ce, hit = masked_head_terms(metrics, f"head{k}", nll, top1, labels, mask[:, shift:])
        loss = loss + (decay ** k) * ce
        hits.append(jnp.pad(hit, ((0, 0), (0, shift))))  # indexed by t: [B, N]
    metrics["acceptance_length"] = heads_acceptance_length(jnp.stack(hits), mask)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of a Medusa config (``configs/tiny_medusa.py``, ``configs/smollm2_medusa.py``)."""
    mc = config.medusa
    k, layers, decay, distill = int(mc.num_heads), int(mc.num_layers), float(mc.decay_coefficient), bool(mc.distill)
    if k < 1 or layers < 0 or not 0 < decay <= 1:
        raise ValueError(f"config.medusa: need num_heads >= 1, num_layers >= 0, 0 < decay_coefficient <= 1; "
                         f"got {k}, {layers}, {decay}")
    pd = jnp.dtype(config.draft.get("param_dtype", "float32")) if "draft" in config else jnp.float32

    def build(spec, target_host):
        def init_params(rng):
            w, axis = lm_head_layout(spec, target_host)
            return {"draft": {"medusa": init_medusa(rng, k, layers, jnp.asarray(w), axis, pd)}}

        def loss_fn(trainable, frozen, batch, rng):
            del rng
            return medusa_loss(spec, trainable["draft"]["medusa"], frozen["target"], batch, decay=decay,
                               distill=distill)

        return init_params, loss_fn, (f"Medusa-1: {k} heads x {layers} ResBlock(s) on '{target_name(config)}', "
                                      f"{'KL to the target' if distill else 'CE'} weighted {decay}^k")

    return frozen_target_task(config, pack_ok=False, what="Medusa", build=build, init_reads_target=True)
