"""What ranking the host tier's parked pages costs on a GPU, per managed layer and decode step:
the int4 key summary's kernel (`atskv.kernels.int4_page_scores`) against Quest's page bounds
(`quest_page_scores`, the `bounds` summary) and against the bytes each must read.

Llama-3-8B attention shape (32 query / 8 KV heads, dim 128), bf16, 16-token pages, every token a
candidate but a random 5% (resident). Each figure is the median of CUDA-graph replays over
`--layers` sets of inputs used in turn (so a set is not read from the L2 cache, as in a model
whose other layers pass through it), per call. `GB/s` counts the summary's bytes once (int4:
codes, scales and the candidate mask; bounds: both bound tensors) over that time. Checks each
kernel against its torch reference first.

One H200, torch 2.11, Triton 3.6, 2026-11-28 (us per layer and step, GB/s; session 25's kernel,
which unpacks the codes by their bits, timed with this file's `timed` and `inputs` (4 layers); 128K B=8 not
rerun): the int4 kernel reads 1.2-1.6 TB/s, the bounds 1.8-2.6 TB/s, and int4 has twice the bytes to
read, so it costs 3-3.5x the bounds' scoring. Its predecessors: unpacking through float32, 20.8 /
136.8 / 70.6 us in the same run (~1 TB/s; `docs/results/decode-speed-h200/session25-int4-unpack/`);
programs looping over 4-8 blocks, slower still (25-29 us at 32K B=1); per-channel products, two
pages a program, 1.5 ms a decode step over the bounds at the 8B shape, 32K B=1, and 11.5 ms at B=8,
where the float32-unpacking kernel cost 0.55 and 6.6 (`atskv bench decode --host_tier '{summary:
int4}'` against `bounds`).

| context, B | int4 summary | page bounds |
|---|---|---|
| 32K, 1 | 14.4 (1219) | 4.7 (1785) |
| 32K, 8 | 90.2 (1558) | 25.7 (2611) |
| 128K, 1 | 46.7 (1504) | 14.9 (2252) |

    PYTHONPATH=. python3 benchmarks/host_summary_timing.py [--contexts 32768 131072] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from atskv.kernels.int4_page_scores import int4_page_scores_reference, int4_page_scores_triton, quantize_int4
from atskv.kernels.quest import masked_page_bounds, quest_page_scores

HQ, HKV, D, PAGE = 32, 8, 128, 16


def timed(fn, sets: list, replays: int = 20, repeat: int = 4) -> float:
    """Median us per call of `fn(*set)`, the sets used in turn `repeat` times in one CUDA graph (so
    the host's launches are not timed), over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in sets:  # compile and warm up outside the graph
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for inputs in sets:
                fn(*inputs)
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / (repeat * len(sets)))
    return statistics.median(times)


def inputs(batch: int, tokens: int, generator: torch.Generator):
    keys = torch.randn(batch, HKV, tokens, D, device="cuda", generator=generator, dtype=torch.bfloat16)
    query = torch.randn(batch, HQ, D, device="cuda", generator=generator, dtype=torch.bfloat16)
    parked = torch.rand(batch, HKV, tokens, device="cuda", generator=generator) > 0.05
    codes, scale = quantize_int4(keys)
    low, high = masked_page_bounds(keys, torch.ones_like(parked), PAGE)
    return query, codes, scale, parked, low, high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tokens in args.contexts:
        for batch in args.batches:
            sets = [inputs(batch, tokens, generator) for _ in range(args.layers)]
            query, codes, scale, parked, low, high = sets[0]
            want = int4_page_scores_reference(query, codes, scale, PAGE, parked)
            got = int4_page_scores_triton(query, codes, scale, PAGE, parked)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
            row = {"context": tokens, "batch": batch}
            us = timed(lambda q, c, s, m, lo, hi: int4_page_scores_triton(q, c, s, PAGE, m), sets)
            row["int4 summary"] = (round(us, 1), round((codes.nbytes + scale.nbytes + parked.nbytes) / us / 1e3))
            us = timed(lambda q, c, s, m, lo, hi: quest_page_scores(q, lo, hi), sets)
            row["page bounds"] = (round(us, 1), round((low.nbytes + high.nbytes) / us / 1e3))
            rows.append(row)
            del sets
    print(f"{torch.cuda.get_device_name()}, {torch.__version__}; per layer and step, us (GB/s)\n")
    names = [k for k in rows[0] if k not in ("context", "batch")]
    print("| context | B | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | " + " | ".join(f"{r[k][0]} ({r[k][1]})" for k in names) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
