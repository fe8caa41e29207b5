"""Random tiny target, Medusa-1 heads (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.medusa_task import apply_medusa_defaults


def get_config():
    config = apply_medusa_defaults(base_config("tiny", "eagle3"))
    config.medusa.num_heads = 3
    config.train.optim.lr = 1e-2
    return config
