"""Which cells a leaderboard has: the grid (contexts, ratios, methods, tasks, seeds), what a cell
holds, the prompts of a (task, context, seed), and the refusals of a grid that cannot run, made
before any model loads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from atskv.data import TASKS, TaskExample
from atskv.errors import InputError, built_from_option
from atskv.eval.method import DENSE, HOST, KVPRESS, KVPRESS_FULL, OWN, TIERED, VLLM, Method, check_methods

RUNTIMES = (OWN, TIERED, HOST, KVPRESS, VLLM)  # the methods' runtimes a leaderboard runs
KVPRESS_DENSE = str(Method(KVPRESS, KVPRESS_FULL))
VLLM_DENSE = str(Method(VLLM))  # vanilla vLLM, the dense beside the plugin's rows


@dataclass(frozen=True)
class Cell:
    """One method at one ratio on the prompts of one (context, task, seed). `ratio` None: full
    KV. `budget`: fraction of the context kept per managed layer and KV head (1 - ratio).
    `dense_layers`: first layers left uncompressed (None for full KV); `prefill`: how the prompt
    was attended."""

    context: int
    task: str
    seed: int
    method: str
    ratio: float | None
    budget: float | None
    dense_layers: int | None
    prefill: str
    max_new_tokens: int
    score: float
    scores: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    texts: tuple[str, ...]

    @property
    def key(self) -> tuple:
        return self.context, self.task, self.seed, self.method, self.ratio


@dataclass(frozen=True)
class Grid:
    """What to run; `methods` are atskv selector names, `tiered:<selector>`, `host:<selector>`,
    `kvpress:<press>` and `vllm:<selector>` names (dense is always run, it is the reference; with
    kvpress or vLLM rows, their own full-KV run too)."""

    contexts: tuple[int, ...]
    ratios: tuple[float, ...]
    methods: tuple[str, ...]
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]

    @property
    def selectors(self) -> list[str]:
        return [m for m in self.methods if Method.parse(m).runtime not in (KVPRESS, VLLM) and m != DENSE]

    @property
    def tiered(self) -> list[str]:
        """The `tiered:<selector>` rows (run in the two-tier store)."""
        return [m for m in self.selectors if Method.parse(m).runtime == TIERED]

    @property
    def hosted(self) -> list[str]:
        """The `host:<selector>` rows (the fast path with its host tier)."""
        return [m for m in self.selectors if Method.parse(m).runtime == HOST]

    @property
    def selector_names(self) -> list[str]:
        """The selectors the atskv rows build, each once (a `tiered:` or `host:` row's without its prefix)."""
        return list(dict.fromkeys(Method.parse(m).name for m in self.selectors))

    @property
    def engine_rows(self) -> list[str]:
        """The `vllm:<selector>` rows (vLLM with atskv's plugin, beside vanilla vLLM)."""
        return [m for m in self.methods if Method.parse(m).runtime == VLLM]

    @property
    def presses(self) -> list[str]:
        return [Method.parse(m).name for m in self.methods if Method.parse(m).runtime == KVPRESS]


def check_grid(
    contexts: Sequence[int],
    ratios: Sequence[float],
    methods: Sequence[str],
    tasks: Sequence[str],
    seeds: Sequence[int],
    examples: int,
) -> Grid:
    """The grid, or an `InputError` before any model loads: ratios outside (0, 1), unknown
    selectors, presses or tasks, empty axes."""
    for name, axis in (("contexts", contexts), ("ratios", ratios), ("tasks", tasks), ("seeds", seeds)):
        if not axis:
            raise InputError(f"--{name} is empty")
    if min(contexts) < 1 or examples < 1:
        raise InputError(f"need contexts >= 1 token and examples >= 1, got {list(contexts)} and {examples}")
    for ratio in ratios:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0:
            raise InputError(f"a compression ratio is the fraction of the KV removed, in (0, 1); got {ratio!r}")
    for task in tasks:
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}; choose from: {', '.join(TASKS)}")
    check_methods(methods, RUNTIMES)
    return Grid(
        tuple(dict.fromkeys(contexts)), tuple(dict.fromkeys(float(r) for r in ratios)),
        tuple(dict.fromkeys(m for m in methods if m not in (DENSE, VLLM_DENSE))), tuple(dict.fromkeys(tasks)),
        tuple(dict.fromkeys(seeds)),
    )  # fmt: skip


def check_tiering(grid: Grid, tiering: dict | None, sparse_prefill: bool, host_tier: dict | None = None) -> None:
    """An `InputError` before any model loads for `tiered:` or `host:` rows their store cannot
    run: options `TieringConfig` or `HostRetrieval` does not take, a `host:` row whose selector
    does not evict (the host tier parks what it drops), or sparse prefill (both prefill densely)."""
    from atskv.runtime.fast.host_pages import HostRetrieval
    from atskv.runtime.reference.tiered import TieringConfig
    from atskv.selectors import SELECTORS, name_parts

    if (grid.tiered or grid.hosted) and sparse_prefill:
        rows = ", ".join(grid.tiered + grid.hosted)
        raise InputError(f"{rows}: the two-tier stores prefill densely (drop --sparse_prefill)")
    checks = ([("--tiering", lambda: TieringConfig(budget=0.5, **(tiering or {})))] if grid.tiered else []) + (
        [("--host_tier", lambda: HostRetrieval(**(host_tier or {})))] if grid.hosted else []
    )
    for option, build in checks:
        built_from_option(option, build)
    for method in grid.hosted:
        if not SELECTORS[name_parts(Method.parse(method).name)[0]].evicts:  # a composition: its residency part
            raise InputError(f"{method}: a host tier parks what an evicting selector drops (h2o, snapkv, "
                             f"streaming_llm, learned, or a composition with one of them first)")  # fmt: skip


def build_examples(tokenizer, task: str, context: int, seed: int, n: int, filler: str | None) -> list[TaskExample]:
    """The `n` prompts of one (task, context, seed)."""
    return [TASKS[task](tokenizer, context, (i + 0.5) / n, 1000 * seed + i, filler=filler) for i in range(n)]


def own_dense(method: str) -> str:
    """The full-KV row of `method`'s own environment: kvpress's for a press, vanilla vLLM for the
    plugin's rows, atskv's dense else."""
    runtime = Method.parse(method).runtime
    return KVPRESS_DENSE if runtime == KVPRESS else VLLM_DENSE if runtime == VLLM else DENSE
