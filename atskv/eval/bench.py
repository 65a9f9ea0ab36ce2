"""Decode-attention latency of a managed layer: each method's whole step against dense SDPA, in one run.

A method is a selector on the fast path (`atskv.generate`'s `StaticSession`: append the new token,
update the selector's state, score, pick, attend, evict; every step captured in a CUDA graph, as
`generate` runs it), or `hook:<selector>` on the reference path (`atskv.sparse`, eager: it asks the
host how many slots each row holds). The baseline is PyTorch SDPA decoding over the whole context
from a preallocated cache (the same append), captured in a graph too, with the backend named in the
table. The layer's cache is filled through the session's own prompt path with random K/V, queries
and hidden states (latency does not depend on the values; the learned selector runs a predictor
of the shape with random weights). A timed call replays `repeat` consecutive steps, so the host's
launch of a replay is not part of a step's time; ratios are SDPA time / method time, same run.

A step runs `layers` layers, each with its own cache and query, and the time is per layer. One
layer stepped again and again reads the same few megabytes of picked keys, page bounds and
features, which then stay in the GPU's L2 cache (50 MB on an H200); in a model, the layer's
weights (hundreds of megabytes) pass through between two steps of it. So by default there are
enough layers that a step's sparse reads exceed the L2 cache several times over (`rotation`), and
the once-per-step counters are shared among them as in `generate`.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm
from transformers import LlamaConfig

from atskv.eval.method import HOOK, OWN, check_methods
from atskv.eval.report import write_report
from atskv.runtime.fast.loop import prompt_chunks
from atskv.runtime.fast.session import StaticSession
from atskv.runtime.reference.sparse import SparseSession, SparsityConfig
from atskv.selectors import make_selector

GEOMETRIES = {  # query heads, KV heads, head dim
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "gemma3-270m": (4, 1, 256),
}
SDPA = "dense (SDPA)"  # the baseline's row
RUNTIMES = (OWN, HOOK)  # the methods' runtimes timed here (OWN: the fast path)
PREFILL_CHUNK = 4096
L2_MULTIPLE = 4  # a step's sparse reads over all its layers: at least this many times the L2 cache
MAX_LAYERS = 8


@dataclass
class BenchRecord:
    selector: str
    batch: int
    context: int
    budget: int
    milliseconds: float
    speedup: float | None  # dense time / this time, same run, same GPU
    backend: str = ""
    layers: int = 1  # layers per timed step (each its own cache); milliseconds are per layer


@dataclass
class Shape:
    """One timed setting: the attention geometry and where its tensors live."""

    batch: int
    context: int
    geometry: tuple[int, int, int]  # query heads, KV heads, head dim
    dtype: torch.dtype
    device: torch.device

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=self.dtype, device=self.device)

    def config(self, layers: int = 1) -> LlamaConfig:
        hq, hkv, d = self.geometry
        return LlamaConfig(num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                           hidden_size=hq * d, intermediate_size=8, vocab_size=8)  # fmt: skip


def rotation(shape: Shape, budget: int) -> int:
    """Layers per timed step: enough that the step's sparse reads (the budget's keys and values in
    every layer) reach `L2_MULTIPLE` times the GPU's L2 cache, at most `MAX_LAYERS`; 1 off CUDA."""
    if shape.device.type != "cuda":
        return 1
    _, hkv, d = shape.geometry
    read = shape.batch * hkv * budget * d * 2 * torch.finfo(shape.dtype).bits // 8
    l2 = torch.cuda.get_device_properties(shape.device).L2_cache_size
    return max(1, min(MAX_LAYERS, math.ceil(L2_MULTIPLE * l2 / read)))


def sdpa_step(shape: Shape, room: int, layers: int = 1) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA decode over `layers` preallocated caches, each growing by one token per call (back to the
    prompt's end when `room` runs out); returns (step, backend)."""
    b, context = shape.batch, shape.context
    hq, hkv, d = shape.geometry
    caches = []
    for _ in range(layers):
        keys = shape.randn(b, hkv, context + room, d)
        caches.append((keys, torch.randn_like(keys), shape.randn(b, hq, 1, d)))
    new = shape.randn(b, hkv, 1, d)
    state = {"n": context}

    def attend():
        n = state["n"] = state["n"] + 1 if state["n"] < context + room else context + 1
        for keys, values, query in caches:
            keys[:, :, n - 1 : n] = new
            values[:, :, n - 1 : n] = new
            out = F.scaled_dot_product_attention(query, keys[:, :, :n], values[:, :, :n], enable_gqa=hq > hkv)
        return out

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


def fast_step(name: str, shape: Shape, budget: float, room: int, folder: Path,
              layers: int = 1) -> Callable[[], torch.Tensor]:  # fmt: skip
    """One decode step of `layers` managed layers on the fast path, after a prompt of
    `shape.context` random tokens through the session's own chunked prefill (an evicting selector
    then holds its budget). Host-side counters advance as `generate` advances them, once a step."""
    b, context = shape.batch, shape.context
    hq, hkv, d = shape.geometry
    model = SimpleNamespace(config=shape.config(layers))
    from atskv.eval.speed import synthetic_options

    selector = make_selector(name, **synthetic_options(model, name, {}, 0, folder))
    chunk = min(PREFILL_CHUNK, context)
    session = StaticSession(model, selector, SparsityConfig(budget, dense_layers=0), context, room, chunk, batch=b)
    cache = session.bind(session.new_cache())
    modules, scaling = [SimpleNamespace(layer_idx=i) for i in range(layers)], d**-0.5
    with torch.no_grad():
        for start, stop in prompt_chunks(context, chunk):
            n = stop - start
            session.token_ids = torch.zeros(b, n, dtype=torch.long, device=shape.device)
            for layer, module in zip(cache.layers, modules):
                keys, values = layer.update(shape.randn(b, hkv, n, d), shape.randn(b, hkv, n, d))
                session.hidden[module.layer_idx] = shape.randn(b, n, hq * d)
                session.attend(module, shape.randn(b, hq, n, d), keys, values, None, scaling)
        session.finish_prompt(None)
    inputs = [(shape.randn(b, hq, 1, d), shape.randn(b, hkv, 1, d), shape.randn(b, 1, hq * d)) for _ in modules]
    ids = torch.zeros(b, 1, dtype=torch.long, device=shape.device)
    counted = session.step_counters(cache)

    def attend() -> torch.Tensor:
        session.token_ids = ids
        for layer, module, (query, new, hidden) in zip(cache.layers, modules, inputs):
            session.hidden[module.layer_idx] = hidden
            keys, values = layer.update(new, new)
            out = session.attend(module, query, keys, values, None, scaling)
        return out

    def step() -> torch.Tensor:
        for layer in cache.layers:
            layer.seen += 1
        return counted(attend)

    step.layers = cache.layers  # what the step holds, for checks
    return step


def hook_step(name: str, shape: Shape, budget: int) -> Callable[[], torch.Tensor]:
    """One decode step of a managed layer on the reference path (cache filled with `shape.context`
    tokens; an evicting selector's cache holds only its budget, as after its prefill eviction)."""
    b, context = shape.batch, shape.context
    hq, hkv, d = shape.geometry
    selector = make_selector(name)
    session = SparseSession(SimpleNamespace(config=shape.config()), selector, SparsityConfig(budget, dense_layers=0))
    layer = session.bind(None).layers[0]
    held = budget if selector.evicts else context
    layer.seen = 0
    layer.update(shape.randn(b, hkv, held, d), shape.randn(b, hkv, held, d))
    layer.seen = context  # evicting selectors: the tokens before the held ones were dropped
    layer.slot_pos[..., :held] += context - held
    module = SimpleNamespace(layer_idx=0)
    query, new = shape.randn(b, hq, 1, d), shape.randn(b, hkv, 1, d)

    def step():
        keys, values = layer.update(new, new)
        return session.attend(module, query, keys, values, None, d**-0.5)

    step.layers = [layer]
    return step


def step_milliseconds(step: Callable[[], torch.Tensor], device: torch.device, graph: bool, repeat: int,
                      replays: int) -> float:  # fmt: skip
    """Milliseconds per step: `repeat` steps per call (captured in one CUDA graph with `graph`, the
    host-side counters baked in at capture as `generate`'s graphs bake them), CUDA events over
    `replays` calls after two untimed ones; the wall clock off CUDA."""
    import time

    def run_eagerly():
        for _ in range(repeat):
            step()

    call = run_eagerly
    if device.type == "cuda" and graph:
        side = torch.cuda.Stream(device)  # warm-up off the capture stream, as CUDA graph capture wants
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run_eagerly()
        torch.cuda.current_stream(device).wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run_eagerly()
        call = captured.replay
    for _ in range(2):
        call()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            call()
        return (time.perf_counter() - t0) * 1e3 / (replays * repeat)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(replays):
        call()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / (replays * repeat)


def bench_decode_attention(
    selectors: Sequence[str],
    batch_sizes: Sequence[int] = (1, 16),
    contexts: Sequence[int] = (8192, 32768, 131072),
    budget_fraction: float = 0.05,
    geometry: str = "llama3-8b",
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    replays: int = 20,
    repeat: int = 16,
    progress: bool = True,
    layers: int | None = None,
) -> list[BenchRecord]:
    """Milliseconds per layer of a decode step, SDPA and per method, for every batch x context.
    `selectors`: selector names (the fast path) or `hook:<name>` (the reference path, one layer);
    `layers`: layers per step (None: `rotation`'s choice per setting)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of: {', '.join(GEOMETRIES)}")
    if not 0 < budget_fraction < 1:
        raise ValueError(f"budget_fraction must lie in (0, 1), got {budget_fraction}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1 (or left out: enough to exceed the L2 cache), got {layers}")
    methods = check_methods(selectors, RUNTIMES)
    device = torch.device(device)
    records = []
    cases = [(b, s) for b in batch_sizes for s in contexts]
    room = repeat * (replays + 4) + 8  # every step of the warm-up, capture and replays has a free slot
    # the first case runs twice, untimed the first time: kernel compilation and clock ramp-up
    # must not land in whichever setting happens to come first
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for n, (batch, context) in enumerate(tqdm([cases[0], *cases], desc="bench", disable=not progress)):
            shape = Shape(batch, context, GEOMETRIES[geometry], dtype, device)
            budget = max(1, math.ceil(budget_fraction * context))
            count = layers if layers is not None else rotation(shape, budget)
            step, backend = sdpa_step(shape, room, count)
            dense_ms = step_milliseconds(step, device, True, repeat, replays) / count
            del step
            case = [BenchRecord(SDPA, batch, context, budget, dense_ms, 1.0, backend, count)]
            for name, method in zip(selectors, methods):
                hook = method.runtime == HOOK
                if hook:
                    step = hook_step(method.name, shape, budget)
                else:
                    step = fast_step(method.name, shape, budget_fraction, room, Path(folder), count)
                ms = step_milliseconds(step, device, not hook, repeat, replays) / (1 if hook else count)
                del step
                case.append(BenchRecord(name, batch, context, budget, ms, dense_ms / ms, layers=1 if hook else count))
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
            elif name == SDPA:
                cells.append(f"{r.milliseconds:.3f} ms ({r.backend})")
            else:
                cells.append(f"{r.milliseconds:.3f} ms ({r.speedup:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    counts = ", ".join(f"B={b} {c / 1024:g}K: {cell[(SDPA, b, c)].layers}" for b, c in cases if (SDPA, b, c) in cell)
    lines.append(
        f"\nPer layer; layers per timed step (each its own cache, so the L2 cache does not hold them): {counts}."
    )
    return "\n".join(lines)


def write(records: list[BenchRecord], out: Path, meta: dict) -> None:
    """table.md and bench.json under `out` (the evaluations' report writer)."""
    write_report(out, markdown(records), {"meta": meta, "records": records}, json_name="bench.json")
