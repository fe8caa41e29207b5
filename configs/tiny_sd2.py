"""Random tiny target, SD² on its first 2 layers (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.sd2_task import apply_sd2_defaults


def get_config():
    config = apply_sd2_defaults(base_config("tiny", "eagle3"), drafter="self:2")
    config.sd2.max_offset = 3
    config.train.optim.lr = 3e-3
    return config
