"""Where a decode step's time goes on the fast path: eager decode steps of `atskv.generate` (no
graph, so the profiler sees every kernel) profiled from the end of the prefill to the last token,
kernels summed by name; per-step figures divide by the steps.

    python benchmarks/decode_profile.py --model llama3.1-8b --context 32768 --selector quest --budget 0.05
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import atskv
from atskv.eval.speed import shape_model

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default="llama3.1-8b")
parser.add_argument("--context", type=int, default=32768)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--selector", default="quest")
parser.add_argument("--budget", type=float, default=0.05)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--rows", type=int, default=20)
args = parser.parse_args()


class DecodeProfiler:
    """A streamer that profiles from the first generated token (the prefill's end) to the last."""

    def __init__(self):
        self.profiler, self.puts = profile(activities=[ProfilerActivity.CUDA]), 0

    def put(self, tokens):
        self.puts += 1
        if self.puts == 2:
            torch.cuda.synchronize()
            self.profiler.start()

    def end(self):
        torch.cuda.synchronize()
        self.profiler.stop()


model = shape_model(args.model)
ids = torch.randint(3, 1000, (args.batch, args.context), device="cuda")
options = dict(max_new_tokens=args.steps + 1, prefill_chunk=8192, cuda_graph=False)
atskv.generate(model, ids, args.selector, args.budget, **options)  # warm-up: kernels compiled
watch = DecodeProfiler()
atskv.generate(model, ids, args.selector, args.budget, streamer=watch, **options)
events = watch.profiler.key_averages()
launches = sum(e.count for e in events if e.device_time_total > 0)
print(f"{args.model}, {args.context} tokens, B={args.batch}, {args.selector} @ {args.budget}: per decode step "
      f"{sum(e.device_time_total for e in events) / 1e3 / args.steps:.2f} ms of GPU time in "
      f"{launches / args.steps:.0f} kernels (eager)")
print(events.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
