"""Random tiny target, an MLP speculator (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.mlp_speculator_task import apply_mlp_speculator_defaults


def get_config():
    config = apply_mlp_speculator_defaults(base_config("tiny", "eagle3"))
    config.mlp_speculator.n_predict = 3
    config.train.optim.lr = 1e-2
    return config
