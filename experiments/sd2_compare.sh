#!/bin/bash
# SD² against its unsteered drafters on SmolLM2-135M (docs/RESULTS.md "SD²").
#
#   bash experiments/sd2_compare.sh train_sd2 train_distill bench_sd2 bench_distill compare
#
# Drafter: self:8 (the target's first 8 of 30 layers + its final norm and LM head). Three drafters:
#   pretrained  — self:8 as it is (no training);
#   distilled   — self:8 fine-tuned on KL(target || drafter) over the released self-distilled data
#                 (config.sd2.steer=False: the paper's "distilled" baseline);
#   SD²         — the same fine-tuning with the steering vector (the paper's method).
# Both trainings: same data, steps, batch, lr schedule and seed; only the steering differs.
# Every stage resumes: launch.train from its last checkpoint, decode_bench from <out>.parts.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-400}
OUT=${OUT:-docs/results}
DATA=${DATA:-releases/data/sharegpt_smollm2}
TRAIN=(--config configs/smollm2_sd2.py --config.data.train_files=$DATA --config.data.global_batch_size=8
  --config.train.steps=$STEPS --config.train.optim.lr=1e-4 --config.train.optim.warmup_steps=20
  --config.train.log_every=10 --config.train.eval_every=100 --config.objective.eval_batches=2
  --config.train.checkpoint.every=25 --config.train.checkpoint.keep=2 --config.train.progress_bar=False
  --config.train.checkpoint.async_save=False)
BENCH=(--prompts mtbench --n_per_category 3 --max_new_tokens 128 --resume)

for stage in "$@"; do
  case $stage in
    train_sd2) nice python -m launch.train --workdir runs/smollm2_sd2 "${TRAIN[@]}" ;;
    train_distill) nice python -m launch.train --workdir runs/smollm2_distill "${TRAIN[@]}" --config.sd2.steer=False ;;
    # greedy: chain drafts; T = 1: sampled chains (q = the drafter's distribution, Leviathan's rule)
    bench_sd2)
      python -m launch.decode_bench --methods ar,draft_model,sd2 --heads draft_model=self:8,sd2=runs/smollm2_sd2 \
        "${BENCH[@]}" --temperatures 0 --budgets chain:4 --out $OUT/sd2_T0.json
      python -m launch.decode_bench --methods ar,draft_model,sd2 --heads draft_model=self:8,sd2=runs/smollm2_sd2 \
        "${BENCH[@]}" --temperatures 1 --budgets sampled_chain:4 --out $OUT/sd2_T1.json ;;
    bench_distill)
      python -m launch.decode_bench --methods ar,draft_model --heads draft_model=runs/smollm2_distill \
        "${BENCH[@]}" --temperatures 0 --budgets chain:4 --out $OUT/sd2_distill_T0.json
      python -m launch.decode_bench --methods ar,draft_model --heads draft_model=runs/smollm2_distill \
        "${BENCH[@]}" --temperatures 1 --budgets sampled_chain:4 --out $OUT/sd2_distill_T1.json ;;
    compare)
      for t in 0 1; do
        python -m launch.tau_compare --row $OUT/sd2_T$t.json:sd2 --reference $OUT/sd2_distill_T$t.json:draft_model \
          --temperature $t --json_out $OUT/sd2_vs_distilled_T$t.json
        python -m launch.tau_compare --row $OUT/sd2_T$t.json:sd2 --reference $OUT/sd2_T$t.json:draft_model \
          --temperature $t --json_out $OUT/sd2_vs_pretrained_T$t.json
      done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
