"""MTP module training: DeepSeek-V3's multi-token prediction objective on the frozen target's hidden
states (docs/DESIGN.md §11 "MTP module").

Why this objective: it is the report's (DeepSeek-V3 Technical Report §2.2, "MTP Training
Objective"), with the main model frozen. The target runs once per row (``real_forward``) and gives
h⁰[i] = its final-normed hidden state (what its LM head reads; what vLLM and SGLang hand the MTP
module at inference). Depth k = 1..D runs the module over the whole sequence — input i = (the
**true** token x[i+k], h^{k-1}[i]) at position i, causal attention over the same depth's inputs
j <= i — and predicts x[i+k+1]; depth k > 1 reads the module's own output h^{k-1} of depth k-1
(the report's sequential, causal-chain MTP). One module serves every depth (the report trains D
modules; vLLM and SGLang reuse one module for every speculative step, which is what this project
decodes with)::

    L_k   = mean_{i : m[i+k+1]}  CE( LMHead(shared_head.norm(h^k[i])), x[i+k+1] )
    L_MTP = λ / D · Σ_k L_k

m = the loss mask (answer tokens; padding excluded; packed rows: x[i+k+1] in i's conversation).
λ = ``config.mtp.loss_weight`` (the report's 0.3 for its first 10T tokens, then 0.1; with the
target frozen it only scales the loss, which Adam nearly ignores). Trained: the whole module
(enorm, hnorm, eh_proj, the decoder layer, shared_head.norm); the embedding and the LM head are the
target's, frozen. Packed rows (``data.pack``) run every depth under the block-diagonal causal mask
with positions restarting per conversation, as the target does.

Evaluation (held-out batches): ``loss``, ``ce/head{i}`` and ``acc/head{i}`` for depth i+1 (top-1
equal to x[t+i+2]: the Medusa / MLP speculator names, so the families' curves plot alike) and
``acceptance_length``: from every t whose next token is an answer token, 1 + the leading run of right
depths — what a greedy ``chain:D`` accepts there on this text when the text is the target's own greedy
output (a chain's depth k reads the drafted tokens, the true ones while they are right). It is an
estimate: at decode time a depth-k entry attends depth-1 entries of the accepted text (the module's
cache) where training's depth k attends depth-k entries. Exact resumption comes from the train loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax.models.mtp import init_mtp, mtp_logits, mtp_sequence
from confu_jax.models.target import real_forward
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.train.acceptance import heads_acceptance_length, masked_head_terms
from confu_jax.train.rows import batch_arrays, row_layout, same_segment_ahead, shift_ahead
from confu_jax.train.task import TrainTask, frozen_target_task
from confu_jax.train.target_loading import target_name


def default_mtp_config() -> ml_collections.ConfigDict:
    """``config.mtp``."""
    c = ml_collections.ConfigDict()
    c.num_depths = 3  # D: depths trained recursively (decode drafts any depth with the one module)
    c.loss_weight = 0.3  # λ (the report's first-phase value)
    c.init_block = "last_layer"  # the decoder layer starts as the target's last layer ('random': fresh)
    c.init_std = 0.02  # eh_proj (and a 'random' block): N(0, init_std)
    return c


def apply_mtp_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into an MTP config (the head sections stay, unread)."""
    config.train.task = "mtp"  # train.tasks.TASKS
    config.mtp = default_mtp_config()
    return config


def mtp_loss(spec, mtp, target_params, batch, *, num_depths: int, loss_weight: float):
    """(loss, metrics) of one batch (module docstring); metrics: ``ce/head{i}``, ``acc/head{i}``,
    ``count/head{i}`` (depth i+1) and the chain ``acceptance_length``."""
    tokens, mask = batch_arrays(batch)
    b, n = tokens.shape
    if num_depths < 1 or num_depths + 1 >= n:
        raise ValueError(f"MTP: num_depths={num_depths} must be in [1, {n - 2}] for rows of {n} tokens")
    layout = row_layout(batch)
    tgt = real_forward(spec, target_params, tokens, layout.positions_bn, return_logits=False,
                       segment_ids_bt=layout.segment_ids_bn)
    h = jax.lax.stop_gradient(tgt.hidden_btd)
    vocab = spec.target.vocab_size

    @jax.checkpoint  # the [B, N, V] logits of one depth are recomputed in the backward pass
    def depth_terms(mtp, h_out, labels):
        logp = jax.nn.log_softmax(to_target_vocab(mtp_logits(mtp, spec.target, target_params, h_out), vocab), -1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1)

    loss = jnp.zeros((), jnp.float32)
    metrics, hits = {}, []
    for k in range(1, num_depths + 1):
        # depth k at i reads x[i+k] (teacher forcing) and h^{k-1}[i]; predicts x[i+k+1]
        h = mtp_sequence(mtp, spec.target, target_params, shift_ahead(tokens, k, 0), h, layout.positions_bn, layout.segment_ids_bn)
        labels = shift_ahead(tokens, k + 1, 0)
        valid = shift_ahead(mask, k + 1, False)
        if layout.segment_ids_bn is not None:
            valid = valid & same_segment_ahead(layout.segment_ids_bn, k + 1)
        nll, top1 = depth_terms(mtp, h, labels)
        ce, hit = masked_head_terms(metrics, f"head{k - 1}", nll, top1, labels, valid)
        loss = loss + ce
        hits.append(hit)  # indexed by i: [B, N]
    loss = loss * (loss_weight / num_depths)
    metrics["acceptance_length"] = heads_acceptance_length(jnp.stack(hits), mask)
    metrics["loss"] = loss
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of an MTP config (``configs/tiny_mtp.py``, ``configs/smollm2_mtp.py``)."""
    mc = config.mtp
    depths, weight = int(mc.num_depths), float(mc.loss_weight)
    if depths < 1 or weight <= 0:
        raise ValueError(f"config.mtp: need num_depths >= 1 and loss_weight > 0; got {depths}, {weight}")
    pd = jnp.dtype(config.draft.get("param_dtype", "float32")) if "draft" in config else jnp.float32

    def build(spec, target_host):
        def init_params(rng):
            return {"draft": {"mtp": init_mtp(rng, spec.target, target_host, init_block=str(mc.init_block),
                                              init_std=float(mc.init_std), param_dtype=pd)}}

        def loss_fn(trainable, frozen, batch, rng):
            del rng
            return mtp_loss(spec, trainable["draft"]["mtp"], frozen["target"], batch, num_depths=depths,
                            loss_weight=weight)

        return init_params, loss_fn, (f"MTP module (DeepSeek-V3): one {target_name(config)!r} decoder layer "
                                      f"(init {mc.init_block}), {depths} recursive depths, CE x {weight}/{depths}")

    return frozen_target_task(config, pack_ok=True, what="MTP", build=build, init_reads_target=True)
