"""Held-out evaluation of supervised and fine-tuned predictors: NLL of the continuation, task
exact-match, memory and reward, at equal memory, beside the evicting baselines.

Every predictor decides deterministically at the end of each held-out context (t = T - 1):
- `top<b>`: the ceil(b * T) highest logits per managed layer and KV head, what
  `LearnedSelector` keeps at a budget b; every predictor holds exactly the same memory, so
  NLL and accuracy compare at equal memory;
- `threshold`: the tokens with logit > 0 (p > 1/2), the greedy decision of the Bernoulli policy;
  memory is the predictor's own choice (the points of the alpha sweep);
- `dense`: everything kept (the ceiling, memory 1).
All of them run through `atskv.rl.rollout` (one batched continuation pass per context for every
predictor and retention). Baselines (H2O, SnapKV, StreamingLLM: the selectors that evict, so
that the continuation sees exactly what they kept) run through the real hook, `atskv.sparse`,
with a dense prefill of the context and the continuation as one further dense step over the
kept tokens, which is what the rollouts compute.

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
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.eval.figures import save_figure
from atskv.models import DEFAULT_MODEL
from atskv.predictor.model import RelevanceMLP
from atskv.rl.items import CORPUS, RolloutItem, corpus_items, task_items
from atskv.rl.policy import BernoulliPolicy, GumbelTopKPolicy
from atskv.rl.rollout import RolloutResult, context_features, continuation_scores, predictor_logits, rollout

HELDOUT_TASK_SEED_BASE = 2_000_000
DENSE, THRESHOLD = "dense", "threshold"
EVICTING_BASELINES = ("h2o", "snapkv", "streaming_llm")


def retention_label(mode: str | float) -> str:
    return mode if isinstance(mode, str) else f"top{mode:g}"


def keep_mask(mode: str | float, logits: torch.Tensor) -> torch.Tensor:
    """The deterministic retention `mode` (DENSE, THRESHOLD, or a budget fraction) of `logits` `[..., T]`."""
    if mode == DENSE:
        return torch.ones_like(logits, dtype=torch.bool)
    if mode == THRESHOLD:
        return BernoulliPolicy().greedy(logits)
    return GumbelTopKPolicy(float(mode)).greedy(logits)


def _record(name: str, mode: str | float, index: int, item: RolloutItem, memory: float, result: RolloutResult, k: int):
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
    modes: Sequence[str | float] = (0.1, THRESHOLD),
    *,
    progress: bool = True,
) -> list[dict]:
    """One record per (predictor, retention mode, item), plus the dense model's ("dense")."""
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
        result = rollout(model, item, torch.stack(keeps), layers)
        for k, ((name, mode), keep) in enumerate(zip(runs, keeps)):
            records.append(_record(name, mode, index, item, keep.float().mean().item(), result, k))
    return records


@torch.no_grad()
def selector_rollout(model, item: RolloutItem, selector, budget: int | float, dense_layers: int) -> RolloutResult:
    """Score `item`'s continuation with an evicting `selector` at `budget` through the hook: a dense
    prefill of the context (after which it evicts to its budget), then the continuation as one
    dense step over the tokens it kept."""
    import atskv

    device = next(model.parameters()).device
    ids = item.ids.to(device)[None]
    with atskv.sparse(model, selector, budget=budget, dense_layers=dense_layers) as session:
        prefill = model(ids[:, : item.context], past_key_values=session.new_cache(), logits_to_keep=1)
        rest = model(ids[:, item.context : -1], past_key_values=prefill.past_key_values).logits
    return continuation_scores(prefill.logits[0, -1], rest, ids[0, item.context :])


def evaluate_selectors(
    model,
    selectors: Sequence[str],
    items: Sequence[RolloutItem],
    budgets: Sequence[float],
    dense_layers: int,
    *,
    progress: bool = True,
) -> list[dict]:
    """One record per (evicting selector, budget fraction, item), through the hook."""
    from atskv.selectors import SELECTORS, make_selector

    for name in selectors:
        if name not in SELECTORS or not SELECTORS[name].evicts or SELECTORS[name].query_aware:
            raise ValueError(
                f"{name!r} is not an evicting, query-agnostic selector; baselines here: {EVICTING_BASELINES}"
            )
    records = []
    for index, item in enumerate(tqdm(items, desc="baselines", unit="context", disable=not progress)):
        for name in selectors:
            for budget in budgets:
                result = selector_rollout(model, item, make_selector(name), budget, dense_layers)
                memory = math.ceil(budget * item.context) / item.context
                records.append(_record(name, budget, index, item, memory, result, 0))
    return records


def _performance(record: dict) -> float:
    return float(record["exact"]) if record["source"] != CORPUS else -record["nll"]


def run_means(records: Sequence[dict], alpha: float) -> dict[tuple[str, str], dict[str, float]]:
    """Per (predictor, retention): mean memory, NLL (corpus windows), accuracy per task and over
    tasks, and reward at `alpha`, over the items."""
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
        if tasks:
            entry["accuracy"] = statistics.fmean(r["exact"] for r in tasks)
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
    metrics = [m for m in ("memory", "nll", "accuracy") if any(m in r for r in rows)]
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
    """NLL (and task accuracy) against retained memory: every group's top-b curve, its threshold
    point (the alpha sweep), the baselines, the dense model; error bars are the seed std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [m for m in ("nll", "accuracy") if any(m in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    first_alpha = rows[0]["alpha"] if rows else None
    for ax, metric in zip(axes[0], panels):
        groups = defaultdict(list)
        for r in rows:
            if metric in r and (r["alpha"] == first_alpha or r["group"].startswith("alpha")):
                groups[r["group"]].append(r)
        for group, points in sorted(groups.items()):
            dense = [p for p in points if p["retention"] == DENSE]
            if dense:
                ax.axhline(dense[0][metric][0], color="black", lw=0.8, ls=":", label="dense")
                continue
            curve = sorted((p for p in points if p["retention"].startswith("top")), key=lambda p: p["memory"][0])
            style = "--" if group in EVICTING_BASELINES else "-"
            line = None
            if curve:
                line = ax.errorbar([p["memory"][0] for p in curve], [p[metric][0] for p in curve],
                                   yerr=[p[metric][1] for p in curve], fmt=style + "o", ms=3, capsize=2,
                                   label=f"{group} top-b")
            for p in points:
                if p["retention"] == THRESHOLD:
                    colour = line[0].get_color() if line else None
                    ax.errorbar(p["memory"][0], p[metric][0], xerr=p["memory"][1], yerr=p[metric][1], fmt="*",
                                ms=10, color=colour, capsize=2, label=f"{group} threshold")
        ax.set_xscale("log")
        ax.set_xlabel("retained fraction of the managed layers' context KV")
        ax.set_ylabel({"nll": "NLL of the continuation (held-out)", "accuracy": "task exact-match"}[metric])
        ax.legend(fontsize="x-small")
    return save_figure(fig, out_png)


def heldout_report(
    model: str = DEFAULT_MODEL,
    supervised: list[str] | None = None,
    finetuned: Path = Path("runs/rl/predictors"),
    out: Path = Path("results/rl"),
    corpus: str = "moby-dick",
    windows: int = 16,
    context_tokens: int = 2048,
    continuation_tokens: int = 32,
    tasks: list[str] = ["passkey", "needle_single"],  # noqa: B006 (read-only; a list for the CLI)
    task_examples: int = 16,
    budgets: list[float] = [0.05, 0.1, 0.2, 0.4],  # noqa: B006
    baselines: list[str] = list(EVICTING_BASELINES),  # noqa: B006
    device: str = "auto",
    dtype: str = "auto",
) -> str:
    """Evaluate supervised and fine-tuned predictors on held-out data; write records.json,
    table.md and quality-memory.png into OUT; return the table.

    Args:
        model: the base model.
        supervised: supervised predictors (exported folders or model names; several are seeds);
            default: MODEL's (the user's export, else the shipped one).
        finetuned: a folder of exported fine-tuned predictors named alpha<A>-seed<S> (A: the
            alpha it was trained with, which its reward is computed at).
        out: output folder.
        corpus: held-out text (not trained on).
        windows: corpus windows.
        context_tokens: T, the context decided on.
        continuation_tokens: C, the tokens scored after it.
        tasks: synthetic tasks (prompts from seeds HELDOUT_TASK_SEED_BASE on).
        task_examples: prompts per task.
        budgets: retained fractions for the equal-memory comparisons (top-b) and the baselines.
        baselines: evicting selectors run through the hook at the same budgets.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.models import load_model, resolve_device
    from atskv.predictor.export import find_predictor, load_predictor
    from atskv.predictor.token_types import token_type_table

    device, torch_dtype = resolve_device(device, dtype)
    lm = load_model(model, dtype=torch_dtype, device=device)
    runs = {}
    for i, source in enumerate(supervised or [model]):
        path = Path(source) if Path(source).exists() else find_predictor(source)
        runs[f"supervised-seed{i}"] = load_predictor(path, lm.model, device)
    alpha_of = {}
    for folder in sorted(Path(finetuned).glob("alpha*-seed*")):
        runs[folder.name] = load_predictor(folder, lm.model, device)
        alpha_of[group_of(folder.name)] = float(group_of(folder.name).removeprefix("alpha"))
    headers = {p.header.managed_layers for p in runs.values()}
    if len(headers) != 1:
        raise ValueError(f"the predictors cover different managed layers: {sorted(headers)}")
    layers = headers.pop()
    items = corpus_items(lm.tokenizer, corpus, windows, context_tokens, continuation_tokens)
    seeds = range(HELDOUT_TASK_SEED_BASE, HELDOUT_TASK_SEED_BASE + task_examples)
    items += task_items(lm.tokenizer, tasks, seeds, context_tokens)
    types = token_type_table(lm.tokenizer, lm.model.config.get_text_config(decoder=True).vocab_size)
    mlps = {name: p.mlp for name, p in runs.items()}
    records = evaluate_predictors(lm.model, mlps, layers, types, items, [*budgets, THRESHOLD])
    records += evaluate_selectors(lm.model, baselines, items, budgets, dense_layers=layers[0])
    rows = summary(records, alpha_of)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.json").write_text(json.dumps({"records": records, "summary": rows}, indent=1))
    table = markdown(rows)
    (out / "table.md").write_text(table + "\n")
    quality_memory_plot(rows, out / "quality-memory.png")
    return table


if __name__ == "__main__":
    from jsonargparse import auto_cli

    print(auto_cli(heldout_report))
