"""Random tiny target, a P-EAGLE head (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.peagle_task import apply_peagle_defaults


def get_config():
    config = apply_peagle_defaults(base_config("tiny", "peagle"))
    config.draft.mask_token_id = 127
    config.peagle.num_depths = 4
    config.peagle.num_anchors = 8
    config.train.optim.lr = 1e-2
    return config
