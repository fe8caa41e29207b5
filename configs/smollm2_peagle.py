"""SmolLM2-135M-Instruct target, a P-EAGLE head (runs on CPU): EAGLE-3's head drafting every depth in one
pass, trained on COD rollouts (``confu_jax.train.peagle_task``); decode it with ``--method peagle`` and any
plan (``ddtree:N[,D]`` included), export it with ``launch.export_head --format peagle`` (speculators' layout,
what vLLM's ``eagle3`` proposer serves with parallel drafting).

The mask token is SmolLM2's ``<|endoftext|>`` (id 0), which never appears inside a conversation."""

from configs.common import base_config
from confu_jax.train.peagle_task import apply_peagle_defaults


def get_config():
    config = apply_peagle_defaults(base_config("smollm2-135m", "peagle"))
    config.draft.mask_token_id = 0
    return config
