"""Decode attention latency: the sparse Triton kernel over a 5% index list against dense PyTorch SDPA
(flash / memory-efficient backend, `enable_gqa`) over the whole cache, one query per row.

    python benchmarks/sparse_decode.py                      # H100/H200: Hq 32 / Hkv 8 / D 128, bf16
    python benchmarks/sparse_decode.py --geometry smollm2   # 9 / 3 / 64
    python benchmarks/sparse_decode.py --smoke              # CPU: tiny sizes, Triton's interpreter

Prints a markdown table: latencies (microseconds per call, CUDA events over many calls after
warm-up, or CUDA-graph replays with --cuda-graph to leave out Python launch overhead), the ratio
dense / sparse, the K/V bytes each reads as effective GB/s, the split count, and the kernel's
largest difference to the torch reference. Index lists are random distinct slots, sorted.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

GEOMETRIES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}  # Hq, Hkv, D (llama: Llama-3-8B and kin)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 131072], help="cache slots S")
    parser.add_argument("--budget", type=float, default=0.05, help="indices per KV head, as a fraction of S")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--split-size", type=int, default=None, help="force indices per split (default: heuristic)")
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (GPU time only)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few iterations (runs on CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.warmup, args.iters = [1, 2], [512, 2048], 1, 2
    return args


def timed(fn, args, device: torch.device) -> float:
    """Microseconds per call of `fn()`."""
    for _ in range(args.warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return (time.perf_counter() - start) / args.iters * 1e6
    call = fn
    if args.cuda_graph:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
        call()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(args.iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / args.iters * 1e3


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            raise SystemExit("no CUDA device: only --smoke runs here (Triton's interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module imports triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from atskv.kernels.sparse_decode import (
        choose_split_size,
        sparse_decode_attention_reference,
        sparse_decode_attention_triton,
    )

    hq, hkv, d = GEOMETRIES[args.geometry]
    dtype = DTYPES[args.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    timing = "CUDA-graph replays" if args.cuda_graph and device.type == "cuda" else "eager calls"
    print(f"# sparse decode attention vs dense SDPA: {name}, Hq {hq} / Hkv {hkv} / D {d}, {args.dtype}, "
          f"budget {args.budget:.0%}, {timing}, {args.iters} iterations after {args.warmup} warm-up\n")  # fmt: skip
    print("| B | S | K | splits | dense SDPA (us) | sparse (us) | dense / sparse | dense GB/s | sparse GB/s "
          "| max err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device=device).manual_seed(0)
    for b in args.batch:
        for s in args.context:
            k = max(1, int(args.budget * s))
            query = torch.randn(b, hq, d, generator=g, device=device, dtype=dtype)
            keys = torch.randn(b, hkv, s, d, generator=g, device=device, dtype=dtype)
            values = torch.randn(b, hkv, s, d, generator=g, device=device, dtype=dtype)
            indices = torch.rand(b, hkv, s, generator=g, device=device).argsort(-1)[..., :k].sort(-1).values.int()
            split_size = args.split_size or choose_split_size(k, b * hkv, d, device)
            splits = math.ceil(k / split_size)

            def sparse():
                return sparse_decode_attention_triton(query, keys, values, indices, split_size=split_size)

            def dense():
                return torch.nn.functional.scaled_dot_product_attention(query4, keys, values, enable_gqa=True)

            query4 = query.unsqueeze(2)
            error = (sparse().float() - sparse_decode_attention_reference(query, keys, values, indices).float()).abs()
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                dense_us = timed(dense, args, device)  # fails loudly if neither fused backend takes it
            sparse_us = timed(sparse, args, device)
            dense_bytes, sparse_bytes = 2 * b * hkv * s * d * element, 2 * b * hkv * k * d * element
            print(f"| {b} | {s} | {k} | {splits} | {dense_us:.1f} | {sparse_us:.1f} | {dense_us / sparse_us:.2f} "
                  f"| {dense_bytes / dense_us / 1e3:.0f} | {sparse_bytes / sparse_us / 1e3:.0f} "
                  f"| {error.max().item():.1e} |")  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
