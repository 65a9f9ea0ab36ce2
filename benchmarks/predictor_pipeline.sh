#!/usr/bin/env bash
# The relevance-predictor pipeline end to end for one base model: collect on the training corpus
# (CORPUS, default Austen) and task prompts, fit three seeds, export each seed's best checkpoint
# by validation window recall (its last without --full_windows), draw the training curves, then
# measure every seed on a held-out corpus beside the baselines (benchmarks/predictor_measure.py).
#   bash benchmarks/predictor_pipeline.sh MODEL WORK_DIR [WINDOWS] [WINDOW_TOKENS] [EPOCHS] [MAX_TIME]
# Extra arguments of the collection go in COLLECT_ARGS (e.g. "--full_windows 4 --decision_points
# [0.3,0.5,0.7,0.9]"), of the measurement in MEASURE_ARGS (e.g. "--window_tokens 8192 --windows 4");
# STAGES picks stages (default "collect fit measure"), e.g. STAGES=measure to re-measure.
set -euo pipefail
model=${1:-smollm2-135m}; work=${2:-runs/pipeline}; windows=${3:-24}; tokens=${4:-1024}
epochs=${5:-5}; max_time=${6:-00:00:10:00}
stages=${STAGES:-collect fit measure}
atskv=${ATSKV:-python -m atskv.cli}
python=${PYTHON:-python}
name=$(basename "${model%.gguf}")  # a run name, also for a model given as a path
if [[ $stages == *collect* ]]; then
  # shellcheck disable=SC2086  # COLLECT_ARGS is a list of arguments
  $atskv collect --model "$model" --corpus "${CORPUS:-austen}" --windows "$windows" --window_tokens "$tokens" \
    --topk 128 --future_queries 64 --tasks "[passkey,needle_single]" --task_examples 16 --out "$work/collect" \
    ${COLLECT_ARGS:-}
fi
if [[ $stages == *fit* ]]; then
  for seed in 0 1 2; do
    $atskv fit --config configs/fit.yaml --seed_everything $seed --data.folder "$work/collect" \
      --trainer.max_epochs "$epochs" --trainer.max_time "$max_time" --trainer.default_root_dir "$work/fit" \
      --trainer.logger.init_args.save_dir "$work/fit" --trainer.logger.init_args.name "$name" \
      --trainer.logger.init_args.version "seed$seed"
    # the best checkpoint by window recall (a collection with --full_windows), else the last
    checkpoints="$work/fit/$name/seed$seed/checkpoints"
    best=$(ls "$checkpoints"/epoch*-window_recall*.ckpt 2>/dev/null | head -1 || true)
    $atskv export "${best:-$checkpoints/last.ckpt}" --out "$work/predictor-s$seed" --model "$model"
  done
  $python -c 'import sys; from atskv.predictor.training import training_curves as c; c(sys.argv[1], sys.argv[2])' \
    "$work/fit" "$work/training-curves.png"
fi
if [[ $stages == *measure* ]]; then
  # shellcheck disable=SC2086  # MEASURE_ARGS is a list of arguments
  $python benchmarks/predictor_measure.py --model "$model" --out "$work/measure" \
    --predictors "$work/predictor-s0" "$work/predictor-s1" "$work/predictor-s2" ${MEASURE_ARGS:-}
fi
