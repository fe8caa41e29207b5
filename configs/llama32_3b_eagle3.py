"""Llama-3.2-3B-Instruct target (the paper's), eagle3 draft head. Pass weights with --config.model.source=/path."""

from configs.common import base_config


def get_config():
    return base_config("llama-3.2-3b", "eagle3")
