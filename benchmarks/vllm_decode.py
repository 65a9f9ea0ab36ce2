"""Vanilla vLLM beside vLLM + atskv in one run (`atskv.eval.vllm_speed`): greedy-token identity on
fixed prompts, then decode speed per (context, batch); rows in ROWS.jsonl as they finish, resumable.
What `atskv bench decode --methods '[vllm, vllm:quest]'` runs, plus labels (one method under two
budgets) and the identity check, without importing the CLI (the GPU image's transformers is older
than atskv's CLI needs; the plugin and this driver need none).

    python benchmarks/vllm_decode.py ROWS.jsonl --methods vllm vllm:quest --runs 32768x1 32768x8 131072x1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from atskv.eval.vllm_speed import EngineSpec, identity_report, measure, plot, table, timing_options, write_shape

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("rows", type=Path)
parser.add_argument("--shape", default="llama3.1-8b")
parser.add_argument("--methods", nargs="+", default=["vllm", "vllm:quest"], help="METHOD or LABEL=METHOD")
parser.add_argument("--runs", nargs="*", default=["32768x1"], help="CONTEXTxBATCH pairs")
parser.add_argument("--budget", type=json.loads, default=0.05, help="int tokens or a fraction (JSON)")
parser.add_argument("--new_tokens", type=int, default=64)
parser.add_argument("--identity_tokens", type=int, default=0)
parser.add_argument("--identity_context", type=int, default=2048)
parser.add_argument("--options", type=json.loads, default={},
                    help="a selector's options per label, e.g. '{\"l0\": {\"prompt_sample\": 8}}'")
parser.add_argument("--budgets", type=json.loads, default={}, help="a budget per method, overriding --budget")
parser.add_argument("--dense_layers", type=json.loads, default={},
                    help=f"first layers kept dense per label (default {EngineSpec.dense_layers}), e.g. '{{\"s0\": 0}}'")
parser.add_argument("--host_tier", type=json.loads, default={},
                    help="the plugin's host tier per label (with free_blocks, which it then sets), e.g. "
                         "'{\"ht\": {\"regions\": 8, \"pages\": 16}}'")
parser.add_argument("--free_blocks", nargs="*", default=[], help="labels whose selector frees blocks")
parser.add_argument("--profile", type=Path, default=None,
                    help="a folder: each batch's last decode steps under vLLM's torch profiler, its CUDA-time "
                         "table per label and shape there (untimed)")
parser.add_argument("--profile_prefill", action="store_true",
                    help="with --profile: also each batch's prefill, run again after its row (one new token a "
                         "request), its table LABEL.CONTEXTxBATCH.prefill.txt")
args = parser.parse_args()
shape = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
runs = [tuple(int(x) for x in run.split("x")) for run in args.runs]
labelled = [m.split("=", 1) if "=" in m else (m, m) for m in args.methods]
dense = {label: args.dense_layers.get(label, EngineSpec.dense_layers) for label, _ in labelled}
specs = [
    EngineSpec(m, str(shape), runs, args.new_tokens, args.budgets.get(label, args.budget), dense[label],
               options=timing_options(m, args.options.get(label, {}), args.shape, dense[label],
                                      shape.parent / f"predictor-{dense[label]}"),
               identity_tokens=args.identity_tokens,
               identity_context=args.identity_context, label=label,
               free_blocks=label in args.free_blocks or label in args.host_tier, host_tier=args.host_tier.get(label),
               profile_dir=str(args.profile.resolve()) if args.profile else "", profile_prefill=args.profile_prefill)
    for label, m in labelled
]  # fmt: skip
measure(specs, args.rows)
for line in identity_report(args.rows):
    print(line)
print(table(args.rows))
plot(args.rows, args.rows.with_suffix(".png"))
print(f"plot: {args.rows.with_suffix('.png')}")
