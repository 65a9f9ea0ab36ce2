"""Decode-attention latency: each selector's full path against dense attention, in one run.

One decode step of one managed layer is timed as the hook runs it: append the new token's K/V to
the slot cache, build the view, score, take the top budget, attend (the sparse decode kernel for
query-aware selectors; the mask path over the held tokens for evicting ones, whose cache already
holds only their budget). The baseline is PyTorch SDPA decoding over the whole context from a
preallocated cache (the same append), with the backend named in the table (flash where it takes
this input). Random K/V: latency does not depend on the values. Times come from CUDA events
over many steps after a warm-up; ratios are dense time / selector time, taken in the same run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm
from transformers import LlamaConfig

from atskv.eval.report import write_report
from atskv.hook.sparse import SparseSession, SparsityConfig
from atskv.selectors import make_selector

GEOMETRIES = {  # query heads, KV heads, head dim
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "gemma3-270m": (4, 1, 256),
}
DENSE = "dense (SDPA)"


@dataclass
class BenchRecord:
    selector: str
    batch: int
    context: int
    budget: int
    milliseconds: float
    speedup: float | None  # dense time / this time, same run, same GPU
    backend: str = ""


def _timer(device: torch.device):
    """`time(fn, steps, warmup) -> ms per call` with CUDA events on a GPU, wall clock elsewhere."""
    import time

    def time_it(fn, steps: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / steps
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / steps

    return time_it


def _dense_step(batch: int, context: int, geometry, dtype, device, room: int):
    """SDPA decode over a preallocated cache that grows by one token per call; returns (step, backend)."""
    hq, hkv, d = geometry
    keys = torch.randn(batch, hkv, context + room, d, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    query = torch.randn(batch, hq, 1, d, dtype=dtype, device=device)
    new = torch.randn(batch, hkv, 1, d, dtype=dtype, device=device)
    state = {"n": context}

    def attend():
        n = state["n"] = state["n"] + 1 if state["n"] < context + room else context
        keys[:, :, n - 1 : n] = new
        values[:, :, n - 1 : n] = new
        return F.scaled_dot_product_attention(query, keys[:, :, :n], values[:, :, :n], enable_gqa=hq > hkv)

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                attend()

            def step(backend=backend):
                with sdpa_kernel(backend):
                    return attend()

            return step, backend.name.lower()
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend accepted the dense decode input")


def selector_step(name: str, batch: int, context: int, budget: int, geometry, dtype, device):
    """One hook decode step of a managed layer for selector `name` (cache filled with `context`
    tokens; an evicting selector's cache holds only its budget, as after its prefill eviction)."""
    hq, hkv, d = geometry
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                         hidden_size=hq * d, vocab_size=8)
    selector = make_selector(name)
    session = SparseSession(SimpleNamespace(config=config), selector, SparsityConfig(budget, dense_layers=0))
    layer = session.bind(None).layers[0]
    held = budget if selector.evicts else context
    layer.seen = 0
    layer.update(*(torch.randn(batch, hkv, held, d, dtype=dtype, device=device) for _ in range(2)))
    layer.seen = context  # evicting selectors: the tokens before the held ones were dropped
    layer.slot_pos[..., :held] += context - held
    module = SimpleNamespace(layer_idx=0)
    query = torch.randn(batch, hq, 1, d, dtype=dtype, device=device)
    new = torch.randn(batch, hkv, 1, d, dtype=dtype, device=device)

    def step():
        keys, values = layer.update(new, new)
        return session.attend(module, query, keys, values, None, d**-0.5)

    step.layer = layer  # what the step holds, for checks
    return step


def bench_decode_attention(
    selectors: Sequence[str],
    batch_sizes: Sequence[int] = (1, 16),
    contexts: Sequence[int] = (8192, 32768, 131072),
    budget_fraction: float = 0.05,
    geometry: str = "llama3-8b",
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    steps: int = 50,
    warmup: int = 10,
    progress: bool = True,
) -> list[BenchRecord]:
    """Milliseconds per decode step of one layer, dense and per selector, for every batch x context."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of: {', '.join(GEOMETRIES)}")
    if not 0 < budget_fraction < 1:
        raise ValueError(f"budget_fraction must lie in (0, 1), got {budget_fraction}")
    for name in selectors:
        make_selector(name)
    shape = GEOMETRIES[geometry]
    device = torch.device(device)
    time_it = _timer(device)
    records = []
    cases = [(b, s) for b in batch_sizes for s in contexts]
    # the first case runs twice, untimed the first time: kernel compilation and clock ramp-up
    # must not land in whichever setting happens to come first
    for n, (batch, context) in enumerate(tqdm([cases[0], *cases], desc="bench", disable=not progress)):
        budget = max(1, math.ceil(budget_fraction * context))
        room = steps + warmup + 8
        with torch.no_grad():
            step, backend = _dense_step(batch, context, shape, dtype, device, room)
            dense_ms = time_it(step, steps, warmup)
            del step
            case = [BenchRecord(DENSE, batch, context, budget, dense_ms, 1.0, backend)]
            for name in selectors:
                step = selector_step(name, batch, context, budget, shape, dtype, device)
                ms = time_it(step, steps, warmup)
                del step
                case.append(BenchRecord(name, batch, context, budget, ms, dense_ms / ms))
        if n > 0:
            records += case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def markdown(records: list[BenchRecord]) -> str:
    """Rows: settings; columns: batch x context; cells: ms per step (speed-up over dense)."""
    cases = list(dict.fromkeys((r.batch, r.context) for r in records))
    rows = list(dict.fromkeys(r.selector for r in records))
    cell = {(r.selector, r.batch, r.context): r for r in records}
    header = " | ".join(f"B={b}, {c / 1024:g}K" for b, c in cases)
    lines = [f"| decode step | {header} |", "|---" * (len(cases) + 1) + "|"]
    for name in rows:
        cells = []
        for b, c in cases:
            r = cell.get((name, b, c))
            if r is None:
                cells.append("")
            elif name == DENSE:
                cells.append(f"{r.milliseconds:.3f} ms ({r.backend})")
            else:
                cells.append(f"{r.milliseconds:.3f} ms ({r.speedup:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(records: list[BenchRecord], out: Path, meta: dict) -> None:
    """table.md and bench.json under `out` (the evaluations' report writer)."""
    write_report(out, markdown(records), {"meta": meta, "records": records}, json_name="bench.json")
