"""MLP speculator training: K recurrent stages on the frozen target's last hidden state (docs/DESIGN.md
§11 "MLP speculator").

Why this objective: it is the reference's stage-1 training (IBM fms-fsdp
``speculator/train_speculator_utils.py`` ``stage1_loss``; the model: fms-extras
``fms_extras/models/speculator.py`` ``MLPSpeculator.forward``). The target is frozen (its outputs —
and the speculative loop's losslessness — are untouched) and runs once per row (``real_forward``),
giving h[t] = its final-normed hidden state (what its LM head reads; fms's ``include_embeds``).
Stage i (0-based) at position t reads h[t] and the **true** tokens x[t+1..t+i+1] (teacher forcing:
``speculator(embeds, input[:, 1:])``, stage i reading ``inds[:, i:i+n]``) and is trained to predict
x[t+i+2]; the stages' cross-entropies are summed unweighted, as the reference's ``sum(losses)``::

    loss = Σ_i  mean_{t : m[t+i+2]}  CE( stage_i(h[t], x[t+1..t+i+1]), x[t+i+2] )

m = the loss mask (answer tokens; padding excluded) where the reference averages over every token of
its pretraining rows. Stage i is evaluated at every t with t+i+2 inside the row (the reference cuts
all stages at the same n = N - K - 1). In this project the training answers are the target's own
greedy outputs (self-distilled data), which is what the reference's stage-2 training
(``stage2_loss``: the base model's own sampled generations) aims at; stage 2's online generation
itself is not implemented. ``config.mlp_speculator.tie_weights`` trains the shared weights once
(``models.mlp_speculator.to_trainable``): their gradient is the sum over the stages, as in the
reference's tied module.

Evaluation (held-out batches): ``loss``, ``ce/head{i}``, ``acc/head{i}`` (top-1 of stage i equal to
x[t+i+2], over the positions where x[t+i+2] is an answer token; the stage names follow Medusa's
``head{k}`` so the two families' curves plot alike) and ``acceptance_length``: from every position t
whose next token is an answer token, 1 + the leading run of stages 0.. that are right — what a greedy
``chain:K`` accepts there on this text (exact when the text is the target's own greedy output: a
chain's stage i reads the tokens the earlier stages chose, which are the true ones while they are
right). Exact resumption comes from the train loop (``train.loop``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models.mlp_speculator import (MLPSpeculatorConfig, from_trainable, init_mlp_speculator, input_state,
                                             make_config, stage_logits, stage_state, to_trainable)
from confu_jax.models.target import real_forward
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.acceptance import heads_acceptance_length, masked_head_terms
from confu_jax.train.task import TrainTask, frozen_target_task
from confu_jax.train.target_loading import target_name


def default_mlp_speculator_config() -> ml_collections.ConfigDict:
    """``config.mlp_speculator`` (the reference's defaults: fms-extras ``MLPSpeculator.__init__``)."""
    c = ml_collections.ConfigDict()
    c.n_predict = 3  # n_predict (K stages; decode depth <= n_predict)
    c.inner_dim = 0  # D; 0 = the target's width (the reference's convention)
    c.tie_weights = False  # share emb / ln / head over all stages and proj over stages 1.. (fms-fsdp: True)
    c.scale_input = False  # ln0(h) / sqrt(2) before stage 0 (fms-fsdp: True)
    return c


def apply_mlp_speculator_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into an MLP speculator config (the head sections stay, unread)."""
    config.train.task = "mlp_speculator"  # train.tasks.TASKS
    config.mlp_speculator = default_mlp_speculator_config()
    return config


def mlp_speculator_loss(spec, params, target_params, batch):
    """(loss, metrics) of one batch for stage-layout ``params`` (module docstring); metrics:
    ``ce/head{i}``, ``acc/head{i}``, ``count/head{i}`` and the chain ``acceptance_length``."""
    tokens = batch["tokens"]
    b, n = tokens.shape
    mask = batch["loss_mask"].astype(bool)
    if "attention_mask" in batch:
        mask = mask & batch["attention_mask"].astype(bool)
    tgt = real_forward(spec, target_params, tokens, return_logits=False)
    h_bnd = jax.lax.stop_gradient(tgt.hidden_btd)
    n_stages = params["emb"]["embedding"].shape[0]
    vocab = spec.target.vocab_size

    def stage_terms(params, s, labels, i):
        logp = jax.nn.log_softmax(to_target_vocab(stage_logits(params, i, s), vocab), axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return nll, jnp.argmax(logp, axis=-1)

    loss = jnp.zeros((), jnp.float32)
    metrics, hits = {}, []
    s = input_state(params, h_bnd)
    for i in range(n_stages):
        shift = i + 2
        if shift >= n:
            raise ValueError(f"MLP speculator stage {i} predicts {shift} tokens ahead; training rows hold only "
                             f"{n} tokens")
        # stage i at t < n - shift reads x[t+i+1] and its own state at t from stage i-1
        s = stage_state(params, i, s[:, :n - shift], tokens[:, i + 1:n - 1])
        labels = tokens[:, shift:]
        # the [B, N, V] logits of one stage are recomputed in the backward pass
        nll, top1 = jax.checkpoint(lambda p, s, y, i=i: stage_terms(p, s, y, i))(params, s, labels)
        ce, hit = masked_head_terms(metrics, f"head{i}", nll, top1, labels, mask[:, shift:])
        loss = loss + ce
        hits.append(jnp.pad(hit, ((0, 0), (0, shift))))  # indexed by t: [B, N]
    metrics["acceptance_length"] = heads_acceptance_length(jnp.stack(hits), mask)
    metrics["loss"] = loss
    return loss, metrics


def speculator_config(config, spec) -> MLPSpeculatorConfig:
    """The checked speculator of ``config.mlp_speculator`` on the target ``spec.target``."""
    mc = config.mlp_speculator
    return make_config(int(mc.n_predict), spec.target.d_model, spec.target.vocab_size, int(mc.inner_dim),
                       bool(mc.tie_weights), bool(mc.scale_input))


def build_task(config) -> TrainTask:
    """The TrainTask of an MLP speculator config (``configs/tiny_mlp_speculator.py``,
    ``configs/smollm2_mlp_speculator.py``)."""
    pd = jnp.dtype(config.draft.get("param_dtype", "float32")) if "draft" in config else jnp.float32

    def build(spec, target_host):
        c = speculator_config(config, spec)

        def init_params(rng):
            return {"draft": {"mlp_speculator": to_trainable(init_mlp_speculator(rng, c, pd), c)}}

        def loss_fn(trainable, frozen, batch, rng):
            del rng
            return mlp_speculator_loss(spec, from_trainable(trainable["draft"]["mlp_speculator"], c),
                                       frozen["target"], batch)

        return init_params, loss_fn, (f"MLP speculator: {c.n_predict} stages, inner_dim {c.inner_dim}"
                                      f"{', tied' if c.tie_weights else ''}{', scale_input' if c.scale_input else ''}"
                                      f" on '{target_name(config)}', per-stage CE summed")

    return frozen_target_task(config, pack_ok=False, what="MLP speculator", build=build)
