"""SmolLM2-135M-Instruct target, confu_nomoe draft head (runs on CPU)."""

from configs.common import base_config


def get_config():
    return base_config("smollm2-135m", "confu_nomoe")
