"""vLLM beside atskv in one run: vanilla vLLM (`vllm`) and vLLM with atskv's plugin
(`vllm:<selector>`), each in its own process, on an 8B-class shape with random weights
(`load_format="dummy"`, a config.json from `atskv.eval.shapes`, token ids as prompts).

Per method and (context, batch): the time until every request has its first token and the mean
time to first token, ms per decode step while the whole batch decodes (timed between engine steps,
until the first request ends: `timed_batch`), tokens/s over the batch, and how many requests of
the context the engine's KV blocks hold. With `identity_tokens`, each method also writes its
greedy tokens on fixed prompts, to compare with vanilla vLLM's. With `profile_dir`, the last
`PROFILE_STEPS` full-batch decode steps (not timed) run under vLLM's torch profiler, whose table
of CUDA time by kernel is kept there as `LABEL.CONTEXTxBATCH.txt`: where a step's time goes,
vanilla and plugin alike; with `profile_prefill` too, each batch's prefill (its mixed steps
too), run again after its row, as `LABEL.CONTEXTxBATCH.prefill.txt`: where the time to first
token goes. Rows are appended to a JSON-lines file as they finish; a rerun skips those there.

    python -m atskv.eval.vllm_speed SPEC.json ROWS.jsonl    (one method: what `measure` starts)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from atskv.errors import InputError
from atskv.eval.method import Method
from atskv.eval.rows import json_lines
from atskv.eval.shapes import SHAPES
from atskv.runtime.vllm.config import WORKER, PluginConfig

PROFILE_STEPS = 8
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
VANILLA = "vllm"


@dataclass
class EngineSpec:
    """One vLLM engine: the method, its shape and what it measures."""

    method: str
    shape_dir: str
    runs: list[tuple[int, int]]  # (context, batch) pairs, each timed as one batch
    new_tokens: int = 64
    budget: int | float = 0.05
    dense_layers: int = 2
    options: dict = field(default_factory=dict)
    free_blocks: bool = False  # blocks the selector will not read go back to vLLM's pool
    host_tier: dict | None = None  # with free_blocks: what is freed parked on the host (`PluginConfig.host_tier`)
    gpu_memory_utilization: float = 0.85
    identity_tokens: int = 0  # > 0: greedy tokens on fixed prompts first
    identity_context: int = 2048
    identity_batch: int = 4
    label: str = ""  # the rows' name of this engine (default: the method), to run one method twice
    load_format: str = "dummy"  # "auto": the weights saved in `shape_dir` (a model's directory)
    eager: bool = False  # no compile, no CUDA graphs: an engine up in seconds, for runs scored, not timed
    profile_dir: str = ""  # absolute: each batch's last PROFILE_STEPS decode steps under vLLM's torch profiler
    profile_prefill: bool = False  # with profile_dir: each batch's prefill again, untimed, under the profiler too
    engine: dict = field(default_factory=dict)  # vLLM's own settings over these (`max_num_batched_tokens`: its chunk)

    def __post_init__(self):
        self.label = self.label or self.method
        if self.method != VANILLA:  # the plugin's settings checked before an engine starts (a worker's traceback)
            PluginConfig.from_additional_config(engine_arguments(self, 1, 1).get("additional_config"))


def engine_arguments(spec: EngineSpec, max_model_len: int, max_num_seqs: int) -> dict:
    """`vllm.LLM` keyword arguments of a method: vanilla vLLM, or the CUSTOM backend with atskv's settings."""
    arguments = dict(
        model=spec.shape_dir, load_format=spec.load_format, skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=max_model_len, enable_prefix_caching=False, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=spec.gpu_memory_utilization, seed=0, enforce_eager=spec.eager,
        jit_monitor_verbose=not spec.eager,  # every kernel compiled after warm-up logged: a timing it spoilt shows
    )  # fmt: skip
    if spec.profile_dir:
        arguments["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec.profile_dir,
                                        "torch_profiler_with_stack": False}  # fmt: skip
    if spec.method != VANILLA:
        selector = Method.parse(spec.method).name
        settings = {"selector": selector, "budget": spec.budget, "dense_layers": spec.dense_layers}
        if spec.options:
            settings["options"] = spec.options
        # atskv's worker: the prompts' lengths for the selectors that rank them, the freed blocks' specs
        arguments.update(attention_backend="CUSTOM", additional_config={"atskv": settings}, worker_cls=WORKER)
        if spec.free_blocks:
            settings["free_blocks"] = True
        if spec.host_tier is not None:
            settings["host_tier"] = spec.host_tier
    return {**arguments, **spec.engine}


def write_shape(name: str, folder: Path) -> Path:
    """A folder with the shape's config.json, what vLLM needs to build it with dummy weights."""
    if name not in SHAPES:
        raise ValueError(f"no shape {name!r}; shapes: {', '.join(SHAPES)}")
    config = dict(SHAPES[name])
    if config["model_type"] not in ARCHITECTURES:
        raise ValueError(f"vLLM runs of {name} are not wired (architectures: {', '.join(ARCHITECTURES)})")
    config.update(architectures=[ARCHITECTURES[config["model_type"]]], torch_dtype="bfloat16", bos_token_id=1,
                  eos_token_id=2)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def random_engine_predictor(name: str, dense_layers: int, folder: Path, received: bool = True) -> Path:
    """A predictor of the shape's geometry with random weights that reads only what vLLM shows an
    attention backend (`atskv.runtime.vllm.learned`; without `received`, not the attention received
    either), exported to `folder`: what the learned selector costs in the engine does not depend on
    what it learned."""
    import torch
    from transformers import AutoConfig

    from atskv.features import SCALAR_FEATURES
    from atskv.models.geometry import model_geometry
    from atskv.predictor.export import export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP
    from atskv.runtime.vllm.learned import RECEIVED, WITHOUT

    settings = dict(SHAPES[name])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    geometry = model_geometry(config)
    managed = [layer for layer in geometry.global_layers if layer >= dense_layers]
    spec = FeatureSpec(geometry.hidden_size, SCALAR_FEATURES, len(managed), geometry.num_kv_heads)
    mlp = RelevanceMLP(spec, reduced_width=0, without=[*WITHOUT, *(() if received else RECEIVED)]).eval()
    export_predictor(mlp, torch.zeros(config.vocab_size, dtype=torch.int8), folder, base_model=f"random {name}",
                     geometry=geometry, managed_layers=managed, overwrite=True)  # fmt: skip
    return folder


def timing_options(method: str, options: dict, shape: str, dense_layers: int, folder: Path) -> dict:
    """A method's selector options for a timing: the learned selector without a predictor, alone
    or as a composition's part (`learned+sparq`: its options under "learned"), gets
    `random_engine_predictor`'s (made once in `folder`)."""
    name = Method.parse(method).name
    composed = "+" in name
    own = options.get("learned", {}) if composed else options
    if "learned" not in name.split("+") or "predictor" in own:
        return options
    if not (folder / "predictor.safetensors").is_file():
        random_engine_predictor(shape, dense_layers, folder)
    own = {**own, "predictor": str(folder)}
    return {**options, "learned": own} if composed else own


def prompts(context: int, batch: int, vocab: int, seed: int) -> list[dict]:
    """`batch` different prompts of `context` random token ids (reproducible from `seed`)."""
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(context)]} for _ in range(batch)]


def greedy(new_tokens: int):
    """vLLM's sampling parameters of every run here: `new_tokens` greedy tokens, token ids only."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False)


def file_stem(label: str) -> str:
    """A row label as part of a file name: letters, digits, `_`, `.` and `-` only."""
    return re.sub(r"[^\w.-]+", "-", label).strip("-")


def require_vllm() -> None:
    """A one-line error before an engine process would fail on its import: no vLLM here, and no
    `ATSKV_VLLM_PYTHONPATH` naming one elsewhere."""
    if not os.environ.get("ATSKV_VLLM_PYTHONPATH") and importlib.util.find_spec("vllm") is None:
        raise InputError("vLLM is not installed here: the vllm methods run it (pip install 'atskv[vllm]')")


def engine_process(module: str, *files: Path, check: bool = False) -> None:
    """`python -m module files...` with vLLM's engine in that process (one engine a process);
    `ATSKV_VLLM_PYTHONPATH`, where set, is that process's `PYTHONPATH` (vLLM beside another
    transformers than the caller's, as on the GPU machine: `benchmarks/device/vllm_env.sh`)."""
    require_vllm()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if path := os.environ.get("ATSKV_VLLM_PYTHONPATH"):
        env["PYTHONPATH"] = path
    subprocess.run([sys.executable, "-m", module, *map(str, files)], env=env, check=check)


def timed_batch(engine, batch_prompts: list[dict], new_tokens: int, tag: str, profile_steps: int = 0) -> dict:
    """Runs one batch through the engine step by step: first-token times and decode ms/step. A step
    is timed while the whole batch decodes: from the step at which the last request has its first
    token (chunked prefill staggers them) to the one at which the first has its last, so the
    batch's tail, fewer requests a step, is not averaged in. With `profile_steps`, that many of
    the last full-batch steps run under the engine's profiler instead, untimed."""
    params = greedy(new_tokens)
    start = time.perf_counter()
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    produced: dict[str, int] = {}
    decode_start = None
    stop, stop_tokens, timing, profiling = start, 0, True, False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
            first.setdefault(out.request_id, now)
        if decode_start is None and len(first) == len(batch_prompts):
            decode_start, decode_tokens = now, min(produced.values())
        if timing and decode_start is not None:
            stop, stop_tokens = now, min(produced.values())
            if max(produced.values()) >= new_tokens - profile_steps:  # the leading request nears its end
                timing = False
                if profile_steps:
                    engine.start_profile()
                    profiling = True
        elif profiling and max(produced.values()) >= new_tokens:  # the first request finished: a full batch no more
            engine.stop_profile()
            profiling = False
    if profiling:
        engine.stop_profile()
    decode_steps = stop_tokens - decode_tokens if decode_start is not None else 0
    step_ms = (stop - decode_start) / decode_steps * 1e3 if decode_steps > 0 else float("nan")
    return {
        "prefill_s": (decode_start or stop) - start,
        "ttft_mean_s": sum(t - start for t in first.values()) / len(first),
        "ms_per_step": step_ms,
        "tokens_per_s": len(batch_prompts) * 1e3 / step_ms if decode_steps > 0 else float("nan"),
        "steady_steps": decode_steps,
    }


def host_tier_read(llm, spec: EngineSpec) -> int:
    """The bytes the engine's host tier has read back from the host so far (0 without a tier): a
    run's traffic is the difference around it."""
    if spec.host_tier is None:
        return 0
    from atskv.runtime.vllm.host_tier import host_tier_bytes

    return sum(llm.apply_model(host_tier_bytes))


def greedy_tokens(llm, batch_prompts: list[dict], new_tokens: int) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch_prompts, greedy(new_tokens), use_tqdm=False)]


def run_engine(spec: EngineSpec, rows: Path) -> None:
    """In this process: one engine for `spec`, every row appended to `rows` as it finishes."""
    from vllm import LLM

    config = json.loads((Path(spec.shape_dir) / "config.json").read_text())
    positions = config["max_position_embeddings"]
    runs = [(min(c, positions - spec.new_tokens), c, b) for c, b in spec.runs]  # a prompt fits the positions
    longest = max([c for c, _, _ in runs] + [spec.identity_context if spec.identity_tokens else 0])
    max_model_len = min(positions, longest + spec.new_tokens + 16)
    if spec.profile_dir:
        Path(spec.profile_dir).mkdir(parents=True, exist_ok=True)
    llm = LLM(**engine_arguments(spec, max_model_len, max([b for _, _, b in runs] + [spec.identity_batch])))
    kv_tokens = pool_tokens(llm.llm_engine)

    def emit(row: dict) -> None:
        with rows.open("a") as f:
            f.write(json.dumps({"method": spec.label, "kv_tokens": kv_tokens, **row}) + "\n")

    vocab = config["vocab_size"]
    greedy_tokens(llm, prompts(256, 1, vocab, seed=99), 4)  # warm-up outside the timings
    if spec.identity_tokens:
        fixed = prompts(spec.identity_context, spec.identity_batch, vocab, seed=7)
        tokens = greedy_tokens(llm, fixed, spec.identity_tokens)
        emit({"kind": "tokens", "context": spec.identity_context, "tokens": tokens})
    for context, requested, batch in runs:
        batch_prompts = prompts(context, batch, vocab, seed=context + batch)
        read_before = host_tier_read(llm, spec)
        timing = timed_batch(llm.llm_engine, batch_prompts, spec.new_tokens, f"{context}x{batch}",
                             PROFILE_STEPS if spec.profile_dir else 0)  # fmt: skip
        if spec.host_tier is not None:  # what the host tier read back, a generated token
            timing["host_tier_bytes_per_token"] = (host_tier_read(llm, spec) - read_before) / (batch * spec.new_tokens)
        stem = f"{file_stem(spec.label)}.{requested}x{batch}"
        keep_profile_table(spec, f"{stem}.txt")
        emit({"kind": "speed", "context": requested, "tokens_in_prompt": context, "batch": batch,
              "requests_held": kv_tokens / (context + spec.new_tokens), **timing})  # fmt: skip
        if spec.profile_dir and spec.profile_prefill:  # after the row: the timings above are the unprofiled ones
            llm.start_profile()  # as many new tokens as the prefill takes steps: its mixed steps' decodes ride along
            greedy_tokens(llm, batch_prompts, prefill_steps(llm.llm_engine, context * batch))
            llm.stop_profile()
            keep_profile_table(spec, f"{stem}.prefill.txt")


def prefill_steps(engine, prompt_tokens: int) -> int:
    """The scheduler steps a batch's prompts take (vLLM's chunk, `max_num_batched_tokens`, a step): a
    profiled prefill that generates this many tokens has the timed one's mixed steps, in which the
    requests already past their prompt decode beside the next chunk."""
    chunk = engine.vllm_config.scheduler_config.max_num_batched_tokens
    return max(1, -(-prompt_tokens // chunk))


def keep_profile_table(spec: EngineSpec, name: str) -> None:
    """vLLM's CUDA-time table of the last profiled stretch (rewritten at each stop), renamed to `name`."""
    table_file = Path(spec.profile_dir) / "profiler_out_0.txt"
    if spec.profile_dir and table_file.is_file():
        table_file.rename(Path(spec.profile_dir) / name)


def in_process_scheduler(engine):
    """The engine's scheduler where it runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), else None."""
    return getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)


def pool_tokens(engine) -> int:
    """Tokens of every layer the engine's KV pool holds. A hybrid layout (`free_blocks` beside
    dense layers: a group of layers per block table) spends a block of each group per block of a
    request's tokens, so its pool holds as many times fewer tokens as it has groups."""
    cache = engine.vllm_config.cache_config
    scheduler = in_process_scheduler(engine)
    groups = len(scheduler.kv_cache_config.kv_cache_groups) if scheduler is not None else 1
    return cache.num_gpu_blocks * cache.block_size // groups


def done(rows: Path) -> set[tuple]:
    """(method, kind, context, batch) of the rows already in `rows` (a tokens row has no batch)."""
    return {(r["method"], r["kind"], r["context"], r.get("batch")) for r in json_lines(rows)}


def measure(specs: list[EngineSpec], rows: Path) -> None:
    """Each spec's engine in its own process, skipping what `rows` already holds."""
    rows.parent.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        seen = done(rows)
        wanted = [(c, b) for c, b in spec.runs if (spec.label, "speed", c, b) not in seen]
        identity = spec.identity_tokens and (spec.label, "tokens", spec.identity_context, None) not in seen
        if not wanted and not identity:
            continue
        todo = EngineSpec(**{**asdict(spec), "runs": wanted, "identity_tokens": int(identity and spec.identity_tokens)})
        spec_file = rows.with_suffix(f".{file_stem(spec.label)}.spec.json")
        spec_file.write_text(json.dumps(asdict(todo)))
        print(f"vLLM engine: {spec.label} (context x batch: {todo.runs})", file=sys.stderr)
        engine_process("atskv.eval.vllm_speed", spec_file, rows)


def table(rows: Path) -> str:
    """Markdown of the speed rows, each with its ratio to vanilla vLLM's tokens/s at that shape (and,
    where a host tier ran, the MB it read back from the host a generated token)."""
    speed = [r for r in json_lines(rows) if r["kind"] == "speed"]
    base = {(r["context"], r["batch"]): r["tokens_per_s"] for r in speed if r["method"] == VANILLA}
    tiered = any("host_tier_bytes_per_token" in r for r in speed)
    lines = ["| method | context | batch | ms/step | tokens/s | x vLLM | prefill s | mean TTFT s | requests held |"
             + (" host MB/token |" if tiered else ""), "|---|---|---|---|---|---|---|---|---|" + "---|" * tiered]
    for r in speed:
        ratio = r["tokens_per_s"] / base[(r["context"], r["batch"])] if (r["context"], r["batch"]) in base else None
        cells = [r["method"], r["context"], r["batch"], f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}",
                 "" if ratio is None else f"{ratio:.2f}", f"{r['prefill_s']:.2f}", f"{r['ttft_mean_s']:.2f}",
                 f"{r['requests_held']:.2f}"]  # fmt: skip
        if tiered:
            read = r.get("host_tier_bytes_per_token")
            cells.append("" if read is None else f"{read / 1e6:.2f}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: Path, path: Path) -> None:
    """Two panels per shape (context x batch): each method's decode tokens/s as a multiple of
    vanilla vLLM's, and its mean time to first token beside vanilla's (a dashed line); what the
    table says, for a glance. Shapes without a vanilla row are left out."""
    from matplotlib.figure import Figure  # renders with Agg; no pyplot, no display

    speed = [r for r in json_lines(rows) if r["kind"] == "speed"]
    base = {(r["context"], r["batch"]): r for r in speed if r["method"] == VANILLA}
    shapes = [shape for shape in dict.fromkeys((r["context"], r["batch"]) for r in speed) if shape in base]
    fig = Figure(figsize=(4.2 * max(len(shapes), 1), 6.4), layout="constrained")
    axes = fig.subplots(2, max(len(shapes), 1), squeeze=False)
    for column, (context, batch) in enumerate(shapes):
        here = [r for r in speed if (r["context"], r["batch"]) == (context, batch)]
        names = [r["method"] for r in here]
        ratios = [r["tokens_per_s"] / base[context, batch]["tokens_per_s"] for r in here]
        top, bottom = axes[0][column], axes[1][column]
        colors = ["black" if n == VANILLA else f"C{i}" for i, n in enumerate(names)]
        top.bar(names, ratios, color=colors)
        top.set(title=f"{context // 1024}K x {batch}: decode", ylabel="tokens/s, x vanilla vLLM")
        for i, ratio in enumerate(ratios):
            top.annotate(f"{ratio:.2f}x", (i, ratio), ha="center", va="bottom", fontsize="small")
        bottom.bar(names, [r["ttft_mean_s"] for r in here], color=colors)
        bottom.axhline(base[context, batch]["ttft_mean_s"], color="black", linestyle="--", label=VANILLA)
        bottom.set(title=f"{context // 1024}K x {batch}: time to first token", ylabel="mean s")
        for ax in (top, bottom):
            ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    fig.savefig(path, dpi=120)


def identity_report(rows: Path) -> list[str]:
    """For each method with greedy tokens, how many of vanilla vLLM's it repeats (first difference)."""
    tokens = {r["method"]: r["tokens"] for r in json_lines(rows) if r["kind"] == "tokens"}
    if VANILLA not in tokens:
        return []
    base, lines = tokens[VANILLA], []
    for method, rows_tokens in tokens.items():
        if method == VANILLA:
            continue
        same = sum(a == b for a, b in zip(rows_tokens, base))
        lines.append(f"{method}: {same}/{len(base)} prompts token-identical to vanilla vLLM; "
                     f"first differences at {first_differences(rows_tokens, base)}")  # fmt: skip
    return lines


def first_differences(tokens: list[list[int]], base: list[list[int]]) -> list[int]:
    """For each prompt, the index of the first token where `tokens` and `base` differ (the shorter
    length where one is the other's start)."""
    pairs = zip(tokens, base)
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]


if __name__ == "__main__":
    run_engine(EngineSpec(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))
