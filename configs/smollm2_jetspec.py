"""SmolLM2-135M-Instruct target, a JetSpec draft (frozen target; runs on CPU): configs/smollm2_dflash.py's
draft and objective (3 layers of SmolLM2's shape over target layers 1, 14, 27; blocks of 16, γ = 7; mask
token id 3) with JetSpec's causal head (``dflash.causal_head``: block position k sees positions 0..k).
Decode with ``--method jetspec`` and its tree ``accum_logp:N,W[,D]`` (D <= 15) or any DFlash plan.
Train on self-distilled data: ``--config.data.train_files=<generate_data output or a releases/data folder>``.
"""

from configs import smollm2_dflash
from confu_jax.train.dflash_task import apply_jetspec_defaults


def get_config():
    return apply_jetspec_defaults(smollm2_dflash.get_config())
