"""The mass each slot receives from a causal prompt chunk (`atskv.kernels.received_mass`), timed on
a GPU: the Triton kernel, the torch reference it replaces (`received_mass` with a causal mask,
what H2O's and the learned selector's prefill ran) and, for scale, the chunk's attention itself
(`prefix_causal_attention`, flash + log-sum-exp merge).

Random bf16 inputs at the Llama-3.1-8B shape (32 query / 8 KV heads, D = 128, B = 1), a chunk of
8192 queries at offsets 0, 32K - 8K and 128K - 8K (the first, an early and the last chunk of a
128K prefill), the keys a slot buffer with 64 free slots past the chunk. Per offset one JSON line:
milliseconds (median of `--steps` calls, CUDA events) of each, the kernel's TFLOP/s (the q.k
products of the visible pairs), and checks: the kernel on a slice (`--check_heads` KV heads, the
chunk's last `--check_queries` queries) against the reference on the same values in float32
(`check_max_abs`, `check_ok`), every query's probabilities summing to 1 (`sum_rel_err`: the
kernel's total mass per KV head against G * chunk), and the largest difference to the bf16
reference over the whole chunk (`vs_bf16_reference_max_abs`; the reference rounds its logits to
bf16, so it is off by a few percent per probability). `--sweep` also times each block / warp /
stage setting of the kernel at `--sweep_offset` (one line each).

    . benchmarks/device/env.sh   # on the GPU machine: the carried wheels, ATSKV_CACHE
    python3 benchmarks/received_mass_timing.py [--sweep] [--out mass.jsonl]

`--device cpu` runs it at toy sizes in Triton's interpreter, to check the script itself:
`TRITON_INTERPRET=1 python3 benchmarks/received_mass_timing.py --device cpu --chunk 48 --offsets 0 80
--heads 8 2 --head_dim 64`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from atskv.attention import prefix_causal_attention
from atskv.kernels.received_mass import (
    choose_config,
    prefix_received_mass_reference,
    prefix_received_mass_triton,
)

SPARE = 64  # free slots past the chunk, as in the static cache
SWEEP = [dict(block_n=n, block_m=m, num_warps=w, num_stages=s)
         for n, m, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]  # fmt: skip


def chunk_inputs(offset: int, chunk: int, hq: int, hkv: int, d: int, batch: int, device: str, seed: int = 0):
    """Query `[B, Hq, chunk, D]` (a view of `[B, chunk, Hq, D]`, as the model passes it), keys and
    values `[B, Hkv, offset + chunk + SPARE, D]`, all bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    slots = offset + chunk + SPARE
    query = torch.randn(batch, chunk, hq, d, device=device, generator=g, dtype=torch.bfloat16).transpose(1, 2)
    keys = torch.randn(batch, hkv, slots, d, device=device, generator=g, dtype=torch.bfloat16)
    values = torch.randn(batch, hkv, slots, d, device=device, generator=g, dtype=torch.bfloat16)
    return query, keys, values


def time_ms(fn, steps: int, warmup: int = 1) -> float:
    """Median milliseconds of `steps` calls (CUDA events around each; the wall clock off CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if not torch.cuda.is_available():
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def visible_pairs(offset: int, chunk: int) -> int:
    """(query, key) pairs of a causal chunk: query i sees offset + i + 1 keys."""
    return chunk * offset + chunk * (chunk + 1) // 2


def check_slice(query, keys, lse, offset, scaling, heads: int, queries: int) -> tuple[float, float]:
    """Largest difference of the kernel to the float32 reference on the first `heads` KV heads and
    the chunk's last `queries` queries (the slice at its own offset: the mass is a sum over queries),
    and the reference's largest mass there."""
    group = query.shape[1] // keys.shape[1]
    first = query.shape[2] - queries
    q = query[:, : heads * group, first:]
    k, ls = keys[:, :heads, : offset + query.shape[2]], lse[:, : heads * group, first:]
    got = prefix_received_mass_triton(q, k, ls, offset + first, scaling)
    want = prefix_received_mass_reference(q.float(), k.float(), ls, offset + first, scaling)
    return (got - want).abs().max().item(), want.max().item()


def measure(args, offset: int, emit) -> None:
    """The lines of one offset: the three timed, the checks, and the sweep if asked."""
    (hq, hkv), d, chunk = args.heads, args.head_dim, args.chunk
    scaling = d**-0.5
    query, keys, values = chunk_inputs(offset, chunk, hq, hkv, d, args.batch, args.device)
    stop = offset + chunk
    keys_in, values_in = keys[:, :, :stop], values[:, :, :stop]
    _, lse = prefix_causal_attention(query, keys_in, values_in, offset, scaling)
    flops = 2 * args.batch * hq * d * visible_pairs(offset, chunk)
    if offset in args.offsets:
        mass = prefix_received_mass_triton(query, keys, lse, offset, scaling)
        reference = prefix_received_mass_reference(query, keys, lse, offset, scaling)
        check, largest = check_slice(query, keys, lse, offset, scaling, args.check_heads,
                                     min(args.check_queries, chunk))
        expected_total = hq // hkv * chunk
        kernel_ms = time_ms(lambda: prefix_received_mass_triton(query, keys, lse, offset, scaling), args.steps)
        emit(dict(
            offset=offset, chunk=chunk, slots=keys.shape[2], config=choose_config(d, query.dtype),
            kernel_ms=kernel_ms, kernel_tflops=round(flops / kernel_ms / 1e9, 1),
            reference_ms=time_ms(lambda: prefix_received_mass_reference(query, keys, lse, offset, scaling),
                                 args.reference_steps),
            flash_ms=time_ms(lambda: prefix_causal_attention(query, keys_in, values_in, offset, scaling),
                             args.steps),
            check_max_abs=check, check_largest_mass=largest, check_ok=check <= 1e-4 * max(1.0, largest),
            sum_rel_err=((mass.sum(-1) - expected_total).abs().max() / expected_total).item(),
            vs_bf16_reference_max_abs=(mass - reference).abs().max().item(),
            free_slots_zero=bool((mass[..., stop:] == 0).all()),
        ))  # fmt: skip
    if args.sweep and offset == args.sweep_offset:
        want = prefix_received_mass_triton(query, keys, lse, offset, scaling)
        for knobs in SWEEP:
            try:
                got = prefix_received_mass_triton(query, keys, lse, offset, scaling, **knobs)
                ms = time_ms(lambda: prefix_received_mass_triton(query, keys, lse, offset, scaling, **knobs),
                             args.steps)  # fmt: skip
                same = (got - want).abs().max().item() <= 1e-3
                emit(dict(offset=offset, sweep=knobs, ms=ms, tflops=round(flops / ms / 1e9, 1), same=same))
            except Exception as error:  # a setting that does not fit (shared memory, registers)
                emit(dict(offset=offset, sweep=knobs, error=f"{type(error).__name__}: {str(error)[:200]}"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offsets", type=int, nargs="+", default=[0, 32768 - 8192, 131072 - 8192])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed calls of the kernel and flash attention")
    parser.add_argument("--reference_steps", type=int, default=2, help="timed calls of the torch reference")
    parser.add_argument("--check_heads", type=int, default=1)
    parser.add_argument("--check_queries", type=int, default=512)
    parser.add_argument("--sweep", action="store_true", help="time every setting in SWEEP at --sweep_offset")
    parser.add_argument("--sweep_offset", type=int, default=32768 - 8192)
    parser.add_argument("--out", help="also write the lines to this file")
    parser.add_argument("--device", default="cuda", help="cpu: toy sizes in Triton's interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    rows = []

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

    offsets = list(args.offsets) + ([args.sweep_offset] if args.sweep and args.sweep_offset not in args.offsets else [])
    for offset in offsets:
        measure(args, offset, emit)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
