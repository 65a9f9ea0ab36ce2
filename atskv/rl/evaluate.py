"""Held-out evaluation of supervised and fine-tuned predictors: NLL of the continuation, task
exact-match, memory and reward, at equal memory, beside the evicting baselines.

Every predictor decides deterministically at the end of each held-out context (t = T - 1):
- `top<b>`: the ceil(b * T) highest logits per managed layer and KV head, what
  `LearnedSelector` keeps at a budget b; every predictor holds exactly the same memory, so
  NLL and accuracy compare at equal memory;
- `threshold`: the tokens with logit > 0 (p > 1/2), the greedy decision of the Bernoulli policy;
  memory is the predictor's own choice (the points of the alpha sweep);
- `shared<b>` (`SharedTop`): the highest logits over all managed layers and KV heads together,
  b of them all: one threshold for every row, as `threshold`, moved to the memory b. A
  threshold lets layers and heads keep different amounts; `shared<b>` gives a supervised
  predictor that same freedom at a fine-tuned predictor's memory;
- `above<c>` (`Above`): the tokens with logit > c, the threshold moved by c: memory still
  differs between contexts as the predictor sees them, so a supervised predictor's `above<c>`
  curve is the fair partner of a fine-tuned predictor's threshold point (what a constant shift
  of the logits, the cheapest possible "fine-tuning", would have reached);
- `dense`: everything kept (the ceiling, memory 1).
All of them run through `atskv.rl.rollout` (one batched continuation pass per context for every
predictor and retention). Baselines (H2O, SnapKV, StreamingLLM: the selectors that evict, so
that the continuation sees exactly what they kept) keep what they keep in the real hook,
`atskv.sparse`, after a dense prefill of the context (`selector_keep`), and their kept sets go
through the same rollout (the tests check it scores as the hook's own continuation does), with
the same read-back of dropped tokens (`retrieve`) as the predictors'.

Held-out data: corpus windows of a corpus not trained on (Moby-Dick by default; fine-tuning
trains on Austen) and task prompts from the seeds `HELDOUT_TASK_SEED_BASE` on, a range
disjoint from training (`TASK_SEED_BASE` = 1,000,000 on) and from `atskv eval tasks` and the
demo (0 on).

Reward per context as in training: -NLL on corpus windows, exact-match on task prompts (the task
metric that matters; training may use -NLL there), minus (1 - alpha) x memory.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.eval import report
from atskv.eval.method import DENSE
from atskv.figures import save_figure
from atskv.models import model_geometry
from atskv.models.cache_names import with_cache
from atskv.predictor.model import RelevanceMLP
from atskv.rl.items import CORPUS, RolloutItem, corpus_items, task_items
from atskv.rl.policy import BernoulliPolicy, GumbelTopKPolicy
from atskv.rl.rollout import RolloutResult, context_features, predictor_logits, retrieved_tokens, rollout
from atskv.selectors.base import Selector

HELDOUT_TASK_SEED_BASE = 2_000_000
THRESHOLD = "threshold"
EVICTING_BASELINES = ("h2o", "snapkv", "streaming_llm")


@dataclass(frozen=True)
class SharedTop:
    """Keep ceil(b x all logits) of the highest logits of every managed layer and KV head together."""

    budget: float

    def __post_init__(self):
        if not 0.0 < self.budget < 1.0:
            raise ValueError(f"a shared budget is a fraction in (0, 1), got {self.budget}")

    def keep(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten()
        kept = flat.topk(math.ceil(self.budget * flat.numel())).indices
        return torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, kept, True).view_as(logits)


@dataclass(frozen=True)
class Above:
    """Keep the tokens whose logit exceeds `offset`."""

    offset: float

    def keep(self, logits: torch.Tensor) -> torch.Tensor:
        return logits > self.offset


Retention = str | float | SharedTop | Above


def retention_label(mode: Retention) -> str:
    if isinstance(mode, SharedTop):
        return f"shared{mode.budget:g}"
    if isinstance(mode, Above):
        return f"above{mode.offset:g}"
    return mode if isinstance(mode, str) else f"top{mode:g}"


def keep_mask(mode: Retention, logits: torch.Tensor) -> torch.Tensor:
    """The deterministic retention `mode` (DENSE, THRESHOLD, a budget fraction per row, or a
    `SharedTop` or `Above`) of `logits` `[L, Hkv, T]`."""
    if mode == DENSE:
        return torch.ones_like(logits, dtype=torch.bool)
    if mode == THRESHOLD:
        return BernoulliPolicy().greedy(logits)
    if isinstance(mode, (SharedTop, Above)):
        return mode.keep(logits)
    return GumbelTopKPolicy(float(mode)).greedy(logits)


def _record(name: str, mode: Retention, index: int, item: RolloutItem, memory: float, result: RolloutResult, k: int):
    return {
        "predictor": name, "retention": retention_label(mode), "item": index, "source": item.source,
        "context": item.context, "memory": memory, "nll": float(result.nll[k]), "exact": bool(result.exact[k]),
    }


@torch.no_grad()
def evaluate_predictors(
    model,
    predictors: dict[str, RelevanceMLP],
    layers: Sequence[int],
    type_table: torch.Tensor,
    items: Sequence[RolloutItem],
    modes: Sequence[Retention] = (0.1, THRESHOLD),
    *,
    retrieve: int | float = 0,
    progress: bool = True,
) -> list[dict]:
    """One record per (predictor, retention mode, item), plus the dense model's ("dense");
    `retrieve`: what each continuation query reads back of the dropped tokens (`rollout`)."""
    records = []
    for index, item in enumerate(tqdm(items, desc="predictors", unit="context", disable=not progress)):
        features = context_features(model, item.ids[: item.context], layers, type_table)
        runs, keeps = [(DENSE, DENSE)], []
        logits = {name: predictor_logits(mlp, features) for name, mlp in predictors.items()}
        keeps.append(keep_mask(DENSE, next(iter(logits.values()))))
        for name, scores in logits.items():
            for mode in modes:
                runs.append((name, mode))
                keeps.append(keep_mask(mode, scores))
        result = rollout(model, item, torch.stack(keeps), layers, retrieved_tokens(retrieve, item.context))
        for k, ((name, mode), keep) in enumerate(zip(runs, keeps)):
            records.append(_record(name, mode, index, item, keep.float().mean().item(), result, k))
    return records


@torch.no_grad()
def selector_keep(model, item: RolloutItem, selector, budget: int | float, layers: Sequence[int]) -> torch.Tensor:
    """The context tokens `[L, Hkv, T]` an evicting `selector` keeps at `budget` in `layers` (the
    hook's managed layers from `layers[0]` on) after a dense prefill of `item`'s context through
    the hook, what its continuation would attend to."""
    import atskv

    device = next(model.parameters()).device
    t = item.context
    with atskv.sparse(model, selector, budget=budget, dense_layers=layers[0]) as session:
        cache = session.new_cache()
        model(item.ids[None, :t].to(device), **with_cache(model, cache), logits_to_keep=1)
    keep = torch.zeros(len(layers), model_geometry(model.config).num_kv_heads, t + 1, dtype=torch.bool, device=device)
    for i, layer in enumerate(layers):
        held = cache.layers[layer].slot_pos[0]  # [Hkv, S], -1: free
        keep[i].scatter_(-1, held.clamp(min=0).where(held >= 0, t), True)  # free slots to the spare column
    return keep[..., :t]


def evaluate_selectors(
    model,
    selectors: Sequence[str | Selector],
    items: Sequence[RolloutItem],
    budgets: Sequence[float],
    layers: Sequence[int],
    *,
    retrieve: int | float = 0,
    progress: bool = True,
) -> list[dict]:
    """One record per (evicting selector, budget fraction, item): what the selector keeps in the
    managed `layers` (`selector_keep`), scored by the rollout the predictors' retentions get, with
    the same `retrieve`. `selectors`: names, or selectors built with their options
    (`selectors_for_model`: learned with its predictor)."""
    from atskv.selectors import make_selector

    built = [make_selector(s) if isinstance(s, str) else s for s in selectors]
    for selector in built:
        if not selector.evicts or selector.query_aware:
            raise ValueError(
                f"{selector.name!r} is not an evicting, query-agnostic selector; baselines here: {EVICTING_BASELINES}"
            )
    records = []
    for index, item in enumerate(tqdm(items, desc="baselines", unit="context", disable=not progress)):
        runs = [(selector, budget) for selector in built for budget in budgets]
        keeps = torch.stack([selector_keep(model, item, selector, budget, layers) for selector, budget in runs])
        result = rollout(model, item, keeps, layers, retrieved_tokens(retrieve, item.context))
        for k, (selector, budget) in enumerate(runs):
            memory = math.ceil(budget * item.context) / item.context
            records.append(_record(selector.name, budget, index, item, memory, result, k))
    return records


def _performance(record: dict) -> float:
    return float(record["exact"]) if record["source"] != CORPUS else -record["nll"]


def run_means(records: Sequence[dict], alpha: float) -> dict[tuple[str, str], dict[str, float]]:
    """Per (predictor, retention): mean memory, NLL (corpus windows), accuracy per task and over
    tasks, and reward at `alpha`, over the items; memory also over the corpus windows and over the
    task prompts apart, since a predictor that keeps less on task prompts than on prose would
    otherwise seem to reach its NLL with less memory than it spent on the windows scored."""
    groups = defaultdict(list)
    for r in records:
        groups[r["predictor"], r["retention"]].append(r)
    means = {}
    for key, rows in groups.items():
        corpus = [r for r in rows if r["source"] == CORPUS]
        tasks = [r for r in rows if r["source"] != CORPUS]
        entry = {
            "memory": statistics.fmean(r["memory"] for r in rows),
            "reward": statistics.fmean(alpha * _performance(r) - (1 - alpha) * r["memory"] for r in rows),
        }
        if corpus:
            entry["nll"] = statistics.fmean(r["nll"] for r in corpus)
            entry["corpus_memory"] = statistics.fmean(r["memory"] for r in corpus)
        if tasks:
            entry["accuracy"] = statistics.fmean(r["exact"] for r in tasks)
            entry["task_memory"] = statistics.fmean(r["memory"] for r in tasks)
            for task in sorted({r["source"] for r in tasks}):
                entry[task] = statistics.fmean(r["exact"] for r in tasks if r["source"] == task)
        means[key] = entry
    return means


RUN_NAME = re.compile(r"^(?P<group>.+)-seed(?P<seed>\d+)$")


def group_of(run: str) -> str:
    """`alpha0.5-seed1` -> `alpha0.5`: the runs of one setting differ only in their seed."""
    match = RUN_NAME.match(run)
    return match["group"] if match else run


def summary(records: Sequence[dict], alpha_of: dict[str, float]) -> list[dict]:
    """Mean and std over the seeds of each group (predictor setting), per retention: rows of
    {group, retention, alpha, runs, <metric>: (mean, std)}. A group's reward uses its own alpha
    (`alpha_of[group]`); groups without one (supervised, baselines) get one row per alpha."""
    rows = []
    alphas = sorted(set(alpha_of.values())) or [1.0]
    for alpha in alphas:
        per_run = run_means(records, alpha)
        by_group = defaultdict(list)
        for (run, retention), entry in per_run.items():
            by_group[group_of(run), retention].append(entry)
        for (group, retention), entries in sorted(by_group.items()):
            if alpha_of.get(group, alpha) != alpha:
                continue
            row = {"group": group, "retention": retention, "alpha": alpha, "runs": len(entries)}
            for metric in entries[0]:
                values = [e[metric] for e in entries if metric in e]
                row[metric] = (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
            rows.append(row)
    return rows


def markdown(rows: Sequence[dict]) -> str:
    metrics = [m for m in ("memory", "nll", "corpus_memory", "accuracy", "task_memory") if any(m in r for r in rows)]
    tasks = sorted({k for r in rows for k in r} - {"group", "retention", "alpha", "runs", "reward", *metrics})
    head = ["alpha", "predictor", "retention", "runs", *metrics, *tasks, "reward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['alpha']:g}", r["group"], r["retention"], str(r["runs"])]
        for m in [*metrics, *tasks, "reward"]:
            cells.append(f"{r[m][0]:.3f} ± {r[m][1]:.3f}" if m in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quality_memory_plot(rows: Sequence[dict], out_png: str | Path) -> Path:
    """NLL against the memory kept on the corpus windows, task accuracy against the memory kept on
    the task prompts: the supervised predictor's top-b (shared-b, above-c) curves, the baselines'
    top-b curves, every group's threshold point (for the fine-tuned ones, the alpha sweep: the
    points to compare with the curves), the dense model; error bars are the seed std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [m for m in ("nll", "accuracy") if any(m in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    first_alpha = rows[0]["alpha"] if rows else None
    for ax, metric in zip(axes[0], panels):
        x = {"nll": "corpus_memory", "accuracy": "task_memory"}[metric]
        groups = defaultdict(list)
        for r in rows:
            if metric in r and (r["alpha"] == first_alpha or r["group"].startswith("alpha")):
                groups[r["group"]].append(r)
        for group, points in sorted(groups.items()):
            dense = [p for p in points if p["retention"] == DENSE]
            if dense:
                ax.axhline(dense[0][metric][0], color="black", lw=0.8, ls=":", label="dense")
                continue
            line = None
            curves = {"top": ("--" if group in EVICTING_BASELINES else "-") + "o", "shared": ":s", "above": "-.^"}
            if group.startswith("alpha"):  # fine-tuned predictors: their threshold points only
                curves = {}
            for kind, style in curves.items():
                curve = sorted((p for p in points if p["retention"].startswith(kind)), key=lambda p: p[x][0])
                if curve:
                    drawn = ax.errorbar([p[x][0] for p in curve], [p[metric][0] for p in curve],
                                        yerr=[p[metric][1] for p in curve], fmt=style,
                                        ms=3, capsize=2, label=f"{group} {kind}-{'c' if kind == 'above' else 'b'}",
                                        color=line[0].get_color() if line else None)
                    line = line or drawn
            for p in points:
                if p["retention"] == THRESHOLD:
                    colour = line[0].get_color() if line else None
                    ax.errorbar(p[x][0], p[metric][0], xerr=p[x][1], yerr=p[metric][1], fmt="*",
                                ms=10, color=colour, capsize=2, label=f"{group} threshold")
        ax.set_xscale("log")
        where = {"nll": "corpus windows", "accuracy": "task prompts"}[metric]
        ax.set_xlabel(f"retained fraction of the managed layers' context KV ({where})")
        ax.set_ylabel({"nll": "NLL of the continuation (held-out)", "accuracy": "task exact-match"}[metric])
        ax.legend(fontsize="x-small")
    return save_figure(fig, out_png)


def heldout_records(
    lm,
    runs: dict,
    *,
    corpus: str = "moby-dick",
    windows: int = 16,
    context_tokens: int = 2048,
    continuation_tokens: int = 32,
    tasks: Sequence[str] = ("passkey", "needle_single"),
    task_examples: int = 16,
    budgets: Sequence[float] = (0.05, 0.1, 0.2, 0.4),
    shared_budgets: Sequence[float] = (),
    offsets: Sequence[float] = (),
    baselines: Sequence[str | Selector] = EVICTING_BASELINES,
    retrieve: int | float = 0,
) -> list[dict]:
    """The records of `runs` (name -> loaded predictor, all over the same managed layers) and of
    the evicting `baselines` on held-out data of `lm` (an `atskv.models.LoadedModel`): corpus
    windows and task prompts, every retention mode (see the module docstring), each continuation
    query reading back `retrieve` dropped tokens (`rollout`)."""
    from atskv.predictor.token_types import token_type_table

    headers = {p.header.managed_layers for p in runs.values()}
    if len(headers) != 1:
        raise ValueError(f"the predictors cover different managed layers: {sorted(headers)}")
    layers = headers.pop()
    items = corpus_items(lm.tokenizer, corpus, windows, context_tokens, continuation_tokens)
    seeds = range(HELDOUT_TASK_SEED_BASE, HELDOUT_TASK_SEED_BASE + task_examples)
    items += task_items(lm.tokenizer, tasks, seeds, context_tokens)
    types = token_type_table(lm.tokenizer, lm.model.config.get_text_config(decoder=True).vocab_size)
    mlps = {name: p.mlp for name, p in runs.items()}
    modes = [*budgets, THRESHOLD, *(SharedTop(b) for b in shared_budgets), *(Above(c) for c in offsets)]
    records = evaluate_predictors(lm.model, mlps, layers, types, items, modes, retrieve=retrieve)
    records += evaluate_selectors(lm.model, baselines, items, budgets, layers, retrieve=retrieve)
    return records


def write_report(records: Sequence[dict], out: Path) -> str:
    """records.json, table.md and quality-memory.png of `records` in OUT; the table. Fine-tuned
    runs are named alpha<A>-seed<S>, and their reward is computed at A. Also a way to redraw an
    earlier evaluation from its records:
    `python -c "from atskv.rl.evaluate import *; write_report(read_records('R/records.json'), 'R')"`."""
    groups = {group_of(r["predictor"]) for r in records}
    alpha_of = {g: float(g.removeprefix("alpha")) for g in groups if g.startswith("alpha")}
    rows = summary(records, alpha_of)
    table = markdown(rows)
    report.write_report(
        out, table, {"records": list(records), "summary": rows}, json_name="records.json",
        plot=lambda path: quality_memory_plot(rows, path), png_name="quality-memory.png",
    )  # fmt: skip
    return table


def read_records(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())["records"]
