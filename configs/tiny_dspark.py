"""Random tiny target, a DSpark draft (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.dspark_task import apply_dspark_defaults


def get_config():
    config = apply_dspark_defaults(base_config("tiny", "eagle3"))
    config.dspark.num_layers = 2
    config.dspark.block_size = 4
    config.dspark.mask_token_id = 127
    config.dspark.num_anchors = 8
    config.dspark.markov_rank = 16
    config.train.optim.lr = 1e-2
    return config
