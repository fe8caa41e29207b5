"""Random tiny target, DeepSeek-V3's MTP module (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.mtp_task import apply_mtp_defaults


def get_config():
    config = apply_mtp_defaults(base_config("tiny", "eagle3"))
    config.mtp.num_depths = 3
    config.train.optim.lr = 1e-2
    return config
