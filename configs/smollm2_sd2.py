"""SmolLM2-135M-Instruct target, SD² (steered draft model) on the early-exit self-drafter (runs on CPU).

The drafter is the target's first 8 of 30 layers with its final norm and LM head (``self:8``; any
draft model sharing the tokenizer: ``--config.sd2.drafter=/path/to/model``). Train on self-distilled
data (the paper trains on the verifier's own samples): ``--config.data.train_files=<generate_data
output or a releases/data folder>``. Paper settings (Appendix A.4): AdamW, cosine schedule, 1,000
warm-up steps, clip 0.5, lr 1e-5..5e-5, sequences of 256 tokens, batch 24.
"""

from configs.common import base_config
from confu_jax.train.sd2_task import apply_sd2_defaults


def get_config():
    config = apply_sd2_defaults(base_config("smollm2-135m", "eagle3"), drafter="self:8")
    config.sd2.max_offset = 4
    config.data.max_length = 256
    config.data.global_batch_size = 24
    config.train.optim.lr = 5e-5
    config.train.optim.warmup_steps = 1000
    config.train.steps = 20000
    config.objective.eval_batches = 2
    return config
