"""A leaderboard's report from its cells: the mean ± std over seeds of each row, a markdown
table per context (and per task for the rows near dense), the notes, the plots and the JSON."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from atskv.eval.leaderboard.grid import KVPRESS_DENSE, VLLM_DENSE, Cell, Grid, own_dense
from atskv.eval.method import DENSE, KVPRESS, Method
from atskv.eval.report import write_report


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


DENSE_LINES = {DENSE: {"color": "black", "linestyle": "--"}, VLLM_DENSE: {"color": "dimgrey", "linestyle": "-."},
               KVPRESS_DENSE: {"color": "dimgrey", "linestyle": ":"}}  # fmt: skip


def plot(
    summaries: Sequence[Summary], grid: Grid, model: str, path: Path, methods: Sequence[str] | None = None
) -> None:
    """Score against compression ratio, one panel per context, one line per method (kvpress's
    dotted; std over seeds as error bars), dense as a horizontal line (and vanilla vLLM's and
    kvpress's own, where their rows ran). Ratios sit evenly spaced,
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
        for name, style in DENSE_LINES.items():  # each environment's full-KV run its rows are measured against
            if (dense := at.get((context, name, None))) is not None:
                ax.axhline(100 * dense.mean, label=name if name == DENSE else f"{name} (dense)", **style)
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


def describe(settings: dict, grid: Grid, skipped: str | None) -> str:
    """The report's notes: how a score is made, what the tiered:, host: and vllm: rows run, and why
    kvpress's rows are empty where they are (`skipped`)."""
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
    if grid.engine_rows:
        notes += (
            " vllm:<selector>: vLLM with atskv's plugin (its prefill vLLM's own, dense; then the selector reads the "
            "budget at every decode step, the first layers dense as atskv's), on the same token ids, its dense "
            "column vanilla vLLM (`vllm`), the model's weights in bf16."
        )
        if tier := settings.get("engine_host_tier"):
            notes += (
                f" With the plugin's host tier ({tier}): what the selector frees is parked in pinned host memory "
                "and each decode query also reads the parked tokens of the pages it rates highest."
            )
        if engine_options := settings.get("engine_options"):
            notes += f" The plugin's own options there: {engine_options}."
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
