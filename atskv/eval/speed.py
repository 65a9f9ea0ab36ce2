"""End-to-end decode speed: prefill, then N decode steps through `generate`, for plain transformers
(its own cache and SDPA, no atskv: what a user runs instead), atskv's fast path (dense and every
selector it supports) and, on request, the reference hook (`atskv.sparse` + `model.generate`),
all in one run on one GPU, with ratios to plain from that run. `host:<selector>` runs the fast
path with its host tier (`HostRetrieval`): the selector's budget stays on the GPU, every token also
in pinned host memory, the best parked pages read back each step.

Per method and shape: ms per decode step (the median interval between tokens after the first,
read by a streamer that synchronises the device once per token, in both loops), tokens/s over
the batch, the allocator's peak above the weights (prefill included), its peak while decoding
(from the first new token on: what serving the batch holds, the prefill's transients gone) and
the pinned host memory it took, and the prefill's seconds. Each timed generation follows an untimed
one of the prompt's last chunk, so the prefill excludes what a method pays once per process
(compiles, first calls). `largest_batches` finds, per method, the largest batch (doubling) that runs in a fixed
GPU memory: the weights plus a stated KV allowance, enforced through the allocator's limit.
Speed needs a model's shape, not its weights, so `shape_model` builds 8B-class models from their published configs
with random weights straight on the GPU; quality comes from the real models elsewhere.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

import atskv
from atskv.budget import check_budget
from atskv.eval.generation import TokenClock
from atskv.eval.method import DENSE, HOOK, HOST, OWN, PLAIN, PLAIN_STATIC, Method, check_methods
from atskv.eval.report import write_report
from atskv.eval.rows import RowStore
from atskv.eval.shapes import SHAPES
from atskv.runtime.fast.host_pages import HostRetrieval, pinned_peak, reset_peak_pinned
from atskv.selectors import SELECTORS, make_selector, name_parts

RUNTIMES = (PLAIN, PLAIN_STATIC, OWN, HOOK, HOST)  # the methods' runtimes timed here (OWN: the fast path)


@dataclass(frozen=True)
class DecodeRun:
    """What every method of one measurement shares: the budget (GPU tokens per managed layer and
    KV head), decode steps, prompt chunk, dense first layers, `host_tier` (the host tier a `host:`
    method runs with: tokens read back per step in whole pages, the GPU page cache, what ranks the
    parked pages) and per-selector options (`{"learned": {"predictor": ...}}`; learned without a
    predictor gets a random one of the model's shape); `compile`: the fast path's decoder layers
    `torch.compile`d; `padding`: ragged prompts (`ragged_mask`), every method given the same
    attention mask; `profile`: each timed run also writes a profile there (`profiled`)."""

    budget: int | float = 0.05
    new_tokens: int = 64
    prefill_chunk: int = 8192
    dense_layers: int = 2
    host_tier: HostRetrieval = field(default_factory=HostRetrieval)
    selector_options: dict = field(default_factory=dict)
    compile: bool = False
    padding: float = 0.0
    profile: Path | None = None  # a folder for each timed run's profile (`profiled`)

    def __post_init__(self):  # bad settings fail here, before a model is built
        check_budget(self.budget)
        if not 0.0 <= self.padding < 1.0:
            raise ValueError(f"padding must be in [0, 1), got {self.padding}")


@dataclass
class SpeedRecord:
    model: str
    method: str  # a `Method`: "plain", "dense", a selector name, "hook:<selector>", ...
    batch: int
    context: int
    budget: int | float | None
    ms_per_step: float | None  # None: did not run (see `error`)
    tokens_per_s: float | None
    peak_gib: float | None  # allocator peak above the weights
    prefill_s: float | None
    ratio: float | None = None  # ms_per_step / plain's, same run (< 1: faster than plain)
    error: str = ""
    host_gib: float | None = None  # pinned host memory the run took (a tier's store)
    gpu_limit_gib: float | None = None  # `largest_batches`: the KV allowance above the weights
    decode_gib: float | None = None  # allocator peak above the weights from the first new token on


def shape_model(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A model of a published shape with random weights, built directly on `device` in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_predictor(model, dense_layers: int, folder: Path) -> Path:
    """A predictor of `model`'s shape with random weights (the default widths), exported to
    `folder`: what the learned selector costs does not depend on what it learned."""
    from atskv.features import SCALAR_FEATURES
    from atskv.models.geometry import model_geometry
    from atskv.predictor.capture import managed_layers
    from atskv.predictor.export import export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP

    text = model.config.get_text_config(decoder=True)
    managed = managed_layers(model, dense_layers)
    spec = FeatureSpec(text.hidden_size, SCALAR_FEATURES, len(managed), text.num_key_value_heads)
    types = torch.zeros(text.vocab_size, dtype=torch.int8)
    export_predictor(RelevanceMLP(spec).eval(), types, folder, base_model="random",
                     geometry=model_geometry(model.config), managed_layers=managed, overwrite=True)  # fmt: skip
    return folder


def spaced_profile(model, dense_layers: int, anchors: int = 5):
    """A Kascade profile of `model`'s shape without measuring it: `anchors` anchor layers evenly
    spaced over the managed ones (the paper's count for 32-layer models), every reuse head on the
    anchor head of its own index. What Kascade costs depends on how many anchors, not which."""
    from atskv.models.geometry import model_geometry
    from atskv.predictor.capture import managed_layers
    from atskv.selectors.kascade.profile import KascadeProfile

    geometry, managed = model_geometry(model.config), managed_layers(model, dense_layers)
    chosen = sorted({managed[i * len(managed) // anchors] for i in range(min(anchors, len(managed)))})
    heads = list(range(geometry.num_kv_heads))
    n = len(managed)
    return KascadeProfile("spaced", geometry, managed, chosen,
                          {layer: heads for layer in managed if layer not in chosen}, [[1.0] * n for _ in managed],
                          [1.0] * n, topk=0, queries=0, dev_set="")  # fmt: skip


def synthetic_options(model, name: str, options: dict, dense_layers: int, folder: Path) -> dict:
    """`options` given made-up per-model state (`Selector.per_model`) for each part of `name` that
    needs some and was not given (a composition takes a part's options under the part's name): a
    timing needs the model's shape, not state measured on it."""
    synthetic = {
        "predictor": lambda: random_predictor(model, dense_layers, folder),
        "profile": lambda: spaced_profile(model, dense_layers),
    }
    for part in name_parts(name):
        argument = SELECTORS[part].per_model
        if argument is not None:
            given = options if part == name else options.setdefault(part, {})
            if argument not in given:
                given[argument] = synthetic[argument]()
    return options


def _selector(model, method: str, run: DecodeRun, folder: Path):
    """The selector `method` runs (None for plain transformers), per-model state made up."""
    name = Method.parse(method).name
    if not name:
        return None
    options = {key: dict(v) if isinstance(v, dict) else v for key, v in run.selector_options.get(name, {}).items()}
    return make_selector(name, **synthetic_options(model, name, options, run.dense_layers, folder))


def ragged_mask(batch: int, context: int, padding: float, device=None) -> torch.Tensor | None:
    """Left padding for a batch of unequal prompts, as they are served together: row i starts with
    round(padding x context x i / (batch - 1)) pad positions (the first row whole, the last one
    `padding` shorter); None when nothing is padded."""
    pads = [round(padding * context * i / max(1, batch - 1)) for i in range(batch)]
    if not any(pads):
        return None
    return (torch.arange(context).unsqueeze(0) >= torch.tensor(pads).unsqueeze(1)).long().to(device)


class PhaseClock(TokenClock):
    """A `TokenClock` that splits the allocator's peak at the first new token: the peak so far
    (prefill included) is kept in `prefill_peak` and the peak restarted, so the allocator's peak
    at the end is the decode phase's alone. CUDA only (elsewhere it only times)."""

    prefill_peak: int = 0

    def put(self, value) -> None:
        super().put(value)
        if len(self.times) == 2 and self.device.type == "cuda":
            self.prefill_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)


def run_method(model, method: str, ids: torch.Tensor, run: DecodeRun, clock: PhaseClock) -> tuple[float, float]:
    """One timed generation through `clock`, after an untimed one of the prompt's last chunk, so
    that what a method pays once per process (Triton's compiles, cuBLAS's first calls, a random
    predictor's export) is not counted as its prefill; returns (ms per step, prefill seconds)."""
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:

        def made():
            return _selector(model, method, run, Path(folder))

        _generate(model, method, ids[:, -run.prefill_chunk :], replace(run, new_tokens=2), made(), None)
        selector = made()
        with profiled(run.profile, f"{method.replace(':', '-')}-{ids.shape[1]}-b{ids.shape[0]}", ids.device):
            start = time.perf_counter()
            _generate(model, method, ids, run, selector, clock)
    return 1000 * statistics.median(clock.decode_gaps()), clock.times[1] - start


@contextlib.contextmanager
def profiled(folder: Path | None, name: str, device: torch.device):
    """Profile what runs inside into `folder` (nothing without one): `NAME.trace.json`, the
    PyTorch profiler's Chrome trace (CPU ops, and CUDA kernels on a GPU: chrome://tracing or
    https://ui.perfetto.dev), and on a GPU `NAME.memory.pickle`, the allocator's history with each
    allocation's stack (https://pytorch.org/memory_viz): where the time and the peak go. Profiling
    slows the run down: its timings are not the benchmark's."""
    if folder is None:
        yield
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with torch.profiler.profile(activities=activities) as profile:
            yield
        profile.export_chrome_trace(str(folder / f"{name}.trace.json"))
        if cuda:
            torch.cuda.memory._dump_snapshot(str(folder / f"{name}.memory.pickle"))
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)


def _generate(model, method: str, ids: torch.Tensor, run: DecodeRun, selector, streamer) -> None:
    """`method`'s generation of `run.new_tokens` greedy tokens after `ids`, the same attention mask
    for every method (`ragged_mask`)."""
    mask = ragged_mask(*ids.shape, run.padding, ids.device)
    plain = dict(max_new_tokens=run.new_tokens, min_new_tokens=run.new_tokens, do_sample=False, streamer=streamer,
                 attention_mask=mask)  # fmt: skip
    runtime = Method.parse(method).runtime
    if runtime == PLAIN:
        model.generate(ids, **plain)
    elif runtime == PLAIN_STATIC:  # transformers' static cache, whose decode step it compiles (CUDA graphs)
        model.generate(ids, **plain, cache_implementation="static")
    elif runtime == HOOK:
        with atskv.sparse(model, selector, run.budget, dense_layers=run.dense_layers):
            model.generate(ids, **plain)
    else:
        tier = run.host_tier if runtime == HOST else None
        atskv.generate(model, ids, selector, run.budget, max_new_tokens=run.new_tokens, attention_mask=mask,
                       dense_layers=run.dense_layers, prefill_chunk=run.prefill_chunk, streamer=streamer, tier=tier,
                       compile=run.compile)  # fmt: skip


def measure(model, model_name: str, methods: Sequence[str], contexts: Sequence[int], batches: Sequence[int],
            run: DecodeRun = DecodeRun(), seed: int = 0,
            store: RowStore | None = None) -> list[SpeedRecord]:  # fmt: skip
    """Every method at every (context, batch), each shape's ratios from its own run. Methods:
    `plain` (transformers' default cache and SDPA), `plain-static` (transformers' static cache,
    its decode step compiled by transformers), `dense` or a selector name (atskv's fast path),
    `host:<selector>` (the fast path with its host tier), `hook:<selector>` (atskv's reference
    session under `model.generate`). With a `store` (`record_store`), each record is kept there as
    it finishes and one the store already has is not measured again."""
    check_methods(methods, RUNTIMES)
    grid = [(c, b, m) for c in contexts for b in batches for m in methods]
    records = []
    for c, b, m in tqdm(grid, desc=f"decode speed, {model_name}", unit="run"):
        key = (model_name, m, c, b)
        if store is None or key not in store:
            record = _timed(model, model_name, m, c, b, run, seed)
            if store is not None:
                store.add(record)
        records.append(store.rows[key] if store is not None else record)
    _ratios(records)
    return records


def record_store(out: Path, settings: dict) -> RowStore[SpeedRecord]:
    """`out/records.jsonl`: the records of runs made with `settings` (what every record of the
    folder shares: model, budget, GPU, ...), by (model, method, context, batch; None for a largest
    batch)."""
    return RowStore(out, settings, "records.jsonl", key=_record_key, from_json=lambda item: SpeedRecord(**item))


def _record_key(r: SpeedRecord) -> tuple:
    return r.model, r.method, r.context, None if r.gpu_limit_gib is not None else r.batch


def largest_batches(
    model, model_name: str, methods: Sequence[str], context: int, kv_gib: float, run: DecodeRun = DecodeRun(),
    max_batch: int = 256, seed: int = 0, store: RowStore | None = None,
) -> list[SpeedRecord]:  # fmt: skip
    """Per method, the largest batch (1, 2, 4, ...) that runs at `context` when the GPU may hold
    the weights plus `kv_gib` GiB (the allocator's per-process limit), with its throughput; a
    method that fits no batch gets its out-of-memory record. CUDA only. With a `store`, as in
    `measure`: a method's record is kept once its search ends."""
    check_methods(methods, RUNTIMES)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError("largest_batches needs a CUDA GPU (it sets the allocator's memory limit)")
    total = torch.cuda.get_device_properties(device).total_memory
    limit = torch.cuda.memory_allocated(device) + kv_gib * 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    records = []
    try:
        for method in tqdm(methods, desc=f"largest batch in {kv_gib:g} GiB, {model_name}", unit="method"):
            if store is not None and (model_name, method, context, None) in store:
                records.append(store.rows[model_name, method, context, None])
                continue
            best, batch = None, 1
            while batch <= max_batch:
                record = _timed(model, model_name, method, context, batch, run, seed)
                if record.ms_per_step is None:
                    break
                best, batch = record, batch * 2
            records.append(replace(best or record, gpu_limit_gib=kv_gib))
            if store is not None:
                store.add(records[-1])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return records


def _timed(model, model_name: str, method: str, context: int, batch: int, run: DecodeRun, seed: int) -> SpeedRecord:
    """One record: the run's time, peaks and error (out of memory, or a method that cannot run)."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed)).to(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_pinned()
    budget = None if Method.parse(method).name in ("", DENSE) else run.budget
    record = SpeedRecord(model_name, method, batch, context, budget, None, None, None, None)
    clock = PhaseClock(device)
    try:
        record.ms_per_step, record.prefill_s = run_method(model, method, ids, run, clock)
        record.tokens_per_s = batch * 1000 / record.ms_per_step
        if cuda:
            decoding = torch.cuda.max_memory_allocated(device)
            record.peak_gib = (max(clock.prefill_peak, decoding) - weights) / 2**30
            record.decode_gib = (decoding - weights) / 2**30
            record.host_gib = pinned_peak() / 2**30
    except torch.OutOfMemoryError as error:
        record.error = "out of memory: " + str(error).split("\n")[0][:120]
    except (ValueError, NotImplementedError, RuntimeError) as error:
        record.error = str(error)[:160]
    return record


def _ratios(records: list[SpeedRecord]) -> None:
    plain = {(r.model, r.batch, r.context): r.ms_per_step for r in records if r.method == PLAIN}
    for r in records:
        base = plain.get((r.model, r.batch, r.context))
        if base and r.ms_per_step:
            r.ratio = r.ms_per_step / base


def write(records: list[SpeedRecord], out: Path, meta: dict) -> Path:
    """table.md, speed.json and speed.png under `out` (the evaluations' report writer); returns
    the table's path."""
    header = [
        f"Decode speed: {meta.get('command', '')}",
        f"GPU {meta.get('gpu', '?')}, {meta.get('date', '')}; {meta.get('new_tokens')} new tokens; "
        "ratio = ms/step over plain transformers' in the same run (< 1 is faster)",
        "",
        "| model | context | batch | method | budget | ms/step | tokens/s | ratio | GPU peak GiB above weights | "
        "of which while decoding | host GiB | prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [_row(r) for r in records]
    paths = write_report(out, "\n".join(header + rows), {"meta": meta, "records": records}, json_name="speed.json",
                         plot=lambda path: _plot(records, path), png_name="speed.png")  # fmt: skip
    return paths["markdown"]


def _row(r: SpeedRecord) -> str:
    batch = f"{r.batch} (largest in {r.gpu_limit_gib:g} GiB)" if r.gpu_limit_gib is not None else r.batch
    first = f"| {r.model} | {r.context} | {batch} | {r.method} | {r.budget or ''} |"
    if r.ms_per_step is None:
        return f"{first} {r.error} | | | | | | |"
    ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
    return (f"{first} {r.ms_per_step:.2f} | {r.tokens_per_s:.0f} | {ratio} | {r.peak_gib or 0:.1f} | "
            f"{r.decode_gib or 0:.1f} | {r.host_gib or 0:.1f} | {r.prefill_s:.1f} |")  # fmt: skip


def _plot(records: list[SpeedRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r.model, r.context, r.batch) for r in records})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in records if (r.model, r.context, r.batch) == shape]
        names = [r.method for r in rows]
        values = [r.tokens_per_s or 0 for r in rows]
        plain = [Method.parse(n).runtime in (PLAIN, PLAIN_STATIC) for n in names]
        ax.barh(names, values, color=["grey" if p else "tab:blue" for p in plain])
        ax.set_title(f"{shape[0]}, {shape[1] // 1024}K, B={shape[2]}", fontsize=9)
        ax.set_xlabel("tokens/s")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
