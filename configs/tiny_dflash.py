"""Random tiny target, a DFlash block-diffusion draft (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.dflash_task import apply_dflash_defaults


def get_config():
    config = apply_dflash_defaults(base_config("tiny", "eagle3"))
    config.dflash.num_layers = 2
    config.dflash.block_size = 4
    config.dflash.mask_token_id = 127
    config.dflash.num_anchors = 8
    config.dflash.loss_decay_gamma = 4.0
    config.train.optim.lr = 1e-2
    return config
