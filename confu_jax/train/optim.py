"""AdamW (or Muon) + linear warm-up + cosine decay + global-norm clipping, built from ``config.train.optim``.

Weight decay skips 1-D parameters (norm scales, biases) as is customary; the mask is a function of
the tree so the same optimizer serves every draft variant. ``optim.name = 'muon'`` is speculators 0.9's
optimizer (``speculators/train/optimizers.py``): Muon on the 2-D weight matrices but the vocabulary ones
(LM head, embeddings), AdamW with its weight decay on everything else — the trainer-parity runs' reference
optimizer, kept here so that difference can be taken alone (docs/training.md "Trainer parity").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def warmup_steps(optim_cfg, total_steps: int) -> int:
    if optim_cfg.warmup_steps >= 0:
        return int(optim_cfg.warmup_steps)
    return int(round(optim_cfg.warmup_ratio * total_steps))


SCHEDULES = ("cosine", "wsd")


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    """0 → lr linearly over the warm-up, then (``optim.schedule``) cosine to lr·end_lr_ratio at
    ``total_steps``, or 'wsd': lr held until the last ``decay_ratio`` of the steps, then linear to
    lr·end_lr_ratio at ``total_steps``."""
    total_steps = max(int(total_steps), 1)
    warm = warmup_steps(optim_cfg, total_steps)
    kind = str(optim_cfg.get("schedule", "cosine"))
    if kind not in SCHEDULES:
        raise ValueError(f"train.optim.schedule: expected one of {SCHEDULES}, got {kind!r}")
    if warm >= total_steps:  # a run shorter than its warm-up never reaches the decay
        return optax.linear_schedule(0.0, float(optim_cfg.lr), max(warm, 1))
    lr, end = float(optim_cfg.lr), float(optim_cfg.lr) * float(optim_cfg.end_lr_ratio)
    if kind == "wsd":
        ratio = float(optim_cfg.get("decay_ratio", 0.2))
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"train.optim.decay_ratio: expected a fraction in [0, 1], got {ratio}")
        decay = min(int(round(ratio * total_steps)), total_steps - warm)
        stable = total_steps - warm - decay
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, max(warm, 1)), optax.constant_schedule(lr),
             optax.linear_schedule(lr, end, max(decay, 1))],
            boundaries=[warm, warm + stable])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=float(optim_cfg.lr),
        warmup_steps=warm,
        decay_steps=total_steps,
        end_value=float(optim_cfg.lr) * float(optim_cfg.end_lr_ratio),
    )


def _decay_mask(params):
    return jax.tree_util.tree_map(lambda p: getattr(p, "ndim", 0) > 1, params)


def schedule_length(optim_cfg, train_steps: int) -> int:
    """The schedule's length: ``optim.schedule_steps`` when set (> 0), else the run's ``train_steps``."""
    return int(optim_cfg.get("schedule_steps", 0) or 0) or int(train_steps)


def clip_by_group_norm(max_norm: float) -> optax.GradientTransformation:
    """``clip_by_global_norm`` on each top-level entry of a dict of gradients (ConFu: 'draft' and
    'confu') on its own. Why: one global norm couples the groups — a loss that reaches only one of
    them (the auxiliary future loss, the contemplate path alone) with gradients 10-30x the draft's
    shrinks the draft's update by that factor too (docs/RESULTS.md "A direct training signal for the
    future"). Not a dict: the global clip."""
    inner = optax.clip_by_global_norm(float(max_norm))

    def init(params):
        return inner.init(params)

    def update(updates, state, params=None):
        if not isinstance(updates, dict):
            return inner.update(updates, state, params)
        return {k: inner.update(v, inner.init(v))[0] for k, v in updates.items()}, state

    return optax.GradientTransformation(init, update)


OPTIMIZERS = ("adamw", "muon")
# 2-D parameters that stay with AdamW under Muon: vocabulary-sized matrices (speculators' _ADAMW_NAME_HINTS)
MUON_EXCLUDED = ("lm_head", "embed")


def is_muon_matrix(path, p) -> bool:
    """Whether Muon orthogonalises this parameter: 2-D, both sides > 1, not a vocabulary matrix (else AdamW)."""
    name = jax.tree_util.keystr(path)
    return getattr(p, "ndim", 0) == 2 and min(p.shape) > 1 and not any(h in name for h in MUON_EXCLUDED)


def _torch_nesterov(momentum: float) -> optax.GradientTransformation:
    """torch.optim.Muon's momentum: buf ← m·buf + (1 − m)·g, update (1 − m)·g + m·buf (no bias correction;
    optax's muon corrects the bias, which weighs the early steps' momentum differently)."""
    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def update(updates, buf, params=None):
        del params
        buf = jax.tree_util.tree_map(lambda b, g: momentum * b + (1 - momentum) * g, buf, updates)
        return jax.tree_util.tree_map(lambda b, g: (1 - momentum) * g + momentum * b, buf, updates), buf

    return optax.GradientTransformation(init, update)


NS_COEFFS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


def _newton_schulz(g, steps: int = 5, eps: float = 1e-7):
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` in float32 (torch runs it in bf16): the update's
    nearest semi-orthogonal matrix, approximately; optax's own is private API."""
    a, b, c = NS_COEFFS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / jnp.maximum(jnp.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _orthogonalize_match_rms_adamw() -> optax.GradientTransformation:
    """Newton-Schulz, then torch's ``adjust_lr_fn='match_rms_adamw'``: × 0.2·sqrt(max(fan_in, fan_out))."""
    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map(lambda u: _newton_schulz(u) * (0.2 * max(u.shape) ** 0.5), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _muon(optim_cfg, schedule) -> optax.GradientTransformation:
    """speculators' optimizer pair: torch.optim.Muon (Nesterov momentum, 5 Newton-Schulz steps, the update
    scaled to AdamW's RMS, decoupled weight decay ``muon_weight_decay``) on :func:`muon_dimensions`' matrices,
    torch.optim.AdamW (``b1``, ``b2``, ``eps``, ``weight_decay`` on every parameter) on the rest."""
    muon = optax.chain(
        _torch_nesterov(float(optim_cfg.get("muon_momentum", 0.95))),
        _orthogonalize_match_rms_adamw(),
        optax.add_decayed_weights(float(optim_cfg.get("muon_weight_decay", 0.1))),
        optax.scale_by_learning_rate(schedule))
    adamw = optax.adamw(learning_rate=schedule, b1=float(optim_cfg.b1), b2=float(optim_cfg.b2),
                        eps=float(optim_cfg.eps), weight_decay=float(optim_cfg.weight_decay))

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda path, p: "muon" if is_muon_matrix(path, p) else "adamw", params)

    return optax.multi_transform({"muon": muon, "adamw": adamw}, labels)


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (or Muon: ``optim.name``) on the schedule of ``schedule_length(optim_cfg, total_steps)``
    (``total_steps``: train.steps)."""
    schedule = make_schedule(optim_cfg, schedule_length(optim_cfg, total_steps))
    name = str(optim_cfg.get("name", "adamw"))
    if name not in OPTIMIZERS:
        raise ValueError(f"train.optim.name: expected one of {OPTIMIZERS}, got {name!r}")
    parts = []
    if optim_cfg.clip_norm and optim_cfg.clip_norm > 0:
        clip = clip_by_group_norm if optim_cfg.get("clip_per_group", False) else optax.clip_by_global_norm
        parts.append(clip(float(optim_cfg.clip_norm)))
    if name == "muon":
        parts.append(_muon(optim_cfg, schedule))
        return optax.chain(*parts), schedule
    parts.append(optax.adamw(
        learning_rate=schedule,
        b1=float(optim_cfg.b1),
        b2=float(optim_cfg.b2),
        eps=float(optim_cfg.eps),
        weight_decay=float(optim_cfg.weight_decay),
        mask=_decay_mask,
    ))
    return optax.chain(*parts), schedule
