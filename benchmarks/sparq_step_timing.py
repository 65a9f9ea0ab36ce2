"""Where SparQ's fused decode step (`atskv.kernels.sparq_decode`) spends its time, on a GPU.

Random bf16 keys and queries at the Llama-3-8B shape (32 query / 8 KV heads, D = 128, r = 16),
every slot held, a 5% budget; per kernel, the device time torch.profiler reports (the mean over
`--steps` eager calls of the same inputs, so partly L2-warm: the layer's step in `atskv bench
attention` is the figure to quote). Every variant is first checked against the
torch reference (the same chosen slots). With `--sweep`, each knob of `sparq_decode_triton`
moved one at a time from its default at the first shape.

    PYTHONPATH=. python3 benchmarks/sparq_step_timing.py [--sweep] [--out sparq.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch.profiler import ProfilerActivity, profile

from atskv.kernels.sparq_decode import channel_major, sparq_decode_reference, sparq_decode_triton

SHAPES = ((1, 32768), (1, 32801), (1, 131072), (16, 32768))  # (batch, slots); 32801: an unaligned count
SWEEP = [dict(block_s=b) for b in (1024, 4096)] + [dict(parts=p) for p in (8, 32)] + [
    dict(warps=w) for w in ((1, 4, 8, 8), (4, 4, 8, 8), (8, 4, 16, 8), (8, 4, 8, 4))
] + [dict(probs_block=p) for p in (512, 2048)] + [dict(window=w) for w in (64, 256)] + [
    dict(collect_block=p) for p in (1024, 4096)
] + [dict(block_c=c) for c in (128, 512)] + [dict(radix=r) for r in (2, 4)]


def inputs(batch: int, slots: int, hq: int = 32, hkv: int = 8, d: int = 128, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = torch.randn(batch, hkv, slots, d, device="cuda", generator=g, dtype=torch.bfloat16)
    slot_pos = torch.arange(slots, device="cuda").expand(batch, hkv, slots).contiguous()
    write_slot = torch.full((batch, hkv), slots - 1, device="cuda")
    query = torch.randn(batch, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    context = torch.full((batch,), slots, device="cuda")
    return query, keys, channel_major(keys), slot_pos, write_slot, context, d**-0.5


def kernel_us(fn, steps: int) -> dict[str, float]:
    """Mean device microseconds per call of each kernel `fn` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / steps, 2) for e in prof.key_averages() if e.device_time_total > 0}


def same_slots(got, want) -> bool:
    (gi, gl), (wi, wl) = got, want
    return torch.equal(gl, wl) and all(
        set(gi[b, h, : int(gl[b, h])].tolist()) == set(wi[b, h, : int(wl[b, h])].tolist())
        for b in range(gi.shape[0]) for h in range(gi.shape[1])
    )  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows = []
    for index, (batch, slots) in enumerate(SHAPES):
        case = inputs(batch, slots)
        k = math.ceil(0.05 * slots)
        want = sparq_decode_reference(*[a.clone() if torch.is_tensor(a) else a for a in case], 16, 0.05, k)
        for knobs in [{}] + (SWEEP if args.sweep and index == 0 else []):
            fresh = [a.clone() if torch.is_tensor(a) else a for a in case]
            same = same_slots(sparq_decode_triton(*fresh, 16, 0.05, k, **knobs), want)
            times = kernel_us(lambda: sparq_decode_triton(*fresh, 16, 0.05, k, **knobs), args.steps)
            row = dict(batch=batch, slots=slots, knobs=knobs, same=same, us=times)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
