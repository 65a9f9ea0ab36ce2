"""How fast the fast path's host tier reads parked tokens back on this machine, against the
pinned-copy ceiling of the same bytes.

A decode step with `atskv.HostRetrieval` gathers whole pages of parked keys and values out of
pinned host memory through a device alias of it (`atskv.runtime.fast.host_pages.device_alias`),
inside the step's CUDA graph; its cost is set by the machine's host-to-GPU link. For each count
of tokens read back per layer, this times that gather (keys and values, every KV head of one
layer) against one contiguous pinned -> GPU copy of the same bytes (the copy engine's best case),
CUDA events, in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from atskv.eval.report import write_report
from atskv.runtime.fast.host_pages import device_alias


@dataclass
class FetchRecord:
    tokens: int  # tokens read back per KV head (whole pages)
    bytes: int  # keys and values, every KV head of one layer
    gather_us: float
    copy_us: float

    @property
    def gather_gbs(self) -> float:
        return self.bytes / self.gather_us / 1e3

    @property
    def copy_gbs(self) -> float:
        return self.bytes / self.copy_us / 1e3

    @property
    def share_of_ceiling(self) -> float:
        return self.copy_us / self.gather_us


def _seconds(fn, repeats: int) -> float:
    """Seconds per call, CUDA events, after a warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def measure(stored_tokens: int, fetched: list[int], kv_heads: int, head_dim: int, page: int = 16,
            repeats: int = 50, device: str = "cuda") -> list[FetchRecord]:  # fmt: skip
    """One record per count in `fetched`: random pages of a pinned bf16 store of `stored_tokens`
    tokens per KV head, gathered through the device alias, against a pinned copy of as many bytes."""
    pages = stored_tokens // page
    host = torch.randn(1, kv_heads, pages, page * head_dim).to(torch.bfloat16).pin_memory()
    alias = device_alias(host, torch.device(device))
    records = []
    for tokens in fetched:
        n = min(pages, max(1, tokens // page))
        index = torch.stack([torch.randperm(pages, device=device)[:n] for _ in range(kv_heads)])
        index = index.view(1, kv_heads, n, 1).expand(-1, -1, -1, page * head_dim)
        gathered = torch.empty(1, kv_heads, n, page * head_dim, dtype=torch.bfloat16, device=device)

        def gather():  # keys and values: two gathers, as a step does
            torch.gather(alias, 2, index, out=gathered)
            torch.gather(alias, 2, index, out=gathered)

        block = host[:, :, :n].contiguous().pin_memory()
        target = torch.empty_like(block, device=device)

        def copy():
            target.copy_(block, non_blocking=True)
            target.copy_(block, non_blocking=True)

        nbytes = 2 * block.numel() * block.element_size()
        records.append(FetchRecord(n * page, nbytes, _seconds(gather, repeats) * 1e6, _seconds(copy, repeats) * 1e6))
    return records


def markdown(records: list[FetchRecord]) -> str:
    lines = [
        "| tokens | MiB | gather GB/s | copy GB/s | gather / copy ceiling | gather us |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.tokens} | {r.bytes / 2**20:.2f} | {r.gather_gbs:.1f} | {r.copy_gbs:.1f} | {r.share_of_ceiling:.2f} "
        f"| {r.gather_us:.0f} |"
        for r in records
    ]
    return "\n".join(lines)


def write(records: list[FetchRecord], out: Path, meta: dict) -> Path:
    """table.md (a heading line from `meta`, then the table) and fetch.json under `out`."""
    heading = (f"Host fetch, {meta['gpu']}: gather through the device alias of pinned memory against one "
               f"contiguous pinned copy of the same bytes; {meta['kv_heads']} KV heads x {meta['head_dim']} "
               f"dims, bf16, K+V, {meta['stored_tokens']} tokens stored")  # fmt: skip
    rows = [dict(vars(r), gather_gbs=r.gather_gbs, copy_gbs=r.copy_gbs, share_of_ceiling=r.share_of_ceiling)
            for r in records]  # fmt: skip
    paths = write_report(out, f"{heading}\n\n{markdown(records)}", {"meta": meta, "records": rows},
                         json_name="fetch.json")  # fmt: skip
    return paths["markdown"]
