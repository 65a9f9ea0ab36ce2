"""A serving trace through vanilla vLLM and vLLM + atskv: long requests (prompt lengths drawn between
`shortest` and `longest` tokens) arriving as a Poisson process at a given rate, each wanting
`new_tokens` tokens. Per method and rate: output tokens/s over the run, mean and P99 time to first
token, mean and P99 time between tokens, requests finished, the KV tokens the engine holds, the most
requests in flight at once (scheduled, decoding or in prefill) and the share of the KV pool each
held then, and the largest share the longest request held in its prompt and past it (so how many
requests of the longest prompt the pool holds when prompts go in one at a time; read from the
engine's scheduler, which runs in this process). Each method's engine runs in its own process (as in
`atskv.eval.vllm_speed`), built once for all its rates; rows are appended as they finish and a
rerun skips the (method, trace) pairs already there (every setting of a trace, not its rate alone).

    python -m atskv.eval.vllm_trace SPEC.json TRACES.json ROWS.jsonl   (one engine: what `measure` starts)
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from atskv.errors import InputError
from atskv.eval.method import Method
from atskv.eval.rows import json_lines
from atskv.eval.vllm_speed import (
    VANILLA,
    EngineSpec,
    engine_arguments,
    engine_process,
    file_stem,
    greedy,
    host_tier_read,
    in_process_scheduler,
    pool_tokens,
    prompts,
    timing_options,
)
from atskv.runtime.vllm.selection import PAGED_SELECTORS


@dataclass(frozen=True)
class Trace:
    """Requests and their arrivals (seconds from the start), reproducible from `seed`."""

    rate: float  # requests per second
    requests: int = 32
    shortest: int = 16384
    longest: int = 131072
    new_tokens: int = 128
    seed: int = 0
    limit_s: float = 300.0  # the run stops here, finished or not

    def arrivals(self) -> list[tuple[float, int]]:
        """(arrival time, prompt tokens) of each request, log-uniform lengths."""
        rng, now, out = random.Random(self.seed), 0.0, []
        for _ in range(self.requests):
            now += rng.expovariate(self.rate)
            length = int(self.shortest * (self.longest / self.shortest) ** rng.random())
            out.append((now, length))
        return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(arrived: dict[str, float], stamps: dict[str, list[float]], finished: set[str], wall: float,
              load: list[tuple[int, float]] = (), shares: list[tuple[float, float]] = ()) -> dict:  # fmt: skip
    """The trace's figures from each request's arrival and token times, from (requests in flight,
    share of the KV pool in use) after each step and from `request_shares` every few steps."""
    firsts = [stamps[r][0] - arrived[r] for r in stamps if stamps[r]]
    gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for times in stamps.values())
    return {
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_mean_s": sum(firsts) / len(firsts) if firsts else float("nan"),
        "ttft_p99_s": percentile(firsts, 0.99),
        "tbt_mean_ms": 1e3 * sum(gaps) / len(gaps) if gaps else float("nan"),
        "tbt_p99_ms": 1e3 * percentile(gaps, 0.99),
        "finished": len(finished),
        "wall_s": wall,
        **in_flight(load),
        **residency(shares),
    }


def in_flight(load: list[tuple[int, float]]) -> dict:
    """The most requests in flight after a step, and the pool share each held then (the pool in
    use over the requests, at the least used of the steps with that many)."""
    if not load:
        return {}
    running, used = max(load, key=lambda step: (step[0], -step[1]))
    return {"peak_in_flight": running, "pool_share_per_request": used / running if running else float("nan")}


def residency(shares: list[tuple[float, float]]) -> dict:
    """The largest pool share one request held in its prompt and past it, and the requests the
    pool holds at those shares when prompts go in one at a time (as vLLM's chunked prefill admits
    them: one prompt whole, the rest at their residency; `free_blocks` shrinks the second)."""
    prompt, resident = max((s[0] for s in shares), default=0.0), max((s[1] for s in shares), default=0.0)
    if not prompt or not resident:
        return {}
    return {"prompt_share": prompt, "resident_share": resident, "pool_holds": 1 + int((1 - prompt) / resident)}


def request_shares(scheduler) -> tuple[float, float]:
    """The share of the KV pool held by the running request with the longest prompt among those
    in their prompt (the last chunk included: its blocks go back at the next step), and by the one
    among those past it (0 where none). A block `free_blocks` handed back is vLLM's null block in
    the request's list. Two requests, not all: a 128K request's lists hold ~8K blocks a group."""
    manager = scheduler.kv_cache_manager
    groups = manager.coordinator.single_type_managers
    total = manager.block_pool.num_gpu_blocks - 1  # the null block is not the pool's
    longest = {}
    for request in scheduler.running:
        past = request.num_computed_tokens > request.num_prompt_tokens
        if past not in longest or request.num_prompt_tokens > longest[past].num_prompt_tokens:
            longest[past] = request
    held = {past: sum(sum(not b.is_null for b in g.req_to_blocks.get(r.request_id, ())) for g in groups) / total
            for past, r in longest.items()}  # fmt: skip
    return held.get(False, 0.0), held.get(True, 0.0)


SHARES_EVERY_S = 5.0  # seconds between two `request_shares` (a Python pass over two requests' blocks)


def serving_specs(methods: list[str], model: str, shape: Path, new_tokens: int, budget: int | float,
                  dense_layers: int, free_blocks: bool, selector_options: dict, engine: dict,
                  host_tier: dict | None = None) -> list[EngineSpec]:  # fmt: skip
    """`serving_spec` of each method; options for a selector none of them names are an `InputError`."""
    if unknown := sorted(set(selector_options) - {Method.parse(m).name for m in methods}):
        raise InputError(f"options given for {unknown[0]!r}, which is not selected")
    return [serving_spec(m, model, shape, new_tokens, budget, dense_layers, free_blocks, selector_options, engine,
                         host_tier) for m in methods]  # fmt: skip


def serving_spec(method: str, model: str, shape: Path, new_tokens: int, budget: int | float, dense_layers: int,
                 free_blocks: bool, selector_options: dict, engine: dict,
                 host_tier: dict | None = None) -> EngineSpec:  # fmt: skip
    """A method's engine for a trace of `model`'s shape (its config in `shape`): `free_blocks` where
    its selector can free them (and then `host_tier` where it can park what it frees), its options
    from `selector_options` by selector name (the learned selector without a predictor timed with a
    random one of the shape), vLLM's own `engine` settings; labelled with what differs from the
    method's defaults."""
    name = Method.parse(method).name
    selector = PAGED_SELECTORS.get(name)
    frees = free_blocks and selector is not None and selector.frees_blocks
    own = selector_options.get(name, {})
    options = timing_options(method, own, model, dense_layers, shape.parent / "predictor")
    parks = frees and host_tier is not None and selector.scores_prompt
    label = method + (" (free_blocks)" if frees else "") + (f" host_tier {json.dumps(host_tier)}" if parks else "")
    label += "".join(f" {json.dumps(x)}" for x in (own, engine) if x)
    return EngineSpec(method, str(shape), [], new_tokens, budget, dense_layers, options, free_blocks=frees,
                      host_tier=host_tier if parks else None, label=label, engine=engine)  # fmt: skip


def run_traces(spec: EngineSpec, traces: list[Trace], rows: Path) -> None:
    """In this process: each trace in turn through one engine (built once: its start is most of a
    short trace's cost); one row appended to `rows` per trace."""
    from vllm import LLM

    config = json.loads((Path(spec.shape_dir) / "config.json").read_text())
    room = config["max_position_embeddings"]
    longest = min(max(t.longest + t.new_tokens for t in traces), room)
    llm = LLM(**engine_arguments(spec, longest, 64))
    moved = 0
    for trace in traces:
        row = run_trace(llm.llm_engine, trace, config["vocab_size"], room)
        if spec.host_tier is not None:  # what the host tier read back, a token
            before, moved = moved, host_tier_read(llm, spec)
            tokens = round(row["output_tokens_per_s"] * row["wall_s"])
            row["host_tier_bytes_per_token"] = (moved - before) / max(1, tokens)
        row = {"method": spec.label, "kind": "trace", "context": trace.longest, "rate": trace.rate,
               "vanilla": spec.method == VANILLA, "engine": spec.engine, "dense_layers": spec.dense_layers,
               **row}  # fmt: skip
        with rows.open("a") as f:
            f.write(json.dumps(row) + "\n")


def run_trace(engine, trace: Trace, vocab: int, room: int) -> dict:
    """One trace through a started engine, its requests cut to the engine's positions; what is
    unfinished at the limit is aborted, so the engine is idle for the next trace."""
    longest = min(trace.longest, room - trace.new_tokens)
    arrivals = [(t, min(n, longest)) for t, n in trace.arrivals()]
    params = greedy(trace.new_tokens)
    pending = [(t, f"r{trace.rate}-{i}", prompts(n, 1, vocab, seed=i)[0]) for i, (t, n) in enumerate(arrivals)]
    arrived: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    finished: set[str] = set()
    load: list[tuple[int, float]] = []
    shares: list[tuple[float, float]] = []
    scheduler = in_process_scheduler(engine)
    start = time.perf_counter()
    counted = -SHARES_EVERY_S
    while (pending or engine.has_unfinished_requests()) and time.perf_counter() - start < trace.limit_s:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, request, prompt = pending.pop(0)
            engine.add_request(request, prompt, params)
            arrived[request] = at
            stamps[request] = []
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        if scheduler is not None:  # in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
            load.append((len(scheduler.running), scheduler.kv_cache_manager.usage))
            if now - counted >= SHARES_EVERY_S:
                shares.append(request_shares(scheduler))
                counted = now
        for out in outputs:
            produced = len(out.outputs[0].token_ids)
            stamps[out.request_id] += [now] * (produced - len(stamps[out.request_id]))
            if out.finished:
                finished.add(out.request_id)
    wall = time.perf_counter() - start
    engine.abort_request([r for r in arrived if r not in finished])
    while engine.has_unfinished_requests():
        engine.step()
    return {"kv_tokens": pool_tokens(engine), "trace": asdict(trace),
            **summarise(arrived, stamps, finished, wall, load, shares)}  # fmt: skip


def measure(specs: list[EngineSpec], traces: list[Trace], rows: Path) -> None:
    """Per method, the traces not yet in `rows`, through one engine process."""
    rows.parent.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        finished = [r["trace"] for r in json_lines(rows) if r.get("kind") == "trace" and r["method"] == spec.label]
        todo = [t for t in traces if asdict(t) not in finished]  # every setting of the trace, not its rate alone
        if not todo:
            continue
        stem = file_stem(spec.label)
        spec_file, trace_file = rows.with_suffix(f".{stem}.spec.json"), rows.with_suffix(f".{stem}.trace.json")
        spec_file.write_text(json.dumps(asdict(spec)))
        trace_file.write_text(json.dumps([asdict(t) for t in todo]))
        rates = ", ".join(str(t.rate) for t in todo)
        print(f"vLLM trace: {spec.label} at {rates} requests/s", file=sys.stderr)
        engine_process("atskv.eval.vllm_trace", spec_file, trace_file, rows)


def table(rows: Path) -> str:
    """Markdown of the trace rows, with each row's throughput against vanilla vLLM's on the same
    trace with the same vLLM settings."""
    found = [r for r in json_lines(rows) if r["kind"] == "trace"]

    def key(r: dict) -> tuple:  # the same trace (its rate and every setting) through the same vLLM settings
        return r["rate"], json.dumps(r.get("trace"), sort_keys=True), json.dumps(r.get("engine", {}), sort_keys=True)

    base = {key(r): r["output_tokens_per_s"] for r in found if r.get("vanilla", r["method"] == VANILLA)}
    lines = ["| method | rate (req/s) | output tok/s | x vLLM | TTFT mean / P99 s | TBT mean / P99 ms | finished "
             "| most in flight | pool share each | largest share in prompt / past it "
             "| longest prompts the pool holds |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in found:
        ratio = f"{r['output_tokens_per_s'] / base[key(r)]:.2f}" if base.get(key(r)) else ""
        ttft = f"{r['ttft_mean_s']:.2f} / {r['ttft_p99_s']:.2f}"
        tbt = f"{r['tbt_mean_ms']:.1f} / {r['tbt_p99_ms']:.1f}"
        share = f"{r['pool_share_per_request']:.3f}" if "pool_share_per_request" in r else ""
        held = f"{r['prompt_share']:.3f} / {r['resident_share']:.4f}" if "resident_share" in r else ""
        cells = [r["method"], r["rate"], f"{r['output_tokens_per_s']:.0f}", ratio, ttft, tbt,
                 f"{r['finished']}/{r['trace']['requests']}", r.get("peak_in_flight", ""), share, held,
                 r.get("pool_holds", "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: Path, path: Path) -> None:
    """Three panels, vanilla vLLM black: output tokens/s, time to first token (mean; P99 dashed or
    hatched) and the P99 time between tokens; a line per method over the arrival rates, or with a
    single rate a bar per method. The table's figures, for a glance. Nothing without rows."""
    from matplotlib.figure import Figure  # renders with Agg; no pyplot, no display

    found = [r for r in json_lines(rows) if r["kind"] == "trace"]
    if not found:
        return
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    speed, first, between = fig.subplots(1, 3)
    methods = list(dict.fromkeys(r["method"] for r in found))
    bars = len({r["rate"] for r in found}) == 1
    for i, method in enumerate(methods):
        here = sorted((r for r in found if r["method"] == method), key=lambda r: r["rate"])
        color = "black" if here[0].get("vanilla", method == VANILLA) else f"C{i}"
        if bars:  # one trace: a bar per method (P99 time to first token the hatched bar beside the mean)
            speed.bar(i, here[0]["output_tokens_per_s"], color=color, label=method)
            first.bar(i - 0.2, here[0]["ttft_mean_s"], width=0.4, color=color)
            first.bar(i + 0.2, here[0]["ttft_p99_s"], width=0.4, color=color, alpha=0.5, hatch="//")
            between.bar(i, here[0]["tbt_p99_ms"], color=color)
            continue
        rates, style = [r["rate"] for r in here], {"color": color, "marker": "o"}
        speed.plot(rates, [r["output_tokens_per_s"] for r in here], label=method, **style)
        first.plot(rates, [r["ttft_mean_s"] for r in here], **style)
        first.plot(rates, [r["ttft_p99_s"] for r in here], linestyle="--", **style)
        between.plot(rates, [r["tbt_p99_ms"] for r in here], **style)
    x = {"xlabel": f"{found[0]['rate']:g} arrivals per second" if bars else "arrivals per second"}
    x |= {"xticks": []} if bars else {}
    speed.set(title="output tokens/s", **x)
    first.set(title="time to first token, s (mean; P99 " + ("hatched)" if bars else "dashed)"), **x)
    between.set(title="P99 time between tokens, ms", **x, **({} if bars else {"yscale": "log"}))
    speed.legend(fontsize="small", loc="upper left" if bars else "best")
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    spec = EngineSpec(**json.loads(Path(sys.argv[1]).read_text()))
    run_traces(spec, [Trace(**t) for t in json.loads(Path(sys.argv[2]).read_text())], Path(sys.argv[3]))
