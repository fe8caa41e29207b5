"""AdamW + linear warm-up + cosine decay + global-norm clipping, built from ``config.train.optim``.

Weight decay skips 1-D parameters (norm scales, biases) as is customary; the mask is a function of
the tree so the same optimizer serves every draft variant.
"""

from __future__ import annotations

import jax
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


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on the schedule of ``schedule_length(optim_cfg, total_steps)`` (``total_steps``: train.steps)."""
    schedule = make_schedule(optim_cfg, schedule_length(optim_cfg, total_steps))
    parts = []
    if optim_cfg.clip_norm and optim_cfg.clip_norm > 0:
        clip = clip_by_group_norm if optim_cfg.get("clip_per_group", False) else optax.clip_by_global_norm
        parts.append(clip(float(optim_cfg.clip_norm)))
    parts.append(optax.adamw(
        learning_rate=schedule,
        b1=float(optim_cfg.b1),
        b2=float(optim_cfg.b2),
        eps=float(optim_cfg.eps),
        weight_decay=float(optim_cfg.weight_decay),
        mask=_decay_mask,
    ))
    return optax.chain(*parts), schedule
