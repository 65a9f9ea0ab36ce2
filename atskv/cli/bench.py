"""`atskv bench attention|decode|serve|fetch`: how fast, against what a user would run instead.

`decode` is the end-to-end measure (prefill, then decode steps through `generate`, against plain
transformers in the same run); `attention` times one layer's attention step in isolation; `serve`
runs a serving trace through vLLM; `fetch` times the host tier's reads over this machine's link."""

from __future__ import annotations

from pathlib import Path

import torch

from atskv.models import resolve_device


def attention(
    selectors: list[str] = ["quest", "sparq", "learned", "snapkv", "hook:quest"],  # noqa: B006
    batch_sizes: list[int] = [1, 16],  # noqa: B006
    contexts: list[int] = [8192, 32768, 131072],  # noqa: B006
    budget: float = 0.05,
    geometry: str = "llama3-8b",
    replays: int = 20,
    repeat: int = 16,
    out: Path = Path("results/bench"),
    device: str = "auto",
    dtype: str = "auto",
    layers: int | None = None,
) -> None:
    """A layer's whole decode step per method against dense SDPA, as ratios.

    A selector runs the fast path's step (append, selector state, score, pick, attend, evict), captured
    in a CUDA graph as `atskv.generate` runs it; `hook:<selector>` runs the reference path eagerly.
    Timed with CUDA events in the same run as SDPA over the whole context; writes table.md, bench.json.

    Args:
        selectors: selectors to time (see `atskv selectors`); `hook:<name>` for the reference path.
        batch_sizes: batch sizes.
        contexts: context lengths in tokens.
        budget: KV budget as a fraction of the context.
        geometry: attention shape: llama3-8b (32/8 heads, dim 128), smollm2-135m or gemma3-270m.
        replays: timed calls per setting, each `repeat` steps (after two untimed calls).
        repeat: consecutive steps per call (one CUDA graph), so the host's launch is not timed.
        out: output folder.
        device: cuda, cpu, or auto.
        dtype: bfloat16, float16, float32, or auto (bfloat16 on GPU, float32 on CPU).
        layers: layers per timed step, each with its own cache (times are per layer); default:
            enough that a step's sparse reads exceed the GPU's L2 cache 4x (at most 8), as in a model.
    """
    import platform

    from atskv.eval import bench as benchmark

    device, torch_dtype = resolve_device(device, dtype)
    records = benchmark.bench_decode_attention(
        selectors, batch_sizes, contexts, budget, geometry, torch_dtype, device, replays=replays, repeat=repeat,
        layers=layers,
    )
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    meta = {"device": gpu, "dtype": str(torch_dtype), "geometry": geometry, "budget": budget}
    meta["torch"] = torch.__version__
    benchmark.write(records, out, meta)
    print(f"{gpu}, {geometry}, {str(torch_dtype).removeprefix('torch.')}, budget {budget:.0%} of the context\n")
    print(benchmark.markdown(records))




def decode(
    model: str = "llama3.1-8b",
    methods: list[str] = ["plain", "dense", "quest", "sparq", "snapkv", "h2o"],  # noqa: B006
    contexts: list[int] = [32768],  # noqa: B006
    batch_sizes: list[int] = [1],  # noqa: B006
    budget: int | float = 0.05,
    new_tokens: int = 64,
    prefill_chunk: int = 8192,
    dense_layers: int = 2,
    host_tier: dict | None = None,
    gpu_memory: float | None = None,
    max_batch: int = 256,
    out: Path = Path("results/speed"),
    predictor: Path | None = None,
    selector_options: dict | None = None,
    compile: bool = False,
    padding: float = 0.0,
    profile: Path | None = None,
) -> None:
    """End-to-end decode speed against plain transformers, in one run on one GPU.

    Prefill, then `new_tokens` greedy steps through `generate`: plain transformers (`plain`: its
    own cache and SDPA, no atskv; `plain-static`: its static cache, decode compiled by transformers),
    atskv's fast path (`dense` or a selector name; `host:<selector>` with the host tier) and the
    reference hook (`hook:<selector>`: `atskv.sparse` + `model.generate`). Reports ms/step,
    tokens/s, the allocator's peak above the weights, pinned host memory and the ratio to plain;
    with `gpu_memory`, the largest batch each method fits instead; writes table.md, speed.json
    and speed.png. Each record is kept in OUT/records.jsonl as it finishes: a rerun into OUT with
    the same settings (model, budget, GPU, ...) measures only the records it lacks.

    Args:
        model: an 8B-class shape with random weights (llama3.1-8b, qwen3-8b, mistral-7b), or a
            real model (a name, a Hugging Face directory or a .gguf file).
        methods: plain, plain-static, dense, selector names (fast path), host:<selector> (fast
            path with the host tier; an evicting selector), hook:<selector> (reference path),
            vllm (vanilla vLLM) and vllm:<selector> (vLLM with atskv's plugin: `atskv selectors`
            lists its selectors; learned without a predictor gets a random one of the shape that
            reads no hidden state), each engine in its own process on the shape's config with dummy
            weights; their rows go to OUT/vllm.jsonl as they finish, and a rerun skips the rows
            already there.
        contexts: prompt lengths in tokens.
        batch_sizes: batch sizes.
        budget: KV budget per managed layer and KV head: tokens (int) or a fraction of the context.
        new_tokens: decode steps per run.
        prefill_chunk: prompt tokens per forward on the fast path.
        dense_layers: first layers kept dense.
        host_tier: the host: methods' host tier, `atskv.HostRetrieval` options as the leaderboard's
            `--host_tier` takes them, e.g. '{tokens: 1024, cache: 2, summary: int4}': tokens read
            back per step, layer and KV head, in pages of `page_size`; the GPU page cache in
            multiples of a step's read; what ranks the parked pages (int4, the default: every key
            in 4 bits; bounds: Quest's page key min/max). Null: its defaults.
        gpu_memory: GiB of GPU memory above the weights: find the largest batch (1, 2, 4, ...,
            max_batch) each method fits in it, at each context, instead of timing batch_sizes.
        max_batch: the largest batch tried with gpu_memory.
        out: output folder (resumable: records.jsonl, settings.json).
        predictor: the learned selector's predictor (file or folder); default: a random one of the
            model's shape (its cost does not depend on what it learned).
        selector_options: options per selector name, e.g. '{quest: {page_size: 32}}'.
        compile: atskv's fast path decodes through `torch.compile`d decoder layers
            (`atskv.generate(compile=True)`); its one-time compile is not in ms/step.
        padding: unequal prompts in a batch: row i is left-padded by padding x context x i /
            (batch - 1) tokens (the first whole, the last `padding` shorter), the same attention
            mask for every method; 0: equal prompts.
        profile: a folder: each method's timed run (prefill and decode) also writes the PyTorch
            profiler's trace there and, on a GPU, the allocator's history with stacks (for
            https://pytorch.org/memory_viz); profiled runs are slower, so time without it.
    """
    import dataclasses
    import datetime
    import json
    import sys

    from atskv.errors import built_from_option
    from atskv.eval import speed, vllm_speed
    from atskv.eval.method import VLLM, check_methods
    from atskv.runtime.fast.host_pages import HostRetrieval
    from atskv.selectors import selector_options as options_for

    parsed = check_methods(methods, (*speed.RUNTIMES, VLLM))  # every method, before an engine or a model
    if on_vllm := [m for m, p in zip(methods, parsed) if p.runtime == VLLM]:
        vllm_rows = _vllm_methods(on_vllm, model, contexts, batch_sizes, budget, new_tokens, dense_layers,
                                  selector_options, Path(out))  # fmt: skip
        print(vllm_speed.table(vllm_rows))
        methods = [m for m, p in zip(methods, parsed) if p.runtime != VLLM]
        if not methods:
            return
    names = [p.name for p in parsed if p.runtime != VLLM and p.name]
    options = options_for(sorted(set(names)), selector_options, predictor)
    tier = built_from_option("--host_tier", lambda: HostRetrieval(**(host_tier or {})))
    run = speed.DecodeRun(budget, new_tokens, prefill_chunk, dense_layers, tier, options,
                          compile, padding, profile)  # fmt: skip
    if gpu_memory is not None and (gpu_memory <= 0 or max_batch < 1):
        raise ValueError(f"need gpu_memory > 0 GiB and max_batch >= 1, got {gpu_memory} and {max_batch}")
    if not torch.cuda.is_available():
        print("note: no CUDA GPU here; these timings say nothing about GPU speed", file=sys.stderr)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    shared = dict(model=model, gpu=gpu, torch=torch.__version__, budget=budget, new_tokens=new_tokens,
                  prefill_chunk=prefill_chunk, dense_layers=dense_layers, host_tier=dataclasses.asdict(tier),
                  selector_options=options, compile=compile, padding=padding, gpu_memory=gpu_memory,
                  max_batch=max_batch)  # fmt: skip
    store = speed.record_store(Path(out), json.loads(json.dumps(shared, default=str)))
    if model in speed.SHAPES:
        loaded = speed.shape_model(model, device)
    else:
        from atskv.models import load_model

        loaded = load_model(model, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32).model
    if gpu_memory is None:
        records = speed.measure(loaded, model, methods, contexts, batch_sizes, run, store=store)
    else:
        records = [r for c in contexts
                   for r in speed.largest_batches(loaded, model, methods, c, gpu_memory, run, max_batch,
                                                  store=store)]  # fmt: skip
    meta = {
        "command": "atskv bench decode " + " ".join(sys.argv[3:]),
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "new_tokens": new_tokens,
        "torch": torch.__version__,
    }
    table = speed.write(records, Path(out), meta)
    print(table.read_text())
    print(f"written to {out}/ (table.md, speed.json, speed.png)")


def _vllm_methods(methods, model, contexts, batches, budget, new_tokens, dense_layers, selector_options, out: Path):
    """The vLLM methods of `decode`, each engine in its own process; returns the rows' file."""
    import tempfile

    from atskv.errors import InputError
    from atskv.eval import vllm_speed
    from atskv.eval.method import Method

    if model not in vllm_speed.SHAPES:
        raise InputError(f"vllm methods run a shape with dummy weights; shapes: {', '.join(vllm_speed.SHAPES)}")
    shape = vllm_speed.write_shape(model, Path(tempfile.mkdtemp()) / model)
    runs = [(c, b) for c in contexts for b in batches]
    options = selector_options or {}
    specs = [vllm_speed.EngineSpec(m, str(shape), runs, new_tokens, budget, dense_layers,
                                   vllm_speed.timing_options(m, options.get(Method.parse(m).name, {}), model,
                                                             dense_layers, shape.parent / "predictor"))
             for m in methods]  # fmt: skip
    rows = out / "vllm.jsonl"
    vllm_speed.measure(specs, rows)
    if not rows.is_file():
        raise InputError("no vLLM engine wrote a row: each one's error is above")
    return rows


def serve(
    model: str = "llama3.1-8b",
    methods: list[str] = ["vllm", "vllm:streaming_llm", "vllm:quest"],  # noqa: B006
    rates: list[float] = [0.25, 0.5, 1.0],  # noqa: B006
    requests: int = 32,
    shortest: int = 16384,
    longest: int = 131072,
    new_tokens: int = 128,
    budget: int | float = 0.05,
    dense_layers: int = 2,
    free_blocks: bool = False,
    host_tier: dict | None = None,
    limit_s: float = 300.0,
    selector_options: dict | None = None,
    engine: dict | None = None,
    out: Path = Path("results/serve"),
) -> None:
    """A serving trace through vanilla vLLM and vLLM + atskv, in one run on one GPU.

    Requests of `shortest`-`longest` prompt tokens (log-uniform) arrive as a Poisson process at each
    rate; reports output tokens/s, mean and P99 time to first token and between tokens, and the
    requests finished within `limit_s`. Each engine runs in its own process on the shape's config
    with dummy weights; rows go to OUT/trace.jsonl as they finish and a rerun skips those there;
    OUT/trace.png plots them.

    Args:
        model: an 8B-class shape (llama3.1-8b, qwen3-8b, mistral-7b).
        methods: vllm (vanilla) and vllm:<selector> (atskv's plugin: `atskv selectors` lists them).
        rates: arrival rates, requests per second.
        requests: requests per trace.
        shortest: the shortest prompt, tokens.
        longest: the longest prompt, tokens (cut to the shape's positions less new_tokens).
        new_tokens: tokens each request generates.
        budget: the plugin's KV budget per KV head: tokens (int) or a fraction of the context.
        dense_layers: first layers kept dense by the plugin.
        free_blocks: selectors that free blocks (streaming_llm; h2o and learned, their kept tokens
            compacted) hand the blocks their sparse layers will not read back to vLLM's pool (rows
            labelled "<method> (free_blocks)"); the learned selector is timed with a random predictor.
        host_tier: with free_blocks, what snapkv, h2o and learned free is parked in pinned host
            memory and each decode query reads back its best pages, e.g. '{regions: 4, pages: 16}' or
            '{gib: 60}' (as many requests' prompts as 60 GiB a GPU hold)
            (`atskv.runtime.vllm.host_tier.HostTier`; rows report the bytes read back a token).
        limit_s: a trace stops here, finished or not.
        selector_options: options per selector name, e.g. '{learned: {predictor: DIR}}' (rows
            labelled with them).
        engine: vLLM's own settings for every engine, e.g. '{max_num_batched_tokens: 2048}' (its
            prefill chunk; rows labelled with them).
        out: output folder.
    """
    import tempfile

    from atskv.errors import InputError
    from atskv.eval import vllm_speed, vllm_trace
    from atskv.eval.method import VLLM, check_methods

    if model not in vllm_speed.SHAPES:
        raise InputError(f"serve runs a shape with dummy weights; shapes: {', '.join(vllm_speed.SHAPES)}")
    check_methods(methods, (VLLM,))
    shape = vllm_speed.write_shape(model, Path(tempfile.mkdtemp()) / model)
    specs = vllm_trace.serving_specs(methods, model, shape, new_tokens, budget, dense_layers, free_blocks,
                                     selector_options or {}, engine or {}, host_tier)  # fmt: skip
    traces = [vllm_trace.Trace(r, requests, shortest, longest, new_tokens, limit_s=limit_s) for r in rates]
    rows = Path(out) / "trace.jsonl"
    vllm_trace.measure(specs, traces, rows)
    if not rows.is_file():
        raise InputError("no vLLM engine wrote a trace row: each one's error is above")
    print(vllm_trace.table(rows))
    vllm_trace.plot(rows, rows.with_suffix(".png"))
    print(f"written to {out}/ (trace.jsonl, trace.png)")


def fetch(
    stored_tokens: int = 131072,
    fetched: list[int] = [64, 256, 1024, 4096, 16384],  # noqa: B006
    geometry: str = "llama3-8b",
    repeats: int = 50,
    out: Path = Path("results/host-fetch"),
) -> None:
    """The host tier's reads of parked tokens on this machine, against one pinned copy of the same bytes.

    A decode step with `atskv.HostRetrieval` gathers whole pages of parked keys and values out of
    pinned host memory through a device alias, inside the step's CUDA graph. Per count of tokens
    read back, this times that gather for one layer against one contiguous pinned copy of the same
    bytes, in the same run; writes table.md and fetch.json. Needs a CUDA GPU.

    Args:
        stored_tokens: tokens per KV head in the pinned store (pages of 16).
        fetched: tokens read back per KV head and layer (the tier's `tokens`), in whole pages.
        geometry: KV shape of one layer: llama3-8b (8 KV heads, dim 128), smollm2-135m or gemma3-270m.
        repeats: timed calls per count (after one untimed call).
        out: output folder.
    """
    from atskv.errors import InputError
    from atskv.eval import host_fetch
    from atskv.eval.bench import GEOMETRIES

    if geometry not in GEOMETRIES:
        raise InputError(f"unknown geometry {geometry!r}; known: {', '.join(GEOMETRIES)}")
    if stored_tokens < 16 or not fetched or min(fetched) < 1:
        raise InputError(f"need stored_tokens >= 16 and fetched counts >= 1, got {stored_tokens} and {fetched}")
    if not torch.cuda.is_available():
        raise InputError("bench fetch times reads of pinned host memory by a CUDA GPU; there is none here")
    _, kv_heads, head_dim = GEOMETRIES[geometry]
    records = host_fetch.measure(stored_tokens, fetched, kv_heads, head_dim, repeats=repeats)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, geometry=geometry, kv_heads=kv_heads,
                head_dim=head_dim, stored_tokens=stored_tokens)  # fmt: skip
    print(host_fetch.write(records, Path(out), meta).read_text())


COMMANDS = {
    "attention": attention,
    "decode": decode,
    "serve": serve,
    "fetch": fetch,
    "_help": "Speed: end-to-end decode against plain transformers and vLLM, a serving trace, one attention step, "
    "or the host tier's reads.",
}
