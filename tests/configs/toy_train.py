"""Config for the machinery tests: the toy task (confu_jax.train.toy) on the random 'tiny' target."""

from confu_jax.train.toy import get_toy_config


def get_config():
    return get_toy_config()
