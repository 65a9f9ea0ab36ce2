#!/usr/bin/env bash
# On the GPU machine, after `. benchmarks/device/env.sh` with the model assembled in /tmp/mdl and
# .device/head.tar and .device/kvw carried: start the leaderboard in the background (setsid: it
# outlives this call; keep the machine with `collect.sh` calls) as one process per (seed, context,
# task), each into /tmp/lb/NAME/cC-T-sS (cells already there are kept), seed by seed, so a deadline
# leaves whole seeds rather than every seed half done.
#   bash benchmarks/device/leaderboard.sh NAME LIMIT_S SEEDS CONTEXT... [-- ARGS...]
# NAME: /tmp/mdl/NAME.gguf; LIMIT_S: every process ends by then (seconds from now); JOBS (default
# 12): processes at once, the rest wait their turn (session 20: 36 at once, SmolLM2 at 4-8 GiB and
# Gemma 3 at 32K up to 20 GiB each, overran the H200's 140 GB); SEEDS e.g. "[0,1,2]"; ARGS go to
# `atskv eval leaderboard` (e.g. --methods '[...]'); METHODS_<C> overrides --methods for context C;
# TAG: a second leaderboard of the same model goes to /tmp/lb/NAME-TAG (other --selector_options);
# FROM: a leaderboard folder (cells.jsonl, settings.json; e.g. docs/results/leaderboard-*) each
# process starts from, so a rerun with more seeds computes only what it lacks; TASKS: the processes'
# tasks, one process per word, a word may join several with commas (one process per seed and
# context for rows of a few cells, whose process start would cost more than its cells).
set -uo pipefail
name=$1 limit=$2 seeds=$3; shift 3
contexts=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do contexts+=("$1"); shift; done; [ $# -gt 0 ] && shift
run=$name${TAG:+-$TAG}; mkdir -p "/tmp/lb/$run"
[ -n "${FROM:-}" ] && export FROM=$(realpath "$FROM")
cd /tmp/head && setsid nohup bash -c '
  export PYTHONPATH=/tmp/site:/tmp/head OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  name=$1 deadline=$((SECONDS + $2)) seeds=$3 contexts=$4 run=$5; shift 5
  m=/tmp/mdl/$name.gguf
  case " $* " in *" --methods "*) [[ " $* " == *kascade* ]] ;; esac && \
    { python3 -m atskv.cli profile kascade --model "$m" --device cuda > "/tmp/lb/$run/profile.log" 2>&1 ||
      { echo "Kascade profile failed (every process would stop at once): see profile.log"; touch "/tmp/lb/$run/DONE"; exit 1; }; }
  for s in $(echo "$seeds" | tr -d "[] " | tr , " "); do for c in $contexts; do
    var=METHODS_$c
    for t in ${TASKS:-needle_single needle_multikey needle_multivalue variable_tracking common_words qa}; do
      d=/tmp/lb/$run/c$c-${t//,/+}-s$s; mkdir -p "$d"
      [ -n "${FROM:-}" ] && [ ! -f "$d/cells.jsonl" ] && cp "$FROM/cells.jsonl" "$FROM/settings.json" "$d/"
      while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-12}" ]; do wait -n; done
      [ $SECONDS -lt $deadline ] || continue
      timeout $((deadline - SECONDS)) python3 -m atskv.cli eval leaderboard --config configs/leaderboard.yaml --model "$m" \
        --contexts "[$c]" --tasks "[$t]" --seeds "[$s]" --out "$d" --kvpress_python /tmp/kvpy/python \
        --device cuda "$@" ${!var:+--methods "${!var}"} >> "$d/log" 2>&1 &
    done
  done; done
  wait; touch "/tmp/lb/$run/DONE"' _ "$name" "$limit" "$seeds" "${contexts[*]}" "$run" "$@" \
  > "/tmp/lb/$run/launch.log" 2>&1 < /dev/null &
echo "started $run: contexts ${contexts[*]}, seeds $seeds, ${JOBS:-12} processes at once, all done within ${limit}s; logs in /tmp/lb/$run"
