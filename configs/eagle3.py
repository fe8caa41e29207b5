"""An EAGLE-3 head for any Llama / Qwen2 / Qwen3 checkpoint: the checkpoint decides the architecture.

    python -m launch.train --config configs/eagle3.py --workdir runs/my_eagle3 \\
        --config.model.source=/path/to/Llama-3.1-8B-Instruct --config.data.train_files=data/train.jsonl

Widths, heads, RoPE, vocabulary, tied embeddings, end-of-turn ids and dtype come from the checkpoint's
config.json (or GGUF header); the draft vocabulary is a quarter of the target's, at most 32000
(``--config.draft.draft_vocab_size`` overrides it). ``configs/confu.py`` is the ConFu head.
"""

from configs.common import base_config


def get_config():
    return base_config(None, "eagle3")
