"""The long-context leaderboard, after kvpress's RULER table: for one model, every method (dense,
atskv's selectors, kvpress's presses) at every compression ratio on the same synthetic task
prompts, at several context lengths, over several seeds.

A compression ratio r removes that fraction of the KV: atskv runs at budget 1 - r (a fraction of
the context), kvpress at `compression_ratio` r, through the peer check's venv and script
(`atskv.eval.peer`). A `tiered:<selector>` row runs the selector in the two-tier store
(`atskv.tiered`): the GPU tier holds the budget, as an evicting selector would, but the rest is
parked in host memory and retrieved when a query needs it, so it frees the same GPU memory
without losing what it parks. A `host:<selector>` row is the fast path's own two-tier decode
(`atskv.HostRetrieval`): the evicting selector's budget on the GPU, every token in pinned host
memory, and each step reads back the pages of parked tokens the query rates highest (the GPU also
keeps page bounds and a page cache). Seed s of a (task, context) is `examples` prompts built from seeds
1000 s + i, needles at depths spread evenly over (0, 1); the score of a cell is their mean exact
score, a seed's score the mean over tasks, and the table gives mean ± std over seeds.

The grid is long on a GPU, so it is resumable: each finished cell is appended to `cells.jsonl` in
the output folder at once, and a rerun into that folder computes only the missing cells (the
grid may grow: more seeds, ratios, methods). The settings that change a cell's score beyond its
grid coordinates (model, examples, filler, dense layers, prefill, new tokens) are kept in
`settings.json`, and a rerun with other settings is refused.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from atskv.data import TASKS, TaskExample, filler_text
from atskv.data.prompts import encode_prompt
from atskv.errors import InputError, built_from_option
from atskv.eval import peer
from atskv.eval.generation import generate_batch, pad_left
from atskv.eval.method import DENSE, HOST, KVPRESS, KVPRESS_FULL, OWN, TIERED, Method, check_methods
from atskv.eval.report import write_report
from atskv.eval.rows import RowStore
from atskv.eval.tasks import answer_room

RUNTIMES = (OWN, TIERED, HOST, KVPRESS)  # the methods' runtimes a leaderboard runs
KVPRESS_DENSE = str(Method(KVPRESS, KVPRESS_FULL))
VARIANT_SETTINGS = ("selector_options", "tiering", "host_tier")  # what a variant folder may change (merge_folders)


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
    """What to run; `methods` are atskv selector names, `tiered:<selector>`, `host:<selector>` and
    `kvpress:<press>` names (dense is always run, it is the reference)."""

    contexts: tuple[int, ...]
    ratios: tuple[float, ...]
    methods: tuple[str, ...]
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]

    @property
    def selectors(self) -> list[str]:
        return [m for m in self.methods if Method.parse(m).runtime != KVPRESS and m != DENSE]

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
        tuple(dict.fromkeys(m for m in methods if m != DENSE)), tuple(dict.fromkeys(tasks)),
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


# --- the folder: cells done so far and the settings they were made with ------------------------


class CellStore(RowStore[Cell]):
    """`cells.jsonl` (one finished cell per line, appended as it finishes) and `settings.json`."""

    def __init__(self, out: Path, settings: dict):
        super().__init__(out, settings, "cells.jsonl", key=lambda cell: cell.key, from_json=_cell_from_json)

    @property
    def cells(self) -> dict[tuple, Cell]:
        return self.rows


def _cell_from_json(item: dict) -> Cell:
    return Cell(**{**item, **{k: tuple(item[k]) for k in ("scores", "prompt_tokens", "texts")}})


# --- running -----------------------------------------------------------------------------------


def kvpress_unavailable(python: Path, loaded) -> str | None:
    """Why kvpress cannot run here (no venv, not a Hugging Face model directory), or None."""
    try:
        peer.check_kvpress(python)
    except peer.KvpressNotInstalled as missing:
        return str(missing)
    if not (Path(loaded.model.name_or_path) / "config.json").is_file():
        return f"kvpress needs a Hugging Face model directory; {loaded.name!r} loaded from {loaded.model.name_or_path}"
    return None


def _atskv_cell(
    loaded, examples, key, selector, budget, dense_layers, sparse_prefill, new_tokens, batch_size, fast, tiering,
    host=None,
):  # fmt: skip
    """Greedy runs of `examples` in left-padded batches, as one cell (in the two-tier store with
    `tiering`'s options when given; on the fast path with the host tier `host`)."""
    tokenizer, runs = loaded.tokenizer, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        ids, mask = pad_left(tokenizer, [encode_prompt(tokenizer, ex.prompt, chat=False)[0] for ex in batch])
        runs += generate_batch(
            loaded.model, tokenizer, ids, mask, selector=selector, budget=budget,
            dense_layers=dense_layers, sparse_prefill=sparse_prefill,
            max_new_tokens=new_tokens, examples=batch, fast=fast, tiering=tiering, host=host,
        )  # fmt: skip
    context, task, seed, method, ratio = key
    prefill = "sparse" if sparse_prefill and selector is not None else "dense"
    return Cell(
        context, task, seed, method, ratio, budget, None if selector is None else dense_layers, prefill, new_tokens,
        sum(r.score for r in runs) / len(runs), tuple(r.score for r in runs), tuple(r.prompt_tokens for r in runs),
        tuple(r.text for r in runs),
    )  # fmt: skip


def _kvpress_cells(loaded, python, folder, examples, group, press, ratios, new_tokens, device, dtype) -> list[Cell]:
    """kvpress's `press` (`none`: its full-KV run) at `ratios` on `examples` through
    `peer.run_kvpress`, scored like atskv's runs; `group` is (context, task, seed)."""
    context, task, seed = group
    tagged = [peer.PeerExample(f"{task}-{context}-{seed}-{i}", context, ex) for i, ex in enumerate(examples)]
    peer.write_examples(folder / "examples.json", tagged)
    budgets = [peer.budget_fraction(r) for r in ratios]
    records = peer.run_kvpress(
        python, folder / "examples.json", Path(loaded.model.name_or_path), [press], budgets,
        folder / "kvpress.json", max_new_tokens=new_tokens, device=device, dtype=dtype,
    )  # fmt: skip
    runs = defaultdict(list)
    for run in peer.score_kvpress(records, tagged, None):
        runs[run.method, None if run.budget is None else peer.compression_ratio(run.budget)].append(run)
    order = {e.id: i for i, e in enumerate(tagged)}
    cells = []
    for (method, ratio), group_runs in runs.items():
        group_runs.sort(key=lambda run: order[run.example_id])
        cells.append(
            Cell(
                context, task, seed, method, ratio, None if ratio is None else peer.budget_fraction(ratio),
                None if ratio is None else 0,
                "dense" if ratio is None else "dense, compressed once after prefill", new_tokens,
                sum(r.score for r in group_runs) / len(group_runs), tuple(r.score for r in group_runs),
                tuple(e.n_tokens for e in examples), tuple(r.text for r in group_runs),
            )
        )  # fmt: skip
    return cells


def run_leaderboard(
    loaded,
    out: str | Path,
    grid: Grid,
    *,
    examples: int = 4,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    filler: str = "classic",
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    kvpress_python: Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    selector_options: dict[str, dict] | None = None,
    tiering: dict | None = None,
    host_tier: dict | None = None,
    fast: bool = True,
    progress: bool = True,
) -> dict[str, Path]:
    """Compute the grid's missing cells for `loaded` (a `LoadedModel`) into `out`, then write the
    report (see `write`). kvpress methods are skipped, with a message on stderr and in the table's
    notes, where kvpress cannot run (`kvpress_unavailable`). `selector_options`: constructor
    arguments by selector name (`atskv.selectors.selectors_for_model`), part of the settings a
    rerun into `out` must share, as are `tiering` (the `TieringConfig` options of the `tiered:`
    rows; none: its defaults) and `host_tier` (the `HostRetrieval` options of the `host:` rows).
    `fast`: atskv's selectors run on `atskv.generate`'s fast path (what a user serves with), else
    on the reference path (`atskv.sparse` under `model.generate`); the `tiered:` rows run
    `atskv.tiered` under `model.generate` and the `host:` rows the fast path either way; dense is
    always transformers' own `generate`."""
    from atskv.runtime.fast.host_pages import HostRetrieval
    from atskv.selectors import selectors_for_model

    check_tiering(grid, tiering, sparse_prefill, host_tier)
    host = HostRetrieval(**(host_tier or {}))  # the host: rows' tier options (a call builds its own store)

    settings = {
        "model": loaded.name, "examples": examples, "filler": filler, "dense_layers": dense_layers,
        "prefill": "sparse" if sparse_prefill else "dense", "max_new_tokens": max_new_tokens, "dtype": dtype,
        "runtime": "fast" if fast else "reference",
        **({"selector_options": {k: _as_setting(opts) for k, opts in selector_options.items()}}
           if selector_options else {}),
        **({"tiering": _as_setting(tiering)} if tiering else {}),
        # every field of the host: rows' tier, defaults included: a default that changes (the key summary
        # did, from bounds to int4) must not let a rerun add cells of another tier to a folder
        **({"host_tier": _as_setting(asdict(host))} if grid.hosted else {}),
    }  # fmt: skip
    built = dict(zip(grid.selector_names, selectors_for_model(grid.selector_names, loaded.name, selector_options)))
    selectors = {m: built[Method.parse(m).name] for m in grid.selectors}  # a tiered: or host: row shares its selector
    if fast and (slow := [m for m, s in selectors.items() if m not in grid.tiered and not s.has_fast_path()]):
        raise InputError(f"{', '.join(slow)} run on the reference path only; run the leaderboard with --fast false")
    if fast and sparse_prefill:
        raise InputError("the fast path prefills densely; sparse prefill needs --fast false")
    if no_host := [m for m in grid.hosted if not selectors[m].has_fast_path()]:
        raise InputError(f"{', '.join(no_host)}: the host tier lives on the fast path, which this selector lacks")
    store = CellStore(Path(out), settings)
    python = Path(kvpress_python) if kvpress_python else peer.default_kvpress_python()
    skipped = kvpress_unavailable(python, loaded) if grid.presses else None
    if skipped:
        print(f"kvpress methods skipped ({', '.join(str(Method(KVPRESS, p)) for p in grid.presses)}): {skipped}",
              file=sys.stderr)  # fmt: skip
    presses = [] if skipped else grid.presses
    groups = [(c, t, s) for c in grid.contexts for t in grid.tasks for s in grid.seeds]
    atskv_keys = {g: [(DENSE, None)] + [(m, r) for m in selectors for r in grid.ratios] for g in groups}
    press_runs = [(KVPRESS_DENSE, None)] + [(str(Method(KVPRESS, p)), r) for p in presses for r in grid.ratios]
    press_keys = {g: press_runs if presses else [] for g in groups}
    pending = {g: [k for k in atskv_keys[g] + press_keys[g] if (*g, *k) not in store] for g in groups}
    text = filler_text(filler)
    bar = tqdm(total=sum(map(len, pending.values())), desc="leaderboard", disable=not progress)
    failed: list[str] = []
    for group in groups:
        if not pending[group]:
            continue
        context, task, seed = group
        batch = build_examples(loaded.tokenizer, task, context, seed, examples, text)
        new_tokens = max_new_tokens or answer_room(loaded.tokenizer, batch)
        for method, ratio in (k for k in pending[group] if k in atskv_keys[group]):
            bar.set_postfix_str(f"{context} {task} seed {seed} {method} {ratio or ''}")
            budget = None if ratio is None else peer.budget_fraction(ratio)
            tier = (tiering or {}) if method in grid.tiered else None
            hosted = method in grid.hosted
            store.add(
                _atskv_cell(
                    loaded, batch, (*group, method, ratio), selectors.get(method), budget, dense_layers,
                    sparse_prefill, new_tokens, batch_size, (fast and tier is None) or hosted, tier,
                    host if hosted else None,
                )
            )  # fmt: skip
            bar.update()
        wanted = [k for k in pending[group] if k in press_keys[group]]
        for name in dict.fromkeys(Method.parse(m).name for m, _ in wanted):  # one process a press: a
            # kill (a call's time limit) loses at most the press under way, a failure only that press
            press = str(Method(KVPRESS, name))
            bar.set_postfix_str(f"{context} {task} seed {seed} {press}")
            ratios = [r for m, r in wanted if m == press and r is not None]
            folder = store.out / "kvpress" / f"{task}-{context}-seed{seed}" / name
            try:
                made = _kvpress_cells(loaded, python, folder, batch, group, name, ratios, new_tokens, device, dtype)
            except subprocess.CalledProcessError as error:
                failed.append(f"{press} on {task} at {context} tokens, seed {seed} (exit {error.returncode})")
                print(f"{failed[-1]} failed (its output is above); its cells stay empty and a rerun tries again",
                      file=sys.stderr)  # fmt: skip
                continue
            for cell in made:
                store.add(cell)
                bar.update()
    bar.close()
    cells = [store.cells[(*g, *k)] for g in groups for k in atskv_keys[g] + press_keys[g] if (*g, *k) in store.cells]
    notes = _notes(settings, grid, skipped)
    if failed:
        notes += "\n\nkvpress runs that failed (their cells are empty; a rerun tries again): " + "; ".join(failed)
    return write(cells, store.out, grid, loaded.name, notes, settings)


def _as_setting(options: Mapping) -> dict[str, str]:
    """Options as `settings.json` keeps them (values as text), so a rerun compares like with like."""
    return {k: str(v) for k, v in options.items()}


def _join_variant(label: str, known: Mapping, new: Mapping, ran: set[str]) -> dict:
    """A label a merged source already has may gain rows from a later run (some of its selectors at
    a new context, say). Each selector the run has rows of (`ran`) must have run with the label's
    options for it (none where the label has none) or be new to the label, whose options then join
    it; other settings must be the label's. A mismatch is refused: one label keeps one setting."""
    if not known:
        return dict(new)
    keys = (set(known) | set(new)) - {"selector_options"}
    clashes = [key for key in sorted(keys) if known.get(key) != new.get(key)]
    ours, theirs = dict(known.get("selector_options", {})), new.get("selector_options", {})
    for selector in sorted(ran):
        if selector in ours and ours[selector] != theirs.get(selector):
            clashes.append(f"selector_options of {selector}")
        elif selector in theirs:
            ours[selector] = theirs[selector]
    if clashes:
        raise InputError(
            f"variant {label!r}: the run differs from what the merged source records under it in {', '.join(clashes)}"
        )
    return {**known, **({"selector_options": ours} if ours else {})}


def _joins_as_variant(method: str) -> bool:
    """A variant folder's atskv rows join the merge; its dense and kvpress cells are the sources', and
    rows that already carry a label keep it out (a row has one label)."""
    parsed = Method.parse(method)
    return method != DENSE and parsed.runtime != KVPRESS and not parsed.variant


def merge_folders(
    out: str | Path, sources: Sequence[str | Path], variants: Mapping[str, str | Path] | None = None
) -> dict[str, Path]:
    """Gather the cells of folders computed in parallel (one process per context and task, say)
    into `out` and write its report from them, computing nothing. The sources must share their
    settings; a cell in several is taken once. The grid is what the cells cover, and a row
    averages over the seeds that have all its tasks (rows may rest on different seeds: the JSON
    lists them). `variants`: label -> a folder run with other `selector_options`, `tiering` or
    `host_tier` (nothing else may differ): its atskv rows join as "METHOD (label)", so one table and plot show
    a selector under two settings on the same prompts; its dense and kvpress cells are left out
    (the sources hold those)."""
    sources = [Path(s) for s in sources]
    variants = {label: Path(folder) for label, folder in (variants or {}).items()}
    if not sources:
        raise InputError("merge_folders needs at least one source folder")
    if missing := [str(s) for s in [*sources, *variants.values()] if not (s / "settings.json").is_file()]:
        raise InputError(f"not a leaderboard folder (no settings.json; merge its workers first): {', '.join(missing)}")
    settings = json.loads((sources[0] / "settings.json").read_text())
    own = {k: v for k, v in settings.items() if k != "variants"}  # a merged source's record, not its cells' setting
    base = {k: v for k, v in own.items() if k not in VARIANT_SETTINGS}
    varied, variant_stores = {}, {}
    for label, folder in variants.items():
        theirs = json.loads((folder / "settings.json").read_text())
        varied[label] = {k: theirs[k] for k in VARIANT_SETTINGS if k in theirs}
        variant_stores[label] = CellStore(folder, {**base, **varied[label]})  # refuses any other change
    known = settings.get("variants", {})  # a merged source's labels stay
    for label, ours in varied.items():
        ran = {Method.parse(c.method).name for c in variant_stores[label].cells.values() if _joins_as_variant(c.method)}
        varied[label] = _join_variant(label, known.get(label, {}), ours, ran)
    varied = {**known, **varied}
    merged = {**settings, **({"variants": varied} if varied else {})}
    store = CellStore(Path(out), merged)
    for source in sources:
        for key, cell in CellStore(source, own).cells.items():  # refuses other settings
            if key not in store:
                store.add(cell)
    for label, variant in variant_stores.items():
        for cell in variant.cells.values():
            if _joins_as_variant(cell.method):
                labelled = replace(Method.parse(cell.method), variant=label)
                if (renamed := replace(cell, method=str(labelled))).key not in store:
                    store.add(renamed)
    cells = list(store.cells.values())
    methods = [m for m in dict.fromkeys(c.method for c in cells) if m not in (DENSE, KVPRESS_DENSE)]
    tasks = {c.task for c in cells}
    grid = Grid(
        tuple(sorted({c.context for c in cells})), tuple(sorted({c.ratio for c in cells if c.ratio is not None})),
        tuple(sorted(methods, key=lambda m: Method.parse(m).runtime == KVPRESS)), tuple(t for t in TASKS if t in tasks),
        tuple(sorted({c.seed for c in cells})),
    )  # fmt: skip
    notes = _notes(settings, grid, None)
    for label, options in varied.items():
        notes += f" METHOD ({label}): the same prompts, run with {json.dumps(options)}."
    return write(cells, store.out, grid, settings["model"], notes, merged)


# --- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """A method at a ratio and context: the task-average score per seed, its mean and std."""

    context: int
    method: str
    ratio: float | None
    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]
    mean: float
    std: float
    per_task: dict[str, float]


def summarize(cells: Sequence[Cell], tasks: Sequence[str]) -> list[Summary]:
    """One summary per (context, method, ratio) over the seeds that have every task."""
    by_seed = defaultdict(dict)
    for cell in cells:
        by_seed[cell.context, cell.method, cell.ratio, cell.seed][cell.task] = cell.score
    per_setting = defaultdict(list)
    for (context, method, ratio, seed), scores in by_seed.items():
        if all(t in scores for t in tasks):
            per_setting[context, method, ratio].append((seed, scores))
    summaries = []
    for (context, method, ratio), seeds in per_setting.items():
        averages = [sum(s[t] for t in tasks) / len(tasks) for _, s in seeds]
        summaries.append(
            Summary(
                context, method, ratio, tuple(seed for seed, _ in seeds), tuple(averages),
                statistics.fmean(averages), statistics.stdev(averages) if len(averages) > 1 else 0.0,
                {t: statistics.fmean(s[t] for _, s in seeds) for t in tasks},
            )
        )  # fmt: skip
    return summaries


def _points(summary: Summary, seeds: int) -> str:
    """Score in points (0-100): mean ± std over seeds (the mean alone for one seed), saying over
    how many where fewer than the grid's `seeds` have every task."""
    n = len(summary.seeds)
    return (f"{100 * summary.mean:.1f}" + (f" ± {100 * summary.std:.1f}" if n > 1 else "")
            + (f" ({n} of {seeds} seeds)" if n < seeds else ""))  # fmt: skip


def markdown(summaries: Sequence[Summary], grid: Grid, model: str, by_task: Sequence[str] = ()) -> str:
    """A table per context: rows methods, columns `dense` (the dense run of the row's own
    environment: atskv's, or kvpress's full-KV run for its presses) and the ratios, the top score of
    each ratio in bold where two rows or more have one (every row that ties it as printed), ranking
    only the rows over the most seeds there: a row of one seed does not top rows of three.
    `by_task`: rows (say, those near dense) that also get a table per context of their score on
    each task at the grid's three highest ratios, where the rows a mean cannot rank are told apart
    (or are not)."""
    at = {(s.context, s.method, s.ratio): s for s in summaries}
    rows = [DENSE, *grid.methods]
    tables = []
    for context in grid.contexts:
        lines = [
            f"### {model}, {context} tokens",
            "",
            "| method | dense | " + " | ".join(f"{r:g}" for r in grid.ratios) + " |",
            "|---" * (len(grid.ratios) + 2) + "|",
        ]
        ranked = {}
        for r in grid.ratios:
            rows_at = [at[k] for m in grid.methods if (k := (context, m, r)) in at]
            most = max((len(s.seeds) for s in rows_at), default=0)
            ranked[r] = [s for s in rows_at if len(s.seeds) == most]
        top = {r: max(round(100 * s.mean, 1) for s in rows_at) if len(rows_at) > 1 else None  # a lone row tops nothing
               for r, rows_at in ranked.items()}  # fmt: skip
        for method in rows:
            dense = at.get((context, own_dense(method), None))
            scored = [None if method == DENSE else at.get((context, method, r)) for r in grid.ratios]
            texts = ["" if s is None else _points(s, len(grid.seeds)) for s in scored]
            cells = [f"**{t}**" if s in ranked[r] and round(100 * s.mean, 1) == top[r] else t
                     for t, s, r in zip(texts, scored, grid.ratios)]  # fmt: skip
            dense_points = _points(dense, len(grid.seeds)) if dense else ""
            lines.append(f"| {method} | {dense_points} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    for context in grid.contexts if by_task else ():
        tables.append(_task_table(at, grid, model, context, [DENSE, *by_task]))
    return "\n\n".join(tables)


def _task_table(at: Mapping, grid: Grid, model: str, context: int, methods: Sequence[str]) -> str:
    """Per-task scores (points, mean over the row's seeds) at the grid's three highest ratios, "a / b / c"."""
    ratios = sorted(grid.ratios)[-3:]
    lines = [
        f"### {model}, {context} tokens, per task at ratios {' / '.join(f'{r:g}' for r in ratios)}",
        "",
        "| method | " + " | ".join(grid.tasks) + " |",
        "|---" * (len(grid.tasks) + 1) + "|",
    ]
    for method in methods:
        keys = [(context, method, None)] if method == DENSE else [(context, method, r) for r in ratios]
        if not any(k in at for k in keys):
            continue
        cells = [" / ".join(f"{100 * at[k].per_task[t]:.0f}" if k in at else "" for k in keys) for t in grid.tasks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(
    summaries: Sequence[Summary], grid: Grid, model: str, path: Path, methods: Sequence[str] | None = None
) -> None:
    """Score against compression ratio, one panel per context, one line per method (kvpress's
    dotted; std over seeds as error bars), dense as a horizontal line. Ratios sit evenly spaced,
    in order: the grid's 0.875 and 0.9 would overlap on a linear axis. A context where no row has
    every task gets no panel. `methods`: only these (colours as in the full plot), on a y axis
    fitted to them rather than 0-100."""
    import matplotlib
    from matplotlib.figure import Figure  # renders with Agg; no pyplot, no display

    at = {(s.context, s.method, s.ratio): s for s in summaries}
    position = {r: i for i, r in enumerate(grid.ratios)}
    colors = dict(zip(grid.methods, matplotlib.colormaps["tab20"].colors * 2))  # 20 before one repeats
    contexts = [c for c in grid.contexts if any(s.context == c for s in summaries)] or list(grid.contexts)
    fig = Figure(figsize=(4.5 * len(contexts) + 2.5, 4.2), layout="constrained")
    for ax, context in zip(fig.subplots(1, len(contexts), squeeze=False)[0], contexts):
        if (dense := at.get((context, DENSE, None))) is not None:
            ax.axhline(100 * dense.mean, color="black", linestyle="--", label=DENSE)
        for method in methods if methods is not None else grid.methods:
            points = [(r, at[context, method, r]) for r in grid.ratios if (context, method, r) in at]
            if points:
                ax.errorbar(
                    [position[r] for r, _ in points], [100 * s.mean for _, s in points],
                    yerr=[100 * s.std for _, s in points], marker="o", capsize=2, label=method, color=colors[method],
                    linestyle=":" if Method.parse(method).runtime == KVPRESS else "-",
                )  # fmt: skip
        ax.set(title=f"{model}, {context} tokens", xlabel="compression ratio", ylabel="score (points)")
        if methods is None:
            ax.set_ylim(-3, 103)
        ax.set_xticks(range(len(grid.ratios)), [f"{r:g}" for r in grid.ratios])
    legend = {}  # every panel's lines, once each: a panel may lack a row
    for ax in fig.axes:
        legend |= {label: handle for handle, label in zip(*ax.get_legend_handles_labels()) if label not in legend}
    fig.legend(legend.values(), legend.keys(), loc="outside right center", fontsize="small")
    fig.savefig(path, dpi=120)


def _notes(settings: dict, grid: Grid, skipped: str | None) -> str:
    notes = (
        f"Score: mean exact-match score in points (0-100) over the tasks {', '.join(grid.tasks)}, then mean ± "
        f"sample std over seeds {list(grid.seeds)}, those with every task ({settings['examples']} prompts per "
        f"task, context and seed, {settings['filler']} filler, greedy; a cell over fewer seeds says so). Ratio r: "
        "fraction of the KV removed; budget 1 - r of the context "
        "per layer and KV head, the question included. atskv: first "
        f"{settings['dense_layers']} layers dense, {settings['prefill']} prefill, then each selector reads (an "
        f"evicting one keeps) the budget at every decode step, on the {settings.get('runtime', 'reference')} path; "
        "dense is transformers' own generate; kvpress: every layer compressed once after its "
        "dense prefill, press defaults. "
        "The dense column is the row's own environment's full-KV run (kvpress:none for kvpress's presses)."
    )
    if grid.tiered:
        options = settings.get("tiering") or "its defaults"
        notes += (
            f" tiered:<selector>: the selector in atskv.tiered ({options}) under transformers' generate: the GPU "
            "tier holds the budget, the rest waits in host memory and the best parked tokens are read back at "
            "each step."
        )
    if grid.hosted:
        options = settings.get("host_tier") or "its defaults"
        notes += (
            f" host:<selector>: the selector on the fast path with its host tier (HostRetrieval, {options}): the "
            "budget on the GPU, every token in pinned host memory, and the pages of the parked tokens each query "
            "rates highest read back at each step."
        )
    if skipped:
        notes += f"\n\nkvpress methods skipped: {skipped}"
    return notes


def write(
    cells: Sequence[Cell], out: Path, grid: Grid, model: str, notes: str, settings: dict
) -> dict[str, Path]:
    """leaderboard.md (a table per context, then the rows near dense per task, then the notes),
    leaderboard.json (settings, grid, every cell, the summaries), leaderboard.png (every row) and
    leaderboard-top.png (the rows near dense, `near_dense`, on a fitted axis) under `out`."""
    summaries = summarize(cells, grid.tasks)
    close = near_dense(summaries, grid)
    data = {"settings": settings, "grid": asdict(grid), "notes": notes, "summaries": summaries, "cells": list(cells)}
    paths = write_report(
        out, markdown(summaries, grid, model, close), data, json_name="leaderboard.json",
        markdown_name="leaderboard.md",
        notes=notes, plot=lambda path: plot(summaries, grid, model, path), png_name="leaderboard.png",
    )  # fmt: skip
    if close:
        paths["png_top"] = Path(out) / "leaderboard-top.png"
        plot(summaries, grid, model, paths["png_top"], close)
    return paths


def near_dense(summaries: Sequence[Summary], grid: Grid, points: float = 3.0) -> list[str]:
    """The methods that lose at most `points` to their own dense on average over the contexts and
    ratios they have: the rows the full plot crowds together at its top, for a plot of their own."""
    at = {(s.context, s.method, s.ratio): s.mean for s in summaries}
    close = []
    for method in grid.methods:
        dense = own_dense(method)
        losses = [at[c, dense, None] - at[c, method, r] for c in grid.contexts for r in grid.ratios
                  if (c, method, r) in at and (c, dense, None) in at]  # fmt: skip
        if losses and 100 * statistics.fmean(losses) <= points:
            close.append(method)
    return close


def own_dense(method: str) -> str:
    """The full-KV row of `method`'s own environment: kvpress's for a press, atskv's dense else."""
    return KVPRESS_DENSE if Method.parse(method).runtime == KVPRESS else DENSE
