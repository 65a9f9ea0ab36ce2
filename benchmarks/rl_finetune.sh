#!/usr/bin/env bash
# Policy-gradient fine-tuning of the supervised predictor, an alpha sweep over seeds, then the
# held-out comparison (Moby-Dick windows, task prompts from seeds 2,000,000 on; training uses
# Austen and task seeds 1,000,000 on): reward, NLL and task accuracy at equal memory, mean ± std
# over seeds, and the quality-memory PNG (`atskv eval heldout`).
#   bash benchmarks/rl_finetune.sh MODEL WORK_DIR
# Sizes come from the environment, e.g. a CPU smoke run:
#   CONTEXT=512 CONTINUATION=32 SAMPLES=4 STEPS=24 SEEDS=0 ALPHAS="0.5 0.9" bash benchmarks/rl_finetune.sh smollm2-135m runs/rl
# SUPERVISED may name one predictor per seed with `{seed}` in it (fine-tuning seed S starts from
# that supervised seed; all of them are evaluated), e.g. SUPERVISED='work/predictor-s{seed}'.
# LR overrides the config's learning rate; TASKS (e.g. "[needle_single, passkey]") and TASK_METRIC
# (nll or exact_match) the training tasks and how their answers are scored; RETRIEVE (tokens, or a
# fraction of the context) trains and evaluates for a two-tier store (dropped tokens each query
# rates highest are read back). MAX_TIME (Lightning's DD:HH:MM:SS) stops each run there even before STEPS. PARALLEL=1 runs every
# alpha x seed at once (nine 2K-token runs shared one H100 at ~1.5 s a step each); logs in
# WORK_DIR/logs. STAGES picks stages (default "finetune evaluate").
set -euo pipefail
model=${1:-smollm2-135m}; work=${2:-runs/rl}
supervised=${SUPERVISED:-$model}           # the predictor to start from: exported folder, .ckpt or model name
context=${CONTEXT:-2048}; continuation=${CONTINUATION:-32}; samples=${SAMPLES:-8}; steps=${STEPS:-300}
seeds=${SEEDS:-"0 1 2"}; alphas=${ALPHAS:-"0.5 0.9 0.97"}; policy=${POLICY:-row_level}
windows=${WINDOWS:-64}; task_examples=${TASK_EXAMPLES:-16}; batch=${BATCH:-2}
eval_windows=${EVAL_WINDOWS:-16}; eval_tasks=${EVAL_TASKS:-16}; budgets=${BUDGETS:-"[0.05,0.1,0.2,0.4]"}
shared=${SHARED_BUDGETS:-"[]"}              # one threshold over all layers and heads at these memories (shared<b>)
stages=${STAGES:-finetune evaluate}
atskv=${ATSKV:-python -m atskv.cli}
python=${PYTHON:-python}

finetune_one() {  # finetune_one ALPHA SEED: train, then export to WORK/predictors/alpha<A>-seed<S>
  local alpha=$1 seed=$2
  $atskv finetune --config configs/finetune.yaml --seed_everything "$seed" \
    --model.predictor "${supervised//\{seed\}/$seed}" --model.model "$model" --model.policy "$policy" \
    --model.alpha "$alpha" --model.samples "$samples" ${LR:+--model.lr "$LR"} \
    ${TASK_METRIC:+--model.task_metric "$TASK_METRIC"} ${TASKS:+--data.tasks "$TASKS"} \
    ${RETRIEVE:+--model.retrieve "$RETRIEVE"} \
    --data.windows "$windows" --data.context_tokens "$context" --data.continuation_tokens "$continuation" \
    --data.task_examples "$task_examples" --data.batch_size "$batch" --trainer.max_steps "$steps" \
    ${MAX_TIME:+--trainer.max_time "$MAX_TIME"} --trainer.enable_progress_bar false \
    --trainer.default_root_dir "$work/finetune" --trainer.logger.init_args.save_dir "$work/finetune" \
    --trainer.logger.init_args.name "alpha$alpha" --trainer.logger.init_args.version "seed$seed"
  $atskv export "$work/finetune/alpha$alpha/seed$seed/checkpoints/last.ckpt" \
    --out "$work/predictors/alpha$alpha-seed$seed" --model "$model"
}

if [[ $stages == *finetune* ]]; then
  mkdir -p "$work/logs"
  pids=()
  for alpha in $alphas; do
    for seed in $seeds; do
      if [[ ${PARALLEL:-0} == 1 ]]; then
        finetune_one "$alpha" "$seed" > "$work/logs/alpha$alpha-seed$seed.log" 2>&1 & pids+=($!)
      else
        finetune_one "$alpha" "$seed"
      fi
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || { echo "a fine-tuning run failed; see $work/logs" >&2; exit 1; }; done
fi
if [[ $stages == *evaluate* ]]; then
  starts=$(for seed in $seeds; do echo "${supervised//\{seed\}/$seed}"; done | awk '!seen[$0]++' | paste -sd, -)
  $atskv eval heldout --model "$model" --supervised "[$starts]" --finetuned "$work/predictors" \
    --out "$work/heldout" --windows "$eval_windows" --context_tokens "$context" \
    --continuation_tokens "$continuation" --task_examples "$eval_tasks" --budgets "$budgets" ${TASKS:+--tasks "$TASKS"} \
    ${RETRIEVE:+--retrieve "$RETRIEVE"} \
    --shared_budgets "$shared"
fi
