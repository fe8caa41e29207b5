"""Random tiny target for tests; the variant is the config parameter: ``configs/tiny.py:eagle3``."""

from configs.common import base_config


def get_config(variant: str = "confu"):
    return base_config("tiny", variant or "confu")
