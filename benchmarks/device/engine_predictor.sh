# An engine-ready predictor for the quality stage: 32 Austen windows of 4,096 tokens collected,
# fit 5 epochs without what vLLM does not show an attention backend, exported.
#   bash benchmarks/device/engine_predictor.sh MODEL COLLECTED OUT DEVICE [WITHOUT]
# MODEL a .gguf; COLLECTED the collection's folder (a rerun resumes it; variants share it); OUT
# gets fit/ and predictor/; WITHOUT the features left out ('[hidden_norm, token_type]'). The
# quality stage runs it on the GPU; run here on the CPU (PYTHON=.venv/bin/python, DEVICE cpu:
# ~9 min for Gemma 3 270M on 2 cores), OUT/predictor copied to .device/pred-NAME (NAME the
# stage's MODEL) travels instead and spares the lease the collection.
set -euo pipefail
model=$1 collected=$2 out=$3 device=$4 without=${5:-[hidden_norm, token_type]}
py=${PYTHON:-python3}
$py -m atskv.cli collect --model "$model" --corpus austen --windows 32 --window_tokens 4096 --device "$device" \
  --out "$collected"
$py -m atskv.cli fit --config configs/fit.yaml --config configs/fit-vllm.yaml --data.folder "$collected" \
  --model.without "$without" --trainer.max_epochs 5 --trainer.default_root_dir "$out/fit" \
  --trainer.logger.init_args.save_dir "$out/fit" --trainer.logger.init_args.name "$(basename "$model" .gguf)"
$py -m atskv.cli export "$(ls -d "$out"/fit/*/version_*/checkpoints/last.ckpt | tail -1)" --model "$model" \
  --out "$out/predictor"
