"""Defaults of the ``train`` sub-config (mesh, optimizer, schedule, checkpoints, logging).

Optimizer defaults follow the EAGLE family, since ConFu "adopts the same training objective" and
is trained "under identical optimization settings" as EAGLE-3 (paper §3.3/§4): AdamW with
β = (0.9, 0.95) and gradient clipping at 0.5 (EAGLE's ``train/main.py`` train_config), peak lr 1e-4
with 2 % linear warm-up and cosine decay (SpecForge ``scripts/train_eagle3_online.py``).
"""

from __future__ import annotations

import ml_collections


def default_train_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # what builds a confu_jax.train.task.TrainTask from the full config (the model, the objective and
    # the data): a family's name in confu_jax.train.tasks.TASKS, or "package.module:function" for a
    # task outside the package. The loop knows nothing else about what it trains.
    c.task = "head"
    c.seed = 0
    c.steps = 1000

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = all devices left after fsdp × tensor
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.optim = ml_collections.ConfigDict()
    # 'adamw', or 'muon': speculators 0.9's Muon on the 2-D weights + AdamW on the rest (train.optim); b1, b2,
    # eps and weight_decay are then its AdamW group's, muon_* its Muon group's
    c.optim.name = "adamw"
    c.optim.muon_momentum = 0.95
    c.optim.muon_weight_decay = 0.1
    c.optim.lr = 1e-4
    c.optim.warmup_steps = -1  # -1: warmup_ratio × steps
    c.optim.warmup_ratio = 0.02
    c.optim.end_lr_ratio = 0.0  # cosine floor as a fraction of lr
    # Length of the warm-up + cosine schedule; 0 = train.steps. Set it to stop a run on a longer
    # recipe's exact schedule (heads compared at step 100 of a 200-step recipe) or to change
    # train.steps on resume without changing the learning rate of the steps already planned.
    c.optim.schedule_steps = 0
    # 'cosine': warm-up, then cosine decay over the whole schedule. 'wsd' (warm-up, stable, decay):
    # the peak lr held until the last decay_ratio of the schedule, then a linear decay to
    # lr·end_lr_ratio — the long-run schedule whose every checkpoint before the decay sits at the
    # same lr (the points of a scaling curve), and which a run extends by moving schedule_steps.
    c.optim.schedule = "cosine"
    c.optim.decay_ratio = 0.2
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0
    c.optim.clip_norm = 0.5  # <= 0 disables clipping
    # True: clip each top-level parameter group ('draft', 'confu') to clip_norm on its own instead of
    # one global norm (train.optim.clip_by_group_norm)
    c.optim.clip_per_group = False

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 500  # steps; <= 0 saves only at the end and on preemption
    # Also save when this many seconds passed since the last save (process 0's clock, agreed by every
    # process): bounds what a preemption without a signal loses (a Cloud TPU maintenance event on a
    # TPU not created for autocheckpointing, a SIGKILL). <= 0: step-based saves only.
    c.checkpoint.every_seconds = 1800.0
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    # Initialise the trainable params from another run's checkpoint (e.g. ConFu from EAGLE-3):
    # params present in both trees with equal shapes are copied, the rest keep their fresh init.
    c.checkpoint.init_from = ""  # a launch.train workdir or its checkpoints/, an EAGLE-3 head, a release; '' = none
    c.checkpoint.init_from_step = -1  # -1 = latest

    c.log_every = 10
    c.eval_every = 100  # <= 0 disables held-out evaluation
    # Steps at which the run also evaluates and saves a checkpoint that is never pruned, e.g.
    # '8,16,32,64,128' (tokens seen doubling): the points of launch.scaling_curve. '' = none.
    c.milestones = ""
    c.tensorboard = "auto"  # 'auto' (if tensorboardX/tensorflow importable) | 'on' | 'off'
    c.progress_bar = True
    # 'A:B': write a profiler trace (TensorBoard / Perfetto: <workdir>/profile) of steps A..B; '' = none.
    c.profile_steps = ""
    # Each process writes <workdir>/records/process_<i>-of-<n>.csv: the record_index of every row it
    # trained on, per step (unpacked rows; packed rows carry none) — an audit of what the run read.
    c.log_records = False
    return c
