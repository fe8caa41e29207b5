"""SmolLM2-135M-Instruct target, eagle3 draft head (runs on CPU)."""

from configs.common import base_config


def get_config():
    return base_config("smollm2-135m", "eagle3")
