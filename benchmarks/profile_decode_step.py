"""Where a selector's decode step spends its time: torch.profiler over the same step that `atskv
bench attention` times (the fast path's over as many layers, each its own cache, or the
reference's one layer for `hook:<name>`), run eagerly so each kernel shows, ops sorted by CUDA time.
Times are totals over the steps and layers (calls / steps = launches per step).

    python benchmarks/profile_decode_step.py --selector quest learned --batch 1 --context 32768
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from atskv.eval.bench import GEOMETRIES, Shape, fast_step, hook_step, rotation
from atskv.eval.method import HOOK, Method


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", nargs="+", default=["quest"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-8b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--layers", type=int, help="layers per step (default: as atskv bench attention)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    budget = math.ceil(args.budget * args.context)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    shape = Shape(args.batch, args.context, GEOMETRIES[args.geometry], dtype, torch.device(device))
    for name in args.selector:
        with torch.no_grad():
            method = Method.parse(name)
            if method.runtime == HOOK:
                step = hook_step(method.name, shape, budget)
            else:
                layers = args.layers or rotation(shape, budget)
                step = fast_step(method.name, shape, args.budget, 8 + 5 + args.steps, Path(tempfile.mkdtemp()), layers)
            for _ in range(5):
                step()
            with profile(activities=activities) as prof:
                for _ in range(args.steps):
                    step()
                if device == "cuda":
                    torch.cuda.synchronize()
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(f"\n## {name}: B={args.batch}, S={args.context}, budget {budget}, {args.steps} steps")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
