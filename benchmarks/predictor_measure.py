"""The relevance predictor's measurement (issue 4): recall and task accuracy on held-out text for
several trained predictors (seeds), reported as mean ± std beside the baselines, the two recall
ceilings and dense task accuracy, all measured in this one run.

    python benchmarks/predictor_measure.py --model M --predictors P0 P1 P2 --out DIR \
        [--corpus moby-dick --window_tokens 8192 --windows 4 --batch_size 2] \
        [--baselines h2o snapkv streaming_llm quest sparcas kascade] \
        [--tasks passkey needle_single --task_tokens 4096 --task_budgets 0.02 0.05 0.1 --trials 16]

Writes DIR/recall (the harness's table, JSON, PNG with every seed), DIR/tasks (the same for tasks)
and DIR/summary.md: recall per budget with the learned seeds' mean ± std and the share of the
H2O -> best-single-set gap they close, and task accuracy per budget with the seeds' mean ± std.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from atskv.data import corpus_windows
from atskv.eval.method import DENSE
from atskv.eval.recall import WINDOW_CEILING, attention_recall
from atskv.eval.tasks import evaluate_tasks
from atskv.eval.tasks import write as write_tasks
from atskv.models import load_model, resolve_device
from atskv.selectors import selectors_for_model
from atskv.selectors.learned import LearnedSelector


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def learned_seeds(predictors: list[str]) -> list[LearnedSelector]:
    """One learned selector per predictor, named learned-s<i> so the reports keep them apart."""
    selectors = []
    for i, path in enumerate(predictors):
        selector = LearnedSelector(predictor=path)
        selector.name = f"learned-s{i}"
        selectors.append(selector)
    return selectors


def recall_summary(means: dict[tuple[str, int], float], seeds: list[str], budgets: list[int]) -> str:
    lines = [
        "| budget | learned (mean ± std) | h2o | best single set | gap closed (mean ± std) |",
        "|---|---|---|---|---|",
    ]
    for b in budgets:
        learned = [means[s, b] for s in seeds]
        h2o, ceiling = means.get(("h2o", b)), means[WINDOW_CEILING, b]
        closed = [(x - h2o) / (ceiling - h2o) for x in learned] if h2o is not None and ceiling > h2o else None
        lines.append(
            f"| {b} | {mean_std(learned)} | {h2o if h2o is None else f'{h2o:.3f}'} | {ceiling:.3f} | "
            f"{mean_std(closed) if closed else 'n/a'} |"
        )
    return "\n".join(lines)


def tasks_summary(results, seeds: list[str]) -> str:
    """Per task and budget: dense, the learned seeds' mean ± std, each baseline."""
    scores: dict[tuple, list[float]] = {}
    for r in results:
        scores.setdefault((r.task, r.selector, r.budget), []).append(r.score)
    tasks = list(dict.fromkeys(r.task for r in results))
    budgets = list(dict.fromkeys(r.budget for r in results if r.selector is not None))
    others = list(dict.fromkeys(r.selector for r in results if r.selector is not None and r.selector not in seeds))
    lines = ["| task | budget | dense | learned (mean ± std) | " + " | ".join(others) + " |"]
    lines.append("|---" * (4 + len(others)) + "|")
    for task in tasks:
        dense = statistics.mean(scores[task, None, None])
        for b in budgets:
            learned = [statistics.mean(scores[task, s, b]) for s in seeds]
            cells = [f"{statistics.mean(scores[task, o, b]):.2f}" for o in others]
            lines.append(f"| {task} | {b} | {dense:.2f} | {mean_std(learned)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--predictors", nargs="+", required=True, help="exported predictors, one per seed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", default="moby-dick", help="held out: never used to train the predictors")
    parser.add_argument("--window_tokens", type=int, default=8192)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument(
        "--baselines", nargs="+", default=["h2o", "snapkv", "streaming_llm", "quest", "sparcas", "kascade"]
    )
    parser.add_argument("--tasks", nargs="*", default=["passkey", "needle_single"])
    parser.add_argument("--task_tokens", type=int, default=4096)
    parser.add_argument("--task_budgets", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--task_baselines", nargs="*", default=["h2o", "snapkv", "streaming_llm"])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--dense_layers", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    device, dtype = resolve_device(args.device, "auto")
    loaded = load_model(args.model, dtype=dtype, device=device)
    seeds = learned_seeds(args.predictors)
    names = [s.name for s in seeds]
    windows = corpus_windows(loaded.tokenizer, args.corpus, args.window_tokens, args.windows)
    report = attention_recall(
        loaded.model, windows, [*selectors_for_model(args.baselines, loaded.name), *seeds], args.budgets,
        dense_layers=args.dense_layers, batch_size=args.batch_size, model_name=loaded.name,
    )
    report.write(args.out / "recall")
    parts = [
        f"# {loaded.name}: learned retention, {len(seeds)} seeds\n",
        f"## Recall: {args.windows} {args.corpus} windows of {args.window_tokens} tokens, last "
        f"{report.n_queries} queries, first {args.dense_layers} layers dense\n",
        report.markdown(), "", recall_summary(report.mean_over_layers(), names, sorted(set(args.budgets))), "",
    ]
    (args.out / "summary.md").write_text("\n".join(parts) + "\n")
    if args.tasks:
        results = evaluate_tasks(
            loaded, args.tasks, [args.task_tokens], [0.5], args.trials,
            [*selectors_for_model(args.task_baselines, loaded.name), *seeds], args.task_budgets,
            dense_layers=args.dense_layers,
        )
        write_tasks(results, args.out / "tasks")
        parts += [
            f"## Tasks at {args.task_tokens} tokens, depth 0.5, {args.trials} prompts each ({DENSE} beside)\n",
            tasks_summary(results, names), "",
        ]
        (args.out / "summary.md").write_text("\n".join(parts) + "\n")
    print("\n".join(parts))


if __name__ == "__main__":
    main()
