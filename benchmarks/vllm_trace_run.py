"""Serving traces through vanilla vLLM and vLLM + atskv (`atskv.eval.vllm_trace`): what `atskv bench
serve` runs, without importing the CLI (the GPU image's transformers is older than atskv's CLI
needs; the plugin and this driver need none). Rows in ROWS.jsonl as they finish, resumable; the
plot beside them (ROWS.png).

    python benchmarks/vllm_trace_run.py ROWS.jsonl --methods vllm vllm:streaming_llm --free_blocks \
        --rates 0.25 1.0 --new_tokens 256 [--requests 32 --shortest 16384 --longest 131072 --limit_s 150 \
        --dense_layers 2 --options '{"learned": {"predictor": DIR}}' --engine '{"max_num_batched_tokens": 2048}']
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from atskv.eval.vllm_speed import write_shape
from atskv.eval.vllm_trace import Trace, measure, plot, serving_specs, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=Path)
    parser.add_argument("--methods", nargs="+", required=True, help="vllm (vanilla) and vllm:<selector>")
    parser.add_argument("--shape", default="llama3.1-8b")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 1.0], help="arrivals per second")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=16384)
    parser.add_argument("--longest", type=int, default=131072)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--limit_s", type=float, default=150.0)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--dense_layers", type=int, default=2)
    parser.add_argument("--free_blocks", action="store_true", help="where the selector can free them")
    parser.add_argument("--options", type=json.loads, default={}, help="JSON: options per selector name")
    parser.add_argument("--engine", type=json.loads, default={}, help="JSON: vLLM's own settings")
    parser.add_argument("--host_tier", type=json.loads, default=None,
                        help="JSON: with --free_blocks, what a compacting selector frees parked on the host")
    args = parser.parse_args()
    shape = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    budget = int(args.budget) if args.budget >= 1 else args.budget
    specs = serving_specs(args.methods, args.shape, shape, args.new_tokens, budget, args.dense_layers,
                          args.free_blocks, args.options, args.engine, args.host_tier)  # fmt: skip
    traces = [Trace(rate, args.requests, args.shortest, args.longest, args.new_tokens, limit_s=args.limit_s)
              for rate in args.rates]  # fmt: skip
    measure(specs, traces, args.rows)
    print(table(args.rows))
    plot(args.rows, args.rows.with_suffix(".png"))
    print(f"plot: {args.rows.with_suffix('.png')}")


if __name__ == "__main__":
    main()
