"""Random tiny target, a JetSpec draft: configs/tiny_dflash.py's block draft with a causal head (tests and smoke
runs; self-distilled random data)."""

from configs import tiny_dflash
from confu_jax.train.dflash_task import apply_jetspec_defaults


def get_config():
    return apply_jetspec_defaults(tiny_dflash.get_config())
