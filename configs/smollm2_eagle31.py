"""SmolLM2-135M-Instruct target, an EAGLE 3.1 draft head (runs on CPU).

EAGLE 3.1 is EAGLE-3 with speculators' two norm flags on (vLLM's ``eagle3`` reads both from the head's
config): ``fc_norm``, one RMSNorm per tapped target layer before ``fc`` (the three taps' scales differ by
orders of magnitude), and ``norm_output``, the draft layer's final-normed state fed back as the next step's
hidden state and read as is by the LM head. ``launch.export_head --format speculators`` writes both flags and
the ``fc_norm.{i}.weight`` tensors; the official (SGLang / SpecForge) layout cannot carry them and refuses.
"""

from configs.common import base_config


def get_config():
    config = base_config("smollm2-135m", "eagle3")
    config.draft.fc_norm = True
    config.draft.norm_output = True
    return config
