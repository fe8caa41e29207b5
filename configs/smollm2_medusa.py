"""SmolLM2-135M-Instruct target, Medusa-1 heads (frozen target; runs on CPU).

Four heads of one ResBlock each, every LM head initialised from the target's (49152 x 576 each:
28M parameters per head), CE on the data's tokens weighted 0.8^k (Medusa-1; ``config.medusa.distill``
for the target's soft labels). Train on self-distilled data, as the Medusa recipe does:
``--config.data.train_files=<generate_data output or a releases/data folder>``. Reference settings
(FasterDecoding/Medusa README, Vicuna-7B): lr 1e-3, cosine, warm-up 40 steps, 2 epochs of ShareGPT.
"""

from configs.common import base_config
from confu_jax.train.medusa_task import apply_medusa_defaults


def get_config():
    config = apply_medusa_defaults(base_config("smollm2-135m", "eagle3"))
    config.medusa.num_heads = 4
    config.medusa.num_layers = 1
    config.data.max_length = 512
    config.data.global_batch_size = 16
    config.train.optim.lr = 1e-3
    config.train.optim.warmup_steps = 100
    config.train.steps = 20000
    config.objective.eval_batches = 2
    return config
