"""SmolLM2-135M-Instruct target, a DFlash block-diffusion draft (frozen target; runs on CPU).

Three draft layers of SmolLM2's shape (576 wide, 9 query / 3 KV heads, SwiGLU 1536, plus per-head q / k
norms: 3 x 3.5M parameters) and fc 3 x 576 -> 576 over the taps of target layers 1, 14 and 27 (the
reference's ``build_target_layer_ids(30, 3)``; taps 2, 15, 28), the target's embedding and LM head.
Blocks of 16 (the published drafters' ``block_size``; decode with ``chain:15`` or shorter), loss decay
γ = 7 (SpecForge's setting for 16). The mask token is id 3 (``<repo_name>``, one of SmolLM2's code
special tokens, never in chat data: like the reference's Qwen3 mask, a row of the target's embedding the
text never uses). 32 anchors a row of 512 tokens (SpecForge uses 512 a row of ~3k on GPUs). The task
handles packed rows (anchors, context and labels within one conversation) but that path is not yet tested
against padded rows. Train on self-distilled data:
``--config.data.train_files=<generate_data output or a releases/data folder>``.
"""

from configs.common import base_config
from confu_jax.train.dflash_task import apply_dflash_defaults


def get_config():
    config = apply_dflash_defaults(base_config("smollm2-135m", "eagle3"))
    config.dflash.num_layers = 3
    config.dflash.block_size = 16
    config.dflash.mask_token_id = 3
    config.dflash.num_anchors = 32
    config.dflash.loss_decay_gamma = 7.0
    config.data.max_length = 512
    config.data.global_batch_size = 16
    config.train.optim.lr = 6e-4
    config.train.optim.warmup_steps = 100
    config.train.steps = 20000
    config.objective.eval_batches = 2
    return config
