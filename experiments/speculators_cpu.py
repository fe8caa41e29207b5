"""speculators 0.9's own trainer (``speculators.train``) on a CPU, in one process: the reference trainer of
the trainer-parity runs (``experiments/trainer_parity.py``, docs/RESULTS.md "Trainer parity").

    python experiments/speculators_cpu.py --config cfg.yaml [--flag value ...]   # speculators train's flags

speculators trains on accelerators; nothing in its code path needs one but the places below, which this
wrapper patches at import time (it edits no file of the installed package). Each patch keeps the
reference's arithmetic; only where tensors live and which autocast device is named change:

1. ``speculators.train.trainer.get_local_rank`` -> ``"cpu"``: the trainer moves the model and every batch
   with ``.to(local_rank)`` (trainer.py ``.to(self.local_rank)``); rank 0 as a device index is the first
   accelerator, which a CPU host does not have ("Cannot access accelerator device when none is available").
2. ``torch.accelerator.synchronize`` -> no-op: the step timer synchronises the accelerator on every logged
   step (trainer.py ``_StepTimer``); on a CPU the call raises. CPU work is synchronous already.
3. ``Trainer.device_type`` = ``"cpu"`` after ``Trainer.__init__``: without an accelerator it falls back to
   ``"cuda"`` (trainer.py), and ``torch.autocast("cuda")`` then disables itself with a warning (a bf16 run's
   batches would meet fp32 weights). The parity runs keep float32 hidden states, where autocast changes
   nothing; the patch makes a bf16 run correct too.
4. ``speculators.train.checkpointer.get_current_device`` -> ``"cpu"``: on resume the optimizer state is
   mapped to ``"cuda:0"`` without an accelerator (utils/util.py), so a killed run could not resume.

Launch it as a plain process, never under ``torchrun``: with ``LOCAL_RANK`` set speculators initialises a
process group on the accelerator (distributed.py), and one process needs none. Settings a CPU needs, set in
the YAML (``trainer_parity.reference_config``): ``loss_implementation: eager`` (the fused loss is Triton),
``draft_attn_impl: sdpa`` (flex attention has no backward on the CPU), ``num_workers: 0`` (two cores).
"""

from __future__ import annotations

import os

PATCHES = (
    "speculators.train.trainer.get_local_rank -> 'cpu' (rank 0 as a device is an accelerator)",
    "torch.accelerator.synchronize -> no-op (the step timer's synchronise raises on a CPU)",
    "Trainer.device_type -> 'cpu' after __init__ (falls back to 'cuda'; autocast would disable itself)",
    "speculators.train.checkpointer.get_current_device -> 'cpu' (resume mapped optimizer state to 'cuda:0')",
)


def apply_cpu_patches() -> bool:
    """Patch the four places above when no accelerator is present -> whether anything was patched."""
    os.environ.pop("LOCAL_RANK", None)  # one process: speculators' non-distributed path
    import torch

    if torch.accelerator.is_available():
        return False
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    torch.accelerator.synchronize = lambda *a, **k: None
    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    init = trainer.Trainer.__init__
    if not getattr(init, "_confu_jax_cpu", False):
        def cpu_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.device_type = "cpu"

        cpu_init._confu_jax_cpu = True
        trainer.Trainer.__init__ = cpu_init
    return True


KILL_AFTER_SAVES = "CONFU_JAX_KILL_AFTER_SAVES"  # tests: die like a killed job after the N-th checkpoint


def _die_after_saves(n: int) -> None:
    """Exit at once (no cleanup, as SIGKILL would) after the ``n``-th checkpoint the trainer writes: the
    kill-and-resume test's fault, at a point it can name instead of a race with a timer."""
    import speculators.train.trainer as trainer

    save, count = trainer.Trainer.maybe_save_checkpoint, [0]

    def save_then_die(self, *args, **kwargs):
        out = save(self, *args, **kwargs)
        count[0] += 1
        if count[0] >= n:
            os._exit(137)
        return out

    trainer.Trainer.maybe_save_checkpoint = save_then_die


def main() -> None:
    apply_cpu_patches()
    if os.environ.get(KILL_AFTER_SAVES):
        _die_after_saves(int(os.environ[KILL_AFTER_SAVES]))
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve())


if __name__ == "__main__":
    main()
