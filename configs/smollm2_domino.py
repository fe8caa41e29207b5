"""SmolLM2-135M-Instruct target, a Domino draft (runs on CPU): DFlash's block backbone (3 layers of the target's
shape, blocks of 16 slots that each draft the next token) with SpecForge's GRU correction (a GRU of 1024 over the
block's tokens, a projection through 256, the anchor slot uncorrected), trained on the tokens with the base loss's
weight decaying to 0 over the run (``confu_jax.train.domino_task``; SpecForge's Qwen3-8B recipe's settings).
Decode with ``--method domino --plan chain:K``.

The mask token is SmolLM2's ``<|endoftext|>`` (id 0), which never appears inside a conversation; 64 blocks a
row keep the [rows, 64, 16, 49152] logits of a step within this machine's memory."""

from configs.common import base_config
from confu_jax.train.domino_task import apply_domino_defaults


def get_config():
    config = apply_domino_defaults(base_config("smollm2-135m", "eagle3"))
    config.domino.mask_token_id = 0
    config.domino.num_anchors = 64
    return config
