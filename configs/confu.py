"""A ConFu head for any Llama / Qwen2 / Qwen3 checkpoint: the checkpoint decides the architecture.

    python -m launch.train --config configs/confu.py --workdir runs/my_confu \\
        --config.model.source=/path/to/checkpoint --config.data.train_files=data/train.jsonl \\
        --config.train.checkpoint.init_from=runs/my_eagle3

Everything configs/eagle3.py says about the checkpoint holds here; ``init_from`` an EAGLE-3 run
is the paper's protocol (ConFu from EAGLE-3's midpoint). A ConFu ablation: ``configs/confu.py:confu_nomoe``.
"""

from configs.common import base_config


def get_config(variant: str = "confu"):
    return base_config(None, variant or "confu")
