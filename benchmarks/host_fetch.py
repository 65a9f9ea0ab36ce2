"""Host fetch bandwidth of the fast path's tier (`atskv/runtime/fast/host_pages.py`) against the pinned-copy
ceiling, on one GPU: a gather of N tokens (whole pages of 16, per KV head) read through the device
alias of pinned memory, as a decode step does, against one contiguous pinned -> GPU copy of the
same bytes (the copy engine's best case). Llama-3.1-8B's KV geometry per layer: 8 KV heads, head
dim 128, bf16, keys and values.

    python benchmarks/host_fetch.py --out results/host-fetch
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from atskv.runtime.fast.host_pages import device_alias


def _time(fn, repeats: int = 50) -> float:
    """Seconds per call, CUDA events, after a warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def measure(stored_tokens: int, fetched: list[int], heads: int = 8, dim: int = 128, page: int = 16) -> list[dict]:
    pages = stored_tokens // page
    host = torch.randn(1, heads, pages, page * dim).to(torch.bfloat16).pin_memory()
    alias = device_alias(host, torch.device("cuda"))
    rows = []
    for tokens in fetched:
        n = max(1, tokens // page)
        nbytes = 2 * heads * n * page * dim * 2  # keys and values
        index = torch.stack([torch.randperm(pages, device="cuda")[:n] for _ in range(heads)]).view(1, heads, n, 1)
        index = index.expand(-1, -1, -1, page * dim)
        gathered = torch.empty(1, heads, n, page * dim, dtype=torch.bfloat16, device="cuda")

        def gather():  # keys and values: two gathers, as a step does
            torch.gather(alias, 2, index, out=gathered)
            torch.gather(alias, 2, index, out=gathered)

        block = host[:, :, :n].contiguous().pin_memory()
        target = torch.empty_like(block, device="cuda")

        def copy():
            target.copy_(block, non_blocking=True)
            target.copy_(block, non_blocking=True)

        g, c = _time(gather), _time(copy)
        rows.append(dict(tokens=n * page, bytes=nbytes, gather_gbs=nbytes / g / 1e9, copy_gbs=nbytes / c / 1e9,
                         gather_us=g * 1e6, copy_us=c * 1e6, share_of_ceiling=c / g))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stored_tokens", type=int, default=131072)
    parser.add_argument("--fetched", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = measure(args.stored_tokens, args.fetched)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"Host fetch, {torch.cuda.get_device_name()}: gather through the device alias of pinned memory vs one "
        f"contiguous pinned copy of the same bytes; 8 KV heads x 128 dims, bf16, K+V, "
        f"{args.stored_tokens} tokens stored",
        "",
        "| tokens | MiB | gather GB/s | copy GB/s | gather / copy ceiling | gather us |",
        "|---|---|---|---|---|---|",
    ] + [
        f"| {r['tokens']} | {r['bytes'] / 2**20:.2f} | {r['gather_gbs']:.1f} | {r['copy_gbs']:.1f} | "
        f"{r['share_of_ceiling']:.2f} | {r['gather_us']:.0f} |"
        for r in rows
    ]  # fmt: skip
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    (args.out / "host_fetch.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
