"""SD² training (Steering pretrained Drafters during Speculative Decoding, Appendix A.4 "Training").

The frozen verifier (the target) gives, on every training row, its next-token distribution
π_V(·|x≤t) and its taps h_cat[t] (EAGLE-3's low/mid/high hidden states). The drafter — a
pretrained draft model (``config.sd2.drafter``: ``self:N``, the target's first N layers, or a
checkpoint sharing the target's tokenizer; ``runs.draft_models``) — runs over the same row with
SD²'s steered MLPs (``models.steering``): position t reads the steering vector of a position
δ_t earlier, g[t-δ_t] = W_hml · h_cat[t-δ_t] with δ_t ~ U{1..k} drawn per position
(``config.sd2.max_offset`` = k; clipped at the row's first token), so the steering is trained for
every drafting depth 0..k-1 it serves at decode (a round's depth-i draft reads a g i+1 positions
old). The loss is the paper's

    KL( π_V(·|x≤t) || π_D(·|x≤t, g[t-δ_t]) )

averaged over the positions whose next token is an answer token (``loss_mask``). Trained: the
steering parameters (W_hml initialised so that g = h + m + l, W_s^l = 0) and — with
``config.sd2.train_drafter`` (the paper's choice; off = the "frozen drafter" ablation) — the whole
drafter, as a **delta** on the pretrained weights (``model_delta``, initialised to zeros: the
pretrained weights stay in the frozen tree, the checkpoint holds only what training changed;
``runs.draft_models.load_sd2_run`` adds them back). The verifier is never trained.

``config.sd2.steer = False`` is the paper's **distilled** baseline: the same drafter fine-tuned on
the same KL, data and steps with no steering at all (no steering parameters, no bias), so SD²'s
gain over plain distillation is measured at equal training (decode it with ``--method
draft_model``: ``decode.draft_model.draft_model_weights`` reads the run's fine-tuned drafter).

Evaluation reports the KL and the drafter's agreement with the verifier per offset δ = 1..k
(``kl/delta{δ}``, ``acc/delta{δ}``: top-1 equal; ``accept/delta{δ}``: Σ min(π_V, π_D), the chance a
T = 1 draft of that depth is accepted given the prefix), and ``acceptance_length``: the expected
tokens per pass of a chain of k from those rates (1 + Σ_i Π_{j≤i} accept_j).

Data: the self-distilled conversations of ``config.data`` (``train.real_data``), or for
``model.source='random'`` self-distilled random prompts (``train.synthetic_data``). Packed rows
(``data.pack``) are not supported. Exact resumption comes from the train loop (``train.loop``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from confu_jax import sharding as shd
from confu_jax.models import steering as steer_lib
from confu_jax.models.early_exit import early_exit_params
from confu_jax.models.llama import Llama
from confu_jax.models.spec import model_spec_from_config
from confu_jax.models.target import real_forward
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.runs.draft_models import load_drafter, sd2_trainable_shapes
from confu_jax.runs.heads import target_fingerprint
from confu_jax.train.task import TrainTask, task_data
from confu_jax.assets import strip_asset
from confu_jax.train.target_loading import load_target, target_name


def default_sd2_config() -> ml_collections.ConfigDict:
    """``config.sd2``."""
    c = ml_collections.ConfigDict()
    # The pretrained drafter: 'self:N' (the target's first N layers + its final norm and LM head) or
    # an asset / GGUF / HF directory with the target's tokenizer.
    c.drafter = "self:8"
    c.max_offset = 4  # k: offsets δ ~ U{1..k} (a decode round of chain:K uses offsets 1..K; paper: k = 8)
    c.train_drafter = True  # fine-tune the whole drafter too (the paper's SD²); False = steering only
    c.steer = True  # False = the distilled baseline: the drafter fine-tuned alone, without steering
    return c


def apply_sd2_defaults(config: ml_collections.ConfigDict, drafter: str = "self:8") -> ml_collections.ConfigDict:
    """Turn a ``configs.common.base_config`` into an SD² config (the head sections stay, unread)."""
    config.train.task = "sd2"  # train.tasks.TASKS
    config.sd2 = default_sd2_config()
    config.sd2.drafter = drafter
    return config


def _weights(frozen, trainable, drafter_cfg, early_exit: bool):
    base = early_exit_params(frozen["target"], drafter_cfg.n_layers) if early_exit else frozen["drafter"]
    base = jax.lax.stop_gradient(base)
    delta = trainable["draft"].get("model_delta")
    if delta is None:
        return base
    return jax.tree_util.tree_map(lambda w, d: w.astype(jnp.float32) + d, base, delta)


def sd2_loss(spec, drafter_cfg, early_exit: bool, max_offset: int, trainable, frozen, batch, rng,
             offsets=None):
    """(loss, metrics) of one batch (module docstring). ``offsets``: a fixed δ (evaluation) instead
    of the per-position draw."""
    tokens = batch["tokens"]
    b, n = tokens.shape
    valid = batch["loss_mask"][:, 1:].astype(bool)
    if "attention_mask" in batch:
        valid = valid & batch["attention_mask"][:, 1:].astype(bool)
    tgt = real_forward(spec, frozen["target"], tokens)
    teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(tgt.logits_btv[:, :-1]), axis=-1)
    h_cat = jax.lax.stop_gradient(tgt.taps_btc)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    delta = (jax.random.randint(rng, (b, n), 1, max_offset + 1) if offsets is None
             else jnp.full((b, n), offsets, jnp.int32))
    src = jnp.maximum(pos - delta, 0)
    steering = trainable["draft"].get("steering")
    bias = (None if steering is None  # the distilled baseline (config.sd2.steer False)
            else steer_lib.bias_from_taps(steering, jnp.take_along_axis(h_cat, src[..., None], axis=1)))  # [L,B,N,F]
    w = _weights(frozen, trainable, drafter_cfg, early_exit)
    out = Llama(drafter_cfg).apply({"params": w}, tokens, pos, mlp_bias_lbtf=bias)
    draft_logp = jax.nn.log_softmax(to_target_vocab(out.logits_btv[:, :-1], spec.target.vocab_size), axis=-1)
    p = jnp.exp(teacher_logp)
    kl_bt = jnp.sum(jnp.where(p > 0, p * (teacher_logp - jnp.maximum(draft_logp, -1e30)), 0.0), axis=-1)
    wgt = valid.astype(jnp.float32)
    count = jnp.maximum(wgt.sum(), 1.0)
    loss = jnp.sum(kl_bt * wgt) / count
    agree = (jnp.argmax(draft_logp, -1) == jnp.argmax(teacher_logp, -1)).astype(jnp.float32)
    accept = jnp.sum(jnp.minimum(p, jnp.exp(draft_logp)), axis=-1)
    metrics = {"kl": loss, "acc": jnp.sum(agree * wgt) / count, "accept": jnp.sum(accept * wgt) / count}
    return loss, metrics


def build_task(config) -> TrainTask:
    """The TrainTask of an SD² config (``configs/smollm2_sd2.py``; see the module docstring)."""
    from confu_jax.runs.draft_models import parse_self_source
    from confu_jax.train.target_loading import is_abstract

    if config.data.get("pack", False):
        raise ValueError("config.data.pack: SD² training reads padded rows only (turn data.pack off)")
    if config.model.attention_impl != "xla":
        raise ValueError(f"config.model.attention_impl={config.model.attention_impl!r} cannot train; use 'xla'")
    sd2 = config.sd2
    k = int(sd2.max_offset)
    if k < 1:
        raise ValueError(f"config.sd2.max_offset must be >= 1, got {k}")
    spec, target_host = load_target(config, model_spec_from_config(config))
    abstract = is_abstract(config.model.source)  # shapes only (launch.train --compile_only): the early exit's
    if abstract and parse_self_source(str(sd2.drafter), spec.target) is None:  # weights are the target's
        raise ValueError(f"config.sd2.drafter={sd2.drafter!r} with config.model.source='abstract': an external "
                         "draft model's tokenizer is checked against the target's, which an abstract target lacks; "
                         "compile with sd2.drafter='self:N', or give a real target")
    drafter = load_drafter(str(sd2.drafter), spec.target, target_source=strip_asset(str(config.model.source)))
    early_exit = drafter.params is None
    dcfg = drafter.cfg
    train_drafter = bool(sd2.train_drafter)
    steer = bool(sd2.get("steer", True))
    if not (steer or train_drafter):
        raise ValueError("config.sd2.steer=False with config.sd2.train_drafter=False trains nothing: the distilled "
                         "baseline fine-tunes the drafter (train_drafter=True)")
    frozen_host = {"target": target_host, "drafter": {} if early_exit else drafter.params}
    synthetic = config.model.source == "random"
    _, train_iterator, eval_batches = task_data(config, spec, target_host)

    def init_params(rng):
        del rng  # deterministic: W_hml = stacked identities, W_s = 0, delta = 0
        draft = {"steering": steer_lib.init_steering(spec.target.d_model, len(spec.taps), dcfg)} if steer else {}
        if train_drafter:
            shapes = sd2_trainable_shapes(dcfg, spec.target, len(spec.taps), True, steer)["draft"]["model_delta"]
            draft["model_delta"] = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return {"draft": draft}

    def loss_fn(trainable, frozen, batch, rng):
        return sd2_loss(spec, dcfg, early_exit, k, trainable, frozen, batch, rng)

    def eval_fn(trainable, frozen, batch, rng):
        out, rates = {}, []
        for d in range(1, k + 1):
            _, m = sd2_loss(spec, dcfg, early_exit, k, trainable, frozen, batch, rng, offsets=d)
            out.update({f"{name}/delta{d}": v for name, v in m.items()})
            rates.append(m["accept"])
        out["loss"] = jnp.mean(jnp.stack([out[f"kl/delta{d}"] for d in range(1, k + 1)]))
        out["acceptance_length"] = 1.0 + jnp.sum(jnp.cumprod(jnp.stack(rates)))
        return out

    return TrainTask(
        init_params=init_params,
        frozen_abstract=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), frozen_host),
        load_frozen=(lambda shardings: shd.with_shardings(frozen_host, shardings)) if abstract
        else (lambda shardings: shd.put_tree(frozen_host, shardings)),
        loss_fn=loss_fn,
        train_iterator=train_iterator,
        eval_batches=eval_batches if int(config.objective.eval_batches) > 0 and eval_batches else None,
        eval_fn=eval_fn,
        axis_units=shd.llama_axis_units(spec.target.head_dim),
        target_fingerprint=None if abstract else target_fingerprint(target_host),
        target_source=str(config.model.source),
        description=((f"SD² steering + {'fine-tuned' if train_drafter else 'frozen'} drafter" if steer
                      else "distilled drafter (no steering)") + f" {drafter.source} on "
                     f"'{target_name(config)}' ({'self-distilled random data' if synthetic else config.data.train_files}"
                     f"), offsets 1..{k}, KL(verifier || drafter)"),
    )
