#!/usr/bin/env bash
# ConFu continued from the released EAGLE-3 head (docs/RESULTS.md "The first released ConFu head"),
# then, for an equal-budget comparison, EAGLE-3 continued from the same head for the same steps.
# Both resume if interrupted (re-run the script). Rows 4 x 1024 packed, both data releases.
set -euo pipefail
cd "$(dirname "$0")/.."
common="--config.data.train_files=releases/data/sharegpt_smollm2,releases/data/sharegpt_smollm2_gpu \
 --config.data.max_length=1024 --config.data.global_batch_size=4 --config.data.pack=True \
 --config.draft.draft_vocab_size=4096 --config.data.draft_vocab_size=4096 --config.draft.ttt_steps=4 \
 --config.train.checkpoint.init_from=releases/heads/smollm2_eagle3 \
 --config.train.optim.lr=0.0006 --config.train.optim.warmup_steps=10 --config.train.steps=100 \
 --config.train.checkpoint.every=25 --config.train.checkpoint.keep=2 --config.train.log_every=5 \
 --config.train.eval_every=50 --config.train.progress_bar=False"
nice -n 5 python -m launch.train --config configs/smollm2_confu.py --workdir runs/confu_cpu $common \
    --config.objective.k_train=120
nice -n 5 python -m launch.train --config configs/smollm2_eagle3.py --workdir runs/e3_ctrl_cpu $common
