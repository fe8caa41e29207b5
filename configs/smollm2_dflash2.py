"""SmolLM2-135M-Instruct target, a DFlash2 draft (runs on CPU): DFlash's block backbone (3 layers of the target's
shape, blocks of 16: the root and 15 masks) with grouped dynamic convolutions (2 taps, groups of 16 channels) and a
candidate selector of rank 256 reranking each slot's top 16 by the previous draft, trained on the frozen target's
distribution (``confu_jax.train.dflash2_task``; speculators 0.9's defaults). Decode with ``--method dflash2
--plan chain:K``.

The mask token is SmolLM2's ``<|endoftext|>`` (id 0), which never appears inside a conversation; 64 blocks a
row keep the [rows, 64, 16, 49152] logits of a step within this machine's memory."""

from configs.common import base_config
from confu_jax.train.dflash2_task import apply_dflash2_defaults


def get_config():
    config = apply_dflash2_defaults(base_config("smollm2-135m", "eagle3"))
    config.dflash2.mask_token_id = 0
    config.dflash2.num_anchors = 64
    return config
