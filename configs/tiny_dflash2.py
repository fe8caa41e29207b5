"""Random tiny target, a DFlash2 draft (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.dflash2_task import apply_dflash2_defaults


def get_config():
    config = apply_dflash2_defaults(base_config("tiny", "eagle3"))
    config.dflash2.num_layers = 2
    config.dflash2.block_size = 4
    config.dflash2.mask_token_id = 127
    config.dflash2.num_anchors = 8
    config.dflash2.anchor_chunk = 4  # two chunks: the compile lane and the training contract take the chunked path
    config.dflash2.conv_group_size = 8
    config.dflash2.selector_rank = 16
    config.dflash2.selector_top_k = 8
    config.train.optim.lr = 1e-2
    return config
