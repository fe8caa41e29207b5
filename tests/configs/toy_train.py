"""Config for the machinery tests: the toy task (tests.helpers.toy_task) on the random 'tiny' target."""

from tests.helpers.toy_task import get_toy_config


def get_config():
    return get_toy_config()
