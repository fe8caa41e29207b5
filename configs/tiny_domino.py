"""Random tiny target, a Domino draft (tests and smoke runs; self-distilled random data)."""

from configs.common import base_config
from confu_jax.train.domino_task import apply_domino_defaults


def get_config():
    config = apply_domino_defaults(base_config("tiny", "eagle3"))
    config.domino.num_layers = 2
    config.domino.block_size = 4
    config.domino.mask_token_id = 127
    config.domino.num_anchors = 8
    config.domino.anchor_chunk = 4  # two chunks: the compile lane and the training contract take the chunked path
    config.domino.gru_hidden_dim = 32
    config.domino.emb_dim = 16
    config.train.optim.lr = 1e-2
    return config
