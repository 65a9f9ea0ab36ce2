"""The two-tier KV store measured (issue 5): GPU KV memory by the allocator, task accuracy and
perplexity, decode-step latency, for GPU budgets given as fractions of the prompt, with
retrieval off / LSH / FAISS, each beside the dense model measured in the same run; and the
host-to-device bandwidth of the tier's fetches against a plain pinned copy on the same GPU.

    python benchmarks/tiered_measure.py --model M --out DIR [--selector learned --predictor P]
        [--context 8192] [--budgets 0.1 0.2 0.5] [--retrieval off lsh faiss faiss-4096]
        [--tasks needle_single passkey --trials 8 --depths 0.1 0.5 0.9] [--ppl_windows 4] [--decode_steps 64]
        [--adaptive] [--ceilings oracle learned [--ceiling_budgets 0.1 0.2]]
    python benchmarks/tiered_measure.py --out DIR --replot results-a.json results-b.json  # one figure of several runs

`--retrieval lsh-N / faiss-N / exact-N[-everyK]` retrieves the N best parked candidates per step
(on one step in K).
`--ceilings` adds perplexity under `atskv.sparse` at the same budgets (the whole KV on the GPU,
attention reads only each selector's choice): with `oracle` (every query's own top tokens by
exact attention) it is what any selection of that many tokens can reach, the ceiling for the
active tier plus retrieval.

Writes DIR/summary.md and DIR/results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import atskv
from atskv.data import corpus_windows
from atskv.eval.perplexity import evaluate_perplexity
from atskv.eval.tasks import evaluate_tasks
from atskv.models import load_model, resolve_device
from atskv.runtime.reference.host_tier import HostTier
from atskv.runtime.reference.sparsity import LayerPolicy
from atskv.selectors import make_selector
from atskv.slot_cache import kv_bytes

RETRIEVAL = {
    "off": dict(retrieve=0),
    "lsh": dict(index="lsh"),
    "faiss": dict(index="faiss"),
    "lsh-every8": dict(index="lsh", retrieve_every=8),  # retrieval on one decode step in 8
}


def retrieval(mode: str) -> dict:
    """The retrieval options of `mode`: a name of RETRIEVAL, or `<index>-<n>[-every<k>]` (e.g.
    `exact-4096-every2`: the n best parked candidates, on one decode step in k)."""
    if mode in RETRIEVAL:
        return dict(RETRIEVAL[mode])
    index, _, rest = mode.partition("-")
    n, _, every = rest.partition("-every")
    if index in ("lsh", "faiss", "exact") and n.isdigit() and int(n) > 0 and (not every or every.isdigit()):
        return dict(index=index, retrieve=int(n), retrieve_every=int(every or 1))
    raise argparse.ArgumentTypeError(
        f"retrieval {mode!r}: one of {', '.join(RETRIEVAL)}, or lsh-N / faiss-N / exact-N, optionally -everyK"
    )


def tiering(mode: str, budget: float, adaptive: bool) -> dict:
    """The `atskv.tiered` options of a run. Not adaptive (the default here): the quantile is fixed
    at 1 - budget, so the soft rule and the hard cap agree and the active tier sits at the budget
    from the end of the prompt on; adaptive: the default `LayerPolicy` (q from 0.5 to 0.9 with
    memory pressure), whose tier settles over several refreshes wherever its quantile puts it."""
    options = retrieval(mode)
    if not adaptive:
        options["policy"] = LayerPolicy(q_min=1.0 - budget, q_max=1.0 - budget)
    return options


def run_decode(model, prompt: torch.Tensor, steps: int, session_factory=None) -> dict:
    """Prefill `prompt` `[1, T]` and decode `steps` greedy tokens; GPU bytes the cache holds by the
    allocator (after the run, everything else freed; 0 on CPU) and the median / mean decode-step time."""
    cuda = prompt.is_cuda
    sync = torch.cuda.synchronize if cuda else lambda: None
    allocated = torch.cuda.memory_allocated if cuda else lambda: 0
    gc.collect()  # earlier runs' caches must not be freed inside this run's measurement
    sync()
    if cuda:
        torch.cuda.empty_cache()
    base = allocated()
    times = []
    with torch.inference_mode(), session_factory() if session_factory else contextlib.nullcontext() as session:
        cache = session.new_cache() if session else DynamicCache(config=model.config)
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)  # untimed: the prompt's moves drain
        sync()
        before_steps = allocated()
        if cuda:  # what a step allocates beyond what is held (retrieved blocks included)
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - start)
        sync()
        held = allocated()
        record = {
            "allocated_bytes": held - base,
            "step_working_bytes": torch.cuda.max_memory_allocated() - before_steps if cuda else 0,
            "cache_kv_bytes": kv_bytes(cache),
            "decode_ms_median": 1e3 * statistics.median(times),
            "decode_ms_mean": 1e3 * statistics.mean(times),
        }
        if session is not None:
            record["host_bytes"] = cache.host_bytes()
            record["moved"] = vars(cache.stats)
            record["read_bytes_per_step"] = cache.stats.read_bytes / max(1, steps)  # host -> GPU for attention
            active = [cache.layers[i].occupied.sum(-1).float().mean().item() for i in sorted(cache.managed_layers)]
            record["active_tokens_mean"] = round(statistics.mean(active), 1)
        del cache, session, token
    gc.collect()
    sync()
    record["cache_owned_bytes"] = held - allocated()  # what dropping the cache (and its selector state) frees
    return record


def copy_bandwidth(device: str, kv_heads: int, head_dim: int, dtype) -> dict:
    """GB/s of a 256 MiB pinned host-to-device copy (the ceiling) and of `HostTier.fetch` of n
    scattered tokens (gather on the host, one pinned copy per tensor)."""
    out = {}
    if not device.startswith("cuda"):
        return out
    block = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        block.to(device, non_blocking=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    out["pinned_copy_GBps"] = block.nbytes / elapsed / 1e9
    capacity = 32768
    tier = HostTier(1, kv_heads, head_dim, head_dim, capacity, dtype)
    keys = torch.randn(1, kv_heads, capacity, head_dim, dtype=dtype)
    tier.park(keys, keys.clone(), torch.arange(capacity).expand(1, kv_heads, capacity).contiguous())
    for n in (64, 1024, 16384):
        positions = torch.stack([torch.randperm(capacity)[:n] for _ in range(kv_heads)]).unsqueeze(0)
        tier.fetch(positions, device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        repeats = 10
        for _ in range(repeats):
            tier.fetch(positions, device)
        torch.cuda.synchronize()
        moved = repeats * 2 * positions.numel() * head_dim * keys.element_size()
        out[f"fetch_{n}_tokens_GBps"] = moved / (time.perf_counter() - start) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--replot", nargs="+", type=Path, metavar="RESULTS", help="plot results files into DIR, no run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--selector", default="learned")
    parser.add_argument("--predictor", help="exported predictor (the learned selector)")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument(
        "--retrieval",
        nargs="+",
        default=["off", "lsh", "faiss"],
        help="off, lsh, faiss, lsh-every8, or lsh-N, faiss-N, exact-N, each optionally -everyK",
    )
    parser.add_argument("--tasks", nargs="*", default=["needle_single", "passkey"])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--corpus", default="moby-dick")
    parser.add_argument("--ppl_windows", type=int, default=4)
    parser.add_argument("--decode_steps", type=int, default=64)
    parser.add_argument("--dense_layers", type=int, default=2)
    parser.add_argument("--adaptive", action="store_true", help="default LayerPolicy instead of q = 1 - budget")
    parser.add_argument("--ceilings", nargs="*", default=[], help="selectors for perplexity under atskv.sparse")
    parser.add_argument("--ceiling_budgets", type=float, nargs="+", help="budgets of --ceilings (default: --budgets)")
    args = parser.parse_args()
    if args.replot:  # labels: what follows "results-" in each file name
        runs = {path.stem.removeprefix("results-"): json.loads(path.read_text()) for path in args.replot}
        args.out.mkdir(parents=True, exist_ok=True)
        plot(runs, args.out / "quality-memory.png")
        return
    if not args.model:
        parser.error("--model is required (unless --replot)")
    for mode in args.retrieval:
        try:
            retrieval(mode)
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))

    device, dtype = resolve_device("auto", "auto")
    loaded = load_model(args.model, dtype=dtype, device=device)
    model = loaded.model
    options = {"predictor": args.predictor} if args.predictor else {}
    selector = make_selector(args.selector, **options)
    text = loaded.model.config.get_text_config(decoder=True)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    results: dict = {"model": loaded.name, "context": args.context, "gpu": gpu}
    results["bandwidth"] = copy_bandwidth(device, text.num_key_value_heads, text.head_dim, dtype)
    print(results["bandwidth"], flush=True)

    windows = corpus_windows(loaded.tokenizer, args.corpus, args.context, args.ppl_windows)
    prompt = windows[:1, : args.context - args.decode_steps].to(device)
    runs = {"dense": run_decode(model, prompt, args.decode_steps)}
    for mode in args.retrieval:
        for budget in args.budgets:
            factory = lambda b=budget, m=mode: atskv.tiered(  # noqa: E731
                model, selector, b, dense_layers=args.dense_layers, **tiering(m, b, args.adaptive)
            )
            runs[f"{mode}@{budget}"] = run_decode(model, prompt, args.decode_steps, factory)
            print(f"{mode}@{budget}", runs[f"{mode}@{budget}"], flush=True)
    results["decode"] = runs
    if args.ceilings:  # `learned` is the run's own selector (its predictor); the rest by name
        ceilings = [selector if name == args.selector else make_selector(name) for name in args.ceilings]
        records = evaluate_perplexity(
            model,
            {args.context: windows},
            ceilings,
            args.ceiling_budgets or args.budgets,
            n_eval=64,
            dense_layers=args.dense_layers,
            batch_size=1,
        )
        results["ceilings"] = [vars(r) for r in records]
        print(results["ceilings"], flush=True)
    results["perplexity"], results["tasks"] = {}, {}
    for mode in args.retrieval:
        perplexity, tasks = [], []
        for budget in args.budgets:  # one call per budget: the policy depends on it; keep one dense row
            records = evaluate_perplexity(
                model,
                {args.context: windows},
                [selector],
                [budget],
                n_eval=64,
                dense_layers=args.dense_layers,
                batch_size=1,
                tiering=tiering(mode, budget, args.adaptive),
            )
            perplexity += [vars(r) for r in records if r.budget is not None or not perplexity]
            if args.tasks:
                found = evaluate_tasks(
                    loaded,
                    args.tasks,
                    [args.context],
                    args.depths,
                    args.trials,
                    [selector],
                    [budget],
                    dense_layers=args.dense_layers,
                    batch_size=args.batch_size,
                    tiering=tiering(mode, budget, args.adaptive),
                )
                tasks += [vars(r) for r in found if r.budget is not None or not tasks]
        results["perplexity"][mode], results["tasks"][mode] = perplexity, tasks
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "summary.md").write_text(summary(results, args))
    plot({"": results}, args.out / "quality-memory.png")
    print((args.out / "summary.md").read_text())


def plot(runs: dict[str, dict], path: Path) -> None:
    """Perplexity over dense against the GPU memory the cache holds over dense, one line per run
    and retrieval mode, one point per budget (each against the dense model of its own run): where
    people would rather look than read. `runs` maps a label ("" for a single run) to its results.
    Without CUDA (no allocator figures) the KV buffers stand in for the memory."""
    import matplotlib
    from matplotlib.figure import Figure

    from atskv.figures import save_figure

    first = next(iter(runs.values()))
    measure = "cache_owned_bytes" if first["decode"]["dense"]["cache_owned_bytes"] else "cache_kv_bytes"
    fig = Figure(figsize=(6.4, 4.2) if len(runs) > 1 else (5.2, 3.6))
    ax = fig.subplots()
    ax.set_prop_cycle(color=[matplotlib.colormaps["tab20"](i) for i in range(20)])
    for label, results in runs.items():
        dense_bytes = results["decode"]["dense"][measure]
        for mode, records in results["perplexity"].items():
            dense = next(r["perplexity"] for r in records if r["budget"] is None)
            points = [
                (results["decode"][f"{mode}@{r['budget']}"][measure] / dense_bytes, r["perplexity"] / dense)
                for r in records
                if r["budget"] is not None
            ]
            ax.plot(*zip(*sorted(points)), marker="o", label=f"{label}: {mode}" if label else f"retrieval {mode}")
    ax.axhline(1.0, color="black", lw=0.8, label="dense")
    ax.axhline(1.02, color="grey", ls=":", lw=0.8, label="dense + 2%")
    ax.set(
        xlabel="GPU memory of the cache / dense"
        + (" (allocator)" if measure == "cache_owned_bytes" else " (KV buffers)"),
        ylabel="perplexity / dense",
        title=f"{first['model']}, {first['context']} tokens",
    )
    ax.legend(fontsize=6 if len(runs) > 1 else 7)
    save_figure(fig, path)


def summary(results: dict, args) -> str:
    runs = results["decode"]
    dense = runs["dense"]
    lines = [
        f"# {results['model']}: tiered KV at {args.context} tokens on {results['gpu']}\n",
        "## GPU memory and decode step (one prompt, batch 1)\n",
        "| setting | GPU memory of the cache, allocator (MiB) | vs dense | KV buffers (MiB) | vs dense | "
        "decode step's working set, allocator (MiB) | active tokens / KV head | host (MiB) | decode ms (median) | "
        "vs dense | promoted | demoted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib, dense_bytes, dense_kv = 2**20, max(1, dense["cache_owned_bytes"]), dense["cache_kv_bytes"]
    for name, r in runs.items():
        moved = r.get("moved", {})
        lines.append(
            f"| {name} | {r['cache_owned_bytes'] / mib:.1f} | {r['cache_owned_bytes'] / dense_bytes:.3f} | "
            f"{r['cache_kv_bytes'] / mib:.1f} | {r['cache_kv_bytes'] / dense_kv:.3f} | "
            f"{r.get('step_working_bytes', 0) / mib:.1f} | "
            f"{r.get('active_tokens_mean', '')} | {r.get('host_bytes', 0) / mib:.0f} | {r['decode_ms_median']:.2f} | "
            f"{r['decode_ms_median'] / dense['decode_ms_median']:.2f} | {moved.get('promoted_tokens', '')} | "
            f"{moved.get('demoted_tokens', '')} |"
        )
    lines += ["", "## Perplexity (64 decoded tokens per window) and tasks (mean exact match)\n"]
    task_columns = " | ".join(args.tasks) + " | dense tasks |" if args.tasks else ""
    lines.append("| retrieval | budget | ppl | dense ppl | " + task_columns)
    lines.append("|---" * (4 + (len(args.tasks) + 1 if args.tasks else 0)) + "|")
    for mode, records in results["perplexity"].items():
        dense_ppl = next(r["perplexity"] for r in records if r["budget"] is None)
        tasks = results["tasks"].get(mode, [])

        def mean(task, budget):
            scores = [t["score"] for t in tasks if t["task"] == task and t["budget"] == budget]
            return f"{statistics.mean(scores):.2f}" if scores else ""

        dense_tasks = " / ".join(mean(t, None) for t in args.tasks)
        for r in records:
            if r["budget"] is not None:
                cells = (
                    " | ".join(mean(t, r["budget"]) for t in args.tasks) + f" | {dense_tasks} |" if args.tasks else ""
                )
                lines.append(f"| {mode} | {r['budget']} | {r['perplexity']:.3f} | {dense_ppl:.3f} | {cells}")
    if results.get("ceilings"):
        lines += ["", "## Perplexity under atskv.sparse (whole KV on the GPU, attention reads the selection)\n"]
        lines += ["| selector | budget | ppl |", "|---|---|---|"]
        lines += [f"| {r['selector']} | {r['budget']} | {r['perplexity']:.3f} |" for r in results["ceilings"]]
    bw = results["bandwidth"]
    lines += ["", "## Host to device\n", "| transfer | GB/s |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in bw.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
