#!/usr/bin/env bash
# Policy-gradient fine-tuning of the supervised predictor, an alpha sweep over seeds, then the
# held-out comparison (Moby-Dick windows, task prompts from seeds 2,000,000 on; training uses
# Austen and task seeds 1,000,000 on): reward, NLL and task accuracy at equal memory, mean ± std
# over seeds, and the quality-memory PNG (atskv.rl.evaluate.heldout_report).
#   bash benchmarks/rl_finetune.sh MODEL WORK_DIR
# Sizes come from the environment, e.g. a CPU smoke run:
#   CONTEXT=512 CONTINUATION=32 SAMPLES=4 STEPS=24 SEEDS=0 ALPHAS="0.5 0.9" bash benchmarks/rl_finetune.sh smollm2-135m runs/rl
set -euo pipefail
model=${1:-smollm2-135m}; work=${2:-runs/rl}
supervised=${SUPERVISED:-$model}           # the predictor to start from: exported folder, .ckpt or model name
context=${CONTEXT:-2048}; continuation=${CONTINUATION:-32}; samples=${SAMPLES:-8}; steps=${STEPS:-300}
seeds=${SEEDS:-"0 1 2"}; alphas=${ALPHAS:-"0.5 0.9 0.99"}; policy=${POLICY:-bernoulli}
windows=${WINDOWS:-64}; task_examples=${TASK_EXAMPLES:-16}; batch=${BATCH:-2}
eval_windows=${EVAL_WINDOWS:-16}; eval_tasks=${EVAL_TASKS:-16}; budgets=${BUDGETS:-"[0.05,0.1,0.2,0.4]"}
atskv=${ATSKV:-python -m atskv.cli}
for alpha in $alphas; do
  for seed in $seeds; do
    run="alpha$alpha-seed$seed"
    $atskv finetune --config configs/finetune.yaml --seed_everything "$seed" --model.predictor "$supervised" \
      --model.model "$model" --model.policy "$policy" --model.alpha "$alpha" --model.samples "$samples" \
      --data.windows "$windows" --data.context_tokens "$context" --data.continuation_tokens "$continuation" \
      --data.task_examples "$task_examples" --data.batch_size "$batch" --trainer.max_steps "$steps" \
      --trainer.default_root_dir "$work/finetune" --trainer.logger.init_args.save_dir "$work/finetune" \
      --trainer.logger.init_args.name "alpha$alpha" --trainer.logger.init_args.version "seed$seed"
    $atskv export "$work/finetune/alpha$alpha/seed$seed/checkpoints/last.ckpt" --out "$work/predictors/$run" \
      --model "$model"
  done
done
python -m atskv.rl.evaluate --model "$model" --supervised "[$supervised]" --finetuned "$work/predictors" \
  --out "$work/heldout" --windows "$eval_windows" --context_tokens "$context" \
  --continuation_tokens "$continuation" --task_examples "$eval_tasks" --budgets "$budgets"
