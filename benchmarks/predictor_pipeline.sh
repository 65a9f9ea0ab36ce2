#!/usr/bin/env bash
# The relevance-predictor pipeline end to end for one base model: collect on a training corpus,
# fit three seeds, export the best, measure recall on a held-out corpus beside the baselines.
#   bash benchmarks/predictor_pipeline.sh MODEL WORK_DIR [WINDOWS] [WINDOW_TOKENS] [EVAL_TOKENS] [EPOCHS]
set -euo pipefail
model=${1:-smollm2-135m}; work=${2:-runs/pipeline}; windows=${3:-24}; tokens=${4:-1024}
eval_tokens=${5:-2048}; epochs=${6:-5}
atskv=${ATSKV:-python -m atskv.cli}
name=$(basename "${model%.gguf}")  # a run name, also for a model given as a path
$atskv collect --model "$model" --corpus austen --windows "$windows" --window_tokens "$tokens" \
  --topk 64 --future_queries 32 --out "$work/collect"
for seed in 0 1 2; do
  $atskv fit --config configs/fit.yaml --seed_everything $seed --data.folder "$work/collect" \
    --trainer.max_epochs "$epochs" --trainer.default_root_dir "$work/fit" \
    --trainer.logger.init_args.save_dir "$work/fit" --trainer.logger.init_args.name "$name" \
    --trainer.logger.init_args.version "seed$seed"
done
python - "$work" <<'PY'
import sys
from atskv.predictor.training import training_curves
training_curves(f"{sys.argv[1]}/fit", f"{sys.argv[1]}/training-curves.png")
PY
$atskv export "$work/fit/$name/seed0/checkpoints/last.ckpt" --out "$work/predictor" --model "$model"
python - "$model" "$work" "$eval_tokens" <<'PY'
import sys
from pathlib import Path

from atskv.data import corpus_windows
from atskv.eval.recall import attention_recall
from atskv.models import load_model
from atskv.selectors import make_selector
model, work, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
lm = load_model(model)
windows = corpus_windows(lm.tokenizer, "moby-dick", tokens, 4)  # never seen in training (austen)
learned = make_selector("learned", predictor=f"{work}/predictor")
report = attention_recall(lm.model, windows, [learned, "h2o", "snapkv", "streaming_llm"], [64, 128, 256, 512],
                          model_name=model)
report.write(Path(work) / "recall")
print(report.markdown())
PY
