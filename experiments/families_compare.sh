#!/usr/bin/env bash
# The drafter families compared at equal training compute, CPU scale: EAGLE-3, ConFu, Medusa-1, the MLP
# speculator, the MTP module and DFlash trained on the same batches (the repository's two data
# releases, padded rows so every family reads exactly the same tokens), then benchmarked side by
# side on MT-Bench and on held-out conversations (docs/RESULTS.md "Six drafter families at equal
# training compute").
#
#   bash experiments/families_compare.sh train    # background-friendly; resumes after a kill
#   bash experiments/families_compare.sh bench    # on a quiet CPU (nothing else running)
#   bash experiments/families_compare.sh table    # the RESULTS table and figure
#
# The drafters of 2026 on the same budget (docs/RESULTS.md "The drafters of 2026 at equal training compute"):
# EAGLE 3.1, P-EAGLE and DSpark beside EAGLE-3 and DFlash, each at step FAMILY_STEPS of the same schedule,
# decoded with chains and trees of equal node budgets at T = 0 and 1 on MT-Bench, the grounded set and
# held-out conversations:
#   bash experiments/families_compare.sh train2026   # background-friendly; resumes after a kill
#   bash experiments/families_compare.sh bench2026   # on a quiet CPU
#   bash experiments/families_compare.sh table2026   # docs/results/drafters2026.{md,json}
#
# The drafters of late 2026 on the same budget: JetSpec, DFlash2 and Domino trained by train2026's protocol (its
# batches, schedule and step; DFlash's 32 anchors a row), decoded with chain:3 and 8-node trees (DDTree's, and
# JetSpec's own one-pass accum_logp tree) at T = 0 and 1 on MT-Bench and the grounded set, and tabled beside the
# drafters of 2026 (their bench2026 results, paired by question: same prompts and seed):
#   bash experiments/families_compare.sh train_late2026   # ~50 min; resumes after a kill
#   bash experiments/families_compare.sh bench_late2026   # on a quiet CPU
#   bash experiments/families_compare.sh table_late2026   # docs/results/drafters_late2026.{md,json}
#
# D-PACE against DFlash's default objective (SpecForge's two DFlash losses; docs/training.md): DFlash trained
# again with --config.dflash.loss_type=dpace, everything else equal (the train2026 run's batches, schedule and
# step), both decoded on the same questions and compared paired by question (τ ratio dpace / default):
#   bash experiments/families_compare.sh dpace       # trains what is missing (~15 min each), then benches
#
# Budget: ROWS x LEN padded rows a step, one learning rate for all (the GPU campaign's), warm-up then
# cosine over E + P steps; every family starts from its reference initialisation (Medusa's and the MLP
# speculator's LM heads from the target's, MTP sharing the target's embedding and head).
# Two comparisons:
#   * the families at step FAMILY_STEPS (default E) of that E + P schedule, against EAGLE-3's checkpoint
#     at the same step: identical batches, identical learning rates (optim.schedule_steps). On 2 CPU
#     cores the four families' full-vocabulary heads cost 2-4x an EAGLE-3 step (4096-token draft
#     vocabulary), which is why they stop at E here; FAMILIES_FAMILY_STEPS=$((E + P)) runs them to the end;
#   * ConFu against EAGLE-3 after E + P steps, the paper's protocol (experiments/headline.sh,
#     experiments.gpu_campaign): ConFu starts from EAGLE-3's step E and trains P steps on its own schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${FAMILIES_OUT:-runs/families}
E=${FAMILIES_E:-100}
P=${FAMILIES_P:-100}
ROWS=${FAMILIES_ROWS:-4}
LEN=${FAMILIES_LEN:-512}
DATA=releases/data/sharegpt_smollm2,releases/data/sharegpt_smollm2_gpu
STEPS=$((E + P))
FAMILY_STEPS=${FAMILIES_FAMILY_STEPS:-$E}
mkdir -p "$OUT"

common="--config.data.train_files=$DATA --config.data.max_length=$LEN --config.data.global_batch_size=$ROWS \
 --config.data.pack=False --config.data.num_workers=0 \
 --config.draft.draft_vocab_size=4096 --config.data.draft_vocab_size=4096 --config.draft.ttt_steps=4 \
 --config.train.optim.lr=0.001 --config.train.optim.warmup_steps=10 \
 --config.train.checkpoint.every=$E --config.train.checkpoint.keep=100 --config.train.log_every=5 \
 --config.train.eval_every=0 --config.train.progress_bar=False --config.train.tensorboard=off"

train() {  # name config steps [extra flags]: skipped when its last checkpoint exists
    local name=$1 config=$2 steps=$3
    shift 3
    if [ -d "$OUT/$name/checkpoints/$steps" ]; then echo "$name: done"; return; fi
    echo "$name: $steps steps ($(date -u +%H:%M:%S))"
    /usr/bin/time -f "$name wall %e s" nice -n 5 python -m launch.train --config "$config" --workdir "$OUT/$name" \
        $common --config.train.steps="$steps" "$@" > "$OUT/$name.log" 2>&1
}

eagle3_at() {  # EAGLE-3 at the families' step: a workdir holding that checkpoint alone (decode loads the latest)
    local at="$OUT/eagle3_at_$FAMILY_STEPS"
    if [ "$FAMILY_STEPS" = "$STEPS" ]; then echo "$OUT/eagle3"; return; fi
    if [ ! -d "$at/checkpoints/$FAMILY_STEPS" ]; then
        mkdir -p "$at/checkpoints"
        cp "$OUT/eagle3/config.json" "$OUT/eagle3/target.json" "$at/"
        cp -r "$OUT/eagle3/checkpoints/$FAMILY_STEPS" "$at/checkpoints/"
    fi
    echo "$at"
}

case "${1:-train}" in
train)
    train eagle3 configs/smollm2_eagle3.py $STEPS
    train confu configs/smollm2_confu.py $P --config.objective.k_train=64 --config.confu.max_lag=4 \
        --config.train.checkpoint.init_from="$OUT/eagle3/checkpoints" --config.train.checkpoint.init_from_step=$E
    for family in medusa mlp_speculator mtp dflash; do
        train $family configs/smollm2_$family.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS
    done
    ;;
train2026)
    # EAGLE-3 to the families' step of the same schedule: the first FAMILY_STEPS steps of `train`'s run (which
    # resumes from here), so both comparisons share it
    train eagle3 configs/smollm2_eagle3.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS
    for family in eagle31 dflash peagle; do
        train $family configs/smollm2_$family.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS
    done
    # DSpark on DFlash's 32 anchors a row (its config's 64 cost 26 s a step here, 3.5x DFlash's): the same blocks
    # of the same backbone, so the difference is what DSpark adds (the Markov and confidence heads, every slot
    # drafting the next token)
    train dspark configs/smollm2_dspark.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS \
        --config.dspark.num_anchors=32
    ;;
train_late2026)
    # JetSpec is DFlash's config with a causal head (32 anchors already); DFlash2's and Domino's configs draw 64
    # blocks a row, set to DFlash's 32 so all read the same blocks. Domino's base-loss weight decays over
    # train.steps (SpecForge's linear_lambda_base): ratio 2 makes it reach 0 at the schedule's end, step STEPS,
    # as it would in the 200-step run these 100 steps are the first half of
    train jetspec configs/smollm2_jetspec.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS
    train domino configs/smollm2_domino.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS \
        --config.domino.num_anchors=32 --config.domino.lambda_base_decay_ratio=$(python -c "print($STEPS / $FAMILY_STEPS)")
    train dflash2 configs/smollm2_dflash2.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS \
        --config.dflash2.num_anchors=32
    ;;
bench_late2026)
    # one run a set (its own AR row): chain:3, DDTree's 8-node tree for all three, JetSpec's own 8-node tree of
    # fan-out 4 and depth 3 (accum_logp: DFlash2 and Domino condition each slot on the draft before it, so they
    # skip it)
    T=${FAMILIES_TOKENS:-64}
    for set in ${FAMILIES_SETS:-mtbench:2 grounded:2}; do
        IFS=: read -r name n <<< "$set"
        nice -n 5 python -m launch.decode_bench --methods ar,jetspec,dflash2,domino \
            --heads "jetspec=$OUT/jetspec,dflash2=$OUT/dflash2,domino=$OUT/domino" \
            --budgets chain:3,ddtree:8,3,accum_logp:8,4,3 --prompts "$name" --n_per_category "$n" \
            --temperatures 0,1 --max_new_tokens "$T" --out "docs/results/drafters_late2026_${name}.json"
    done
    ;;
table_late2026)
    args=()
    for name in mtbench grounded; do
        [ -f "docs/results/drafters_late2026_${name}.json" ] || continue
        args+=(--results "$name=docs/results/drafters2026_${name}_eagle3.json"
               --results "$name=docs/results/drafters2026_${name}_block.json"
               --results "$name=docs/results/drafters_late2026_${name}.json")
    done
    python -m launch.families_table --runs "$OUT" --methods eagle3,peagle,dflash,dspark,jetspec,dflash2,domino \
        --training_from docs/results/drafters2026.json --at_step eagle3=$FAMILY_STEPS "${args[@]}" \
        --out docs/results/drafters_late2026
    ;;
dpace)
    train dflash configs/smollm2_dflash.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS
    train dflash_dpace configs/smollm2_dflash.py $FAMILY_STEPS --config.train.optim.schedule_steps=$STEPS \
        --config.dflash.loss_type=dpace
    mkdir -p "$OUT/dpace"
    for prompts in mtbench grounded; do
        for head in dflash dflash_dpace; do
            res="$OUT/dpace/${head}_${prompts}.json"
            [ -f "$res" ] || nice -n 5 python -m launch.decode_bench --methods ar,dflash --heads "dflash=$OUT/$head" \
                --budgets chain:3,ddtree:8,3 --temperatures 0,1 --prompts "$prompts" --n_per_category 2 \
                --max_new_tokens "${FAMILIES_TOKENS:-64}" --out "$res"
        done
        for budget in chain:3 ddtree:8,3; do
            for t in 0 1; do
                python -m launch.tau_compare --row "$OUT/dpace/dflash_dpace_${prompts}.json:dflash" \
                    --reference "$OUT/dpace/dflash_${prompts}.json:dflash" --temperature "$t" --budget "$budget" \
                    --json_out "$OUT/dpace/compare_${prompts}_${budget//[:,]/_}_T$t.json"
            done
        done
    done
    ;;
bench2026)
    # equal node budgets: EAGLE-3's best-first tree of 8 nodes over depth 3 (dynamic:3,4,8) against DDTree's over
    # the block drafters' per-position top-k (ddtree:8,3); three runs a set, each with its own AR row (the speed-
    # up's baseline): EAGLE-3, EAGLE 3.1 (an eagle3 head too, so a run of its own) and the block drafters. τ
    # ratios pair questions across runs (same prompts and seed)
    python -m launch.heldout_questions --data "$DATA" --n 8 --out "$OUT/heldout.jsonl"
    T=${FAMILIES_TOKENS:-64}
    bench26() {  # results-name methods heads budgets prompts n_per_category temperatures
        python -m launch.decode_bench --methods "$2" --heads "$3" --budgets "$4" --prompts "$5" --n_per_category "$6" \
            --temperatures "$7" --max_new_tokens "$T" --out "docs/results/drafters2026_$1.json"
    }
    # NAME:N_PER_CATEGORY:TEMPERATURES:PLANS; held-out conversations (the training distribution: the release
    # criterion) at T = 0 with chains only; FAMILIES_SETS picks others (RESULTS ran the grounded set at T = 0 only)
    for set in ${FAMILIES_SETS:-mtbench:2:0,1:tree grounded:2:0,1:tree heldout:0:0:chain}; do
        IFS=: read -r name n temps trees <<< "$set"
        prompts=$name; [ "$name" = heldout ] && prompts="$OUT/heldout.jsonl"
        e3=chain:3 block=chain:3
        [ "$trees" = tree ] && e3=chain:3,dynamic:3,4,8 block=chain:3,ddtree:8,3
        bench26 "${name}_eagle3" ar,eagle3 "eagle3=$(eagle3_at)" $e3 "$prompts" "$n" "$temps"
        bench26 "${name}_eagle31" ar,eagle3 "eagle3=$OUT/eagle31" $e3 "$prompts" "$n" "$temps"
        bench26 "${name}_block" ar,dflash,peagle,dspark "dflash=$OUT/dflash,peagle=$OUT/peagle,dspark=$OUT/dspark" \
            $block "$prompts" "$n" "$temps"
    done
    ;;
table2026)
    args=()
    for name in mtbench grounded heldout; do  # the sets bench2026 measured
        [ -f "docs/results/drafters2026_${name}_eagle3.json" ] || continue
        args+=(--results "$name=docs/results/drafters2026_${name}_eagle3.json"
               --results "$name=docs/results/drafters2026_${name}_eagle31.json:eagle3=eagle31"
               --results "$name=docs/results/drafters2026_${name}_block.json")
    done
    python -m launch.families_table --runs "$OUT" --methods eagle3,eagle31,dflash,peagle,dspark \
        --at_step eagle3=$FAMILY_STEPS "${args[@]}" --out docs/results/drafters2026
    ;;
bench)
    at=$(eagle3_at)
    python -m launch.heldout_questions --data "$DATA" --n 8 --out "$OUT/heldout.jsonl"
    bench() {  # results-name methods heads
        python -m launch.decode_bench --methods "$2" --heads "$3" --prompts mtbench --n_per_category 2 \
            --budgets chain:3 --max_new_tokens 128 --temperatures 0 --out "docs/results/$1_mtbench.json"
        python -m launch.decode_bench --methods "$2" --heads "$3" --prompts "$OUT/heldout.jsonl" \
            --n_per_category 0 --budgets chain:3 --max_new_tokens 128 --temperatures 0 --out "docs/results/$1_heldout.json"
    }
    bench families_equal ar,eagle3,medusa,mlp_speculator,mtp,dflash \
        "eagle3=$at,medusa=$OUT/medusa,mlp_speculator=$OUT/mlp_speculator,mtp=$OUT/mtp,dflash=$OUT/dflash"
    bench confu_equal ar,eagle3,confu "eagle3=$OUT/eagle3,confu=$OUT/confu"
    ;;
table)
    python -m launch.families_table --runs "$OUT" --methods eagle3,medusa,mlp_speculator,mtp,dflash \
        --at_step eagle3=$FAMILY_STEPS --mtbench docs/results/families_equal_mtbench.json \
        --heldout docs/results/families_equal_heldout.json --out docs/results/families_equal
    python -m launch.families_table --runs "$OUT" --methods eagle3,confu --branch confu=eagle3@$E \
        --mtbench docs/results/confu_equal_mtbench.json --heldout docs/results/confu_equal_heldout.json \
        --out docs/results/confu_equal
    ;;
*)
    echo "usage: $0 train|bench|table|train2026|bench2026|table2026|train_late2026|bench_late2026|table_late2026|dpace" >&2
    exit 2
    ;;
esac
