"""SmolLM2-135M-Instruct target, a DSpark draft (runs on CPU): DFlash's block backbone (3 layers of the target's
shape, blocks of 16 slots that each draft the next token), a vanilla Markov head of rank 256 and a confidence
head, trained on the frozen target's distribution (``confu_jax.train.dspark_task``). Decode with
``--method dspark --plan chain:K`` or ``chain:K@P`` (the confidence head sets each row's verification length).

The mask token is SmolLM2's ``<|endoftext|>`` (id 0), which never appears inside a conversation; 64 blocks a
row keep the [rows, 64, 16, 49152] logits of a step within this machine's memory."""

from configs.common import base_config
from confu_jax.train.dspark_task import apply_dspark_defaults


def get_config():
    config = apply_dspark_defaults(base_config("smollm2-135m", "eagle3"))
    config.dspark.mask_token_id = 0
    config.dspark.num_anchors = 64
    return config
