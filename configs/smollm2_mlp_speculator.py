"""SmolLM2-135M-Instruct target, IBM's MLP speculator (frozen target; runs on CPU).

Four stages of width 576 (inner_dim 0 = the target's), weights tied across stages and the input
scaled (``tie_weights`` / ``scale_input``: IBM fms-fsdp's speculator training defaults,
``fms_fsdp/config/training.py``): one shared embedding and LM head of 49152 x 576 each (57M
parameters), where untied stages would hold four of each. Per-stage CE summed (the reference's
stage-1 objective). Train on self-distilled data:
``--config.data.train_files=<generate_data output or a releases/data folder>``. Reference settings
(fms-fsdp ``scripts/train_speculator.sh``, Llama-2-7B): lr 1e-3, 3 stages, 21000 steps.
"""

from configs.common import base_config
from confu_jax.train.mlp_speculator_task import apply_mlp_speculator_defaults


def get_config():
    config = apply_mlp_speculator_defaults(base_config("smollm2-135m", "eagle3"))
    config.mlp_speculator.n_predict = 4
    config.mlp_speculator.inner_dim = 0
    config.mlp_speculator.tie_weights = True
    config.mlp_speculator.scale_input = True
    config.data.max_length = 512
    config.data.global_batch_size = 16
    config.train.optim.lr = 1e-3
    config.train.optim.warmup_steps = 100
    config.train.steps = 20000
    config.objective.eval_batches = 2
    return config
