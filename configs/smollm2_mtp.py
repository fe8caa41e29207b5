"""SmolLM2-135M-Instruct target, DeepSeek-V3's MTP module (frozen target; runs on CPU).

One Llama decoder layer of SmolLM2's shape (576 wide, 9 query / 3 KV heads, SwiGLU 1536: 3.5M
parameters, plus eh_proj 2 x 576 -> 576 and three norms), started from the target's last layer, over
[enorm(Emb(x[i+k])) ; hnorm(h)], with the target's embedding and LM head. Trained recursively over 3
depths with the report's objective (CE averaged over depths, x λ = 0.3). Packed rows, as the EAGLE-3
configs can: ``--config.data.pack=true``. Train on self-distilled data:
``--config.data.train_files=<generate_data output or a releases/data folder>``.
"""

from configs.common import base_config
from confu_jax.train.mtp_task import apply_mtp_defaults


def get_config():
    config = apply_mtp_defaults(base_config("smollm2-135m", "eagle3"))
    config.mtp.num_depths = 3
    config.data.max_length = 512
    config.data.global_batch_size = 16
    config.train.optim.lr = 1e-3
    config.train.optim.warmup_steps = 100
    config.train.steps = 20000
    config.objective.eval_batches = 2
    return config
