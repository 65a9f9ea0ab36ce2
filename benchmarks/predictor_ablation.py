"""What each part of the learned predictor buys (issue 16, item 2): the label (future attention
mass vs KVzip+ reconstruction), the scorer (MLP vs closed-form ridge per layer and KV head) and
the MLP's inputs [h; a; f] (hidden state; attention received; token features), each measured as
attention recall on held-out text through the learned selector, beside H2O and the ceilings, and
optionally on synthetic retrieval tasks.

    atskv collect --corpus austen --windows 12 --window_tokens 2048 --label mass --out MASS
    atskv collect --corpus austen --windows 12 --window_tokens 2048 --label kvzip --out KVZIP
    python benchmarks/predictor_ablation.py --model smollm2-135m --mass MASS --kvzip KVZIP --work WORK \
        --out DIR [--variants ...] [--seeds 0 1 2] [--epochs 5] [--corpus sotu --window_tokens 2048 --windows 4 \
        --budgets 128] [--tasks passkey needle_single --task_tokens 2048 --task_budgets 0.05 --trials 8]

Every MLP variant is trained once per seed with the same epochs (`fit_predictor`: the last epoch, no
checkpoint selection) and exported into WORK/<variant> (seed 0) or WORK/<variant>-s<seed>, where a
rerun finds it; the ridge, closed form, is fitted once. The recall table gives each variant's mean
± std over its seeds. Writes DIR/recall
(the harness's table, JSON, PNG; none with `--budgets` empty), DIR/tasks (with `--tasks`),
DIR/ridge.json (each ridge fit's penalty and validation mass recall), DIR/labels.json (where each
label's positives sit) and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from atskv.data import corpus_windows
from atskv.eval.method import DENSE
from atskv.eval.recall import ORACLE_CEILING, WINDOW_CEILING, attention_recall
from atskv.eval.tasks import evaluate_tasks
from atskv.eval.tasks import write as write_tasks
from atskv.models import load_model, resolve_device
from atskv.predictor.export import export_checkpoint, export_trained
from atskv.predictor.ridge import fit_ridge
from atskv.predictor.shards import ShardDataset
from atskv.predictor.training import fit_predictor
from atskv.runtime.vllm.learned import WITHOUT
from atskv.selectors import selectors_for_model
from atskv.selectors.learned import LearnedSelector

ATTENTION = ["attention", "prev_attention"]  # a: the attention a token has received
TOKEN = ["position", "log_age", "hidden_norm", "key_norm", "token_type"]  # f: the token's own features


@dataclass(frozen=True)
class Variant:
    label: str  # which collection: mass or kvzip
    scorer: str  # mlp or ridge
    inputs: str  # what it reads, for the table
    options: dict = field(default_factory=dict)  # the MLP's (`fit_predictor`)


VARIANTS = {
    "mlp-mass": Variant("mass", "mlp", "h; a; f"),
    "mlp-kvzip": Variant("kvzip", "mlp", "h; a; f"),
    "ridge-mass": Variant("mass", "ridge", "h; a; f"),
    "ridge-kvzip": Variant("kvzip", "ridge", "h; a; f"),
    "mlp-mass-no-h": Variant("mass", "mlp", "a; f", {"reduced_width": 0}),
    "mlp-mass-no-a": Variant("mass", "mlp", "h; f", {"without": ATTENTION}),
    "mlp-mass-no-f": Variant("mass", "mlp", "h; a", {"without": TOKEN}),
    # what the vLLM plugin can feed it: no hidden state, its norm or the token type (`runtime.vllm.learned`)
    "mlp-mass-engine": Variant("mass", "mlp", "a; position, age, key norm", {"reduced_width": 0, "without": WITHOUT}),
    # and without the attention received: the plugin then needs no second QK pass over the prompt
    "mlp-mass-engine-no-a": Variant("mass", "mlp", "position, age, key norm",
                                    {"reduced_width": 0, "without": [*WITHOUT, *ATTENTION]}),
}


def trained_name(name: str, seed: int) -> str:
    """The folder (and selector) name of variant `name` trained with `seed`."""
    return name if seed == 0 else f"{name}-s{seed}"


def train(name: str, seed: int, folder: Path, out: Path, loaded, epochs: int) -> dict:
    """Export variant `name` trained with `seed` into out/`trained_name` (unless there already);
    returns what the fit reported."""
    target, variant = out / trained_name(name, seed), VARIANTS[name]
    if (target / "predictor.safetensors").is_file():
        return json.loads((target / "predictor.json").read_text())["training"]
    if variant.scorer == "ridge":
        fit = fit_ridge(folder)
        recalls = {str(alpha): recall for alpha, recall in fit.validation.items()}
        training = {"stage": "ridge", "data": {"folder": str(folder)}, "alpha": fit.alpha,
                    f"validation_{fit.metric}": recalls}
        export_trained(fit.scorer, fit.collection, target, loaded, training)
        return training
    options = {"num_workers": 0, **variant.options}  # one core
    checkpoint = fit_predictor(folder, out / "fit" / target.name, epochs=epochs, seed=seed, progress=False, **options)
    export_checkpoint(checkpoint, target, loaded)
    return json.loads((target / "predictor.json").read_text())["training"]


def positions_of_positives(folder: Path, recent: int = 64) -> dict:
    """Where a collection's top-k members sit at their decision time t: the median age (t - i),
    the share among the last `recent` tokens, and the share among the first four."""
    data = ShardDataset(folder, ["in_topk", "position", "decision"])
    positive = data.column("in_topk")
    position = data.column("position")[positive]
    age = (data.column("decision")[positive] - position).float()
    return {"positives": int(positive.sum()), "median_age": float(age.median()),
            f"share_in_last_{recent}": float((age < recent).float().mean()),
            "share_in_first_4": float((position < 4).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mass", type=Path, required=True, help="a collection with --label mass")
    parser.add_argument("--kvzip", type=Path, required=True, help="a collection with --label kvzip")
    parser.add_argument("--work", type=Path, required=True, help="trained variants, reused by a rerun")
    parser.add_argument("--out", type=Path, required=True, help="this run's reports")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="the MLP variants' seeds")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--corpus", default="sotu", help="held out: never used to train the predictors")
    parser.add_argument("--window_tokens", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--budgets", type=int, nargs="*", default=[128])
    parser.add_argument("--baselines", nargs="*", default=["h2o"])
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--tasks", nargs="*", default=[])
    parser.add_argument("--task_tokens", type=int, default=2048)
    parser.add_argument("--task_budgets", type=float, nargs="+", default=[0.05])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    device, dtype = resolve_device(args.device, "auto")
    loaded = load_model(args.model, dtype=dtype, device=device)
    folders = {"mass": args.mass, "kvzip": args.kvzip}
    runs = {}  # variant -> {run name: seed}; the ridge, closed form, once
    for name in args.variants:
        seeds = args.seeds if VARIANTS[name].scorer == "mlp" else [0]
        runs[name] = {trained_name(name, seed): seed for seed in seeds}
    trained = {}
    for name, seeded in runs.items():
        for run, seed in seeded.items():
            trained[run] = train(name, seed, folders[VARIANTS[name].label], args.work, loaded, args.epochs)
            print(f"trained {run}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ridge.json").write_text(json.dumps({n: t for n, t in trained.items() if "alpha" in t}, indent=1))
    learned = []
    for run in trained:
        selector = LearnedSelector(predictor=args.work / run)
        selector.name = run
        learned.append(selector)
    baselines = selectors_for_model(args.baselines, loaded.name)
    labels = {label: positions_of_positives(folder) for label, folder in folders.items()}
    (args.out / "labels.json").write_text(json.dumps(labels, indent=1))
    parts = [f"# {loaded.name}: predictor ablation\n", "## Where each label's positives sit\n",
             "| label | " + " | ".join(labels["mass"]) + " |", "|---" * (1 + len(labels["mass"])) + "|",
             *(f"| {label} | " + " | ".join(str(round(v, 3)) for v in stats.values()) + " |"
               for label, stats in labels.items()), ""]
    if args.budgets:
        windows = corpus_windows(loaded.tokenizer, args.corpus, args.window_tokens, args.windows)
        report = attention_recall(loaded.model, windows, [*baselines, *learned], args.budgets,
                                  batch_size=args.batch_size, model_name=loaded.name)
        report.write(args.out / "recall")
        parts += [f"## Recall on {args.windows} {args.corpus} windows of {args.window_tokens} tokens, last "
                  f"{report.n_queries} queries\n", recall_table(report.mean_over_layers(), runs, args), ""]
    if args.tasks:
        results = evaluate_tasks(loaded, args.tasks, [args.task_tokens], [0.5], args.trials, [*baselines, *learned],
                                 args.task_budgets)
        write_tasks(results, args.out / "tasks")
        parts += [f"## Tasks at {args.task_tokens} tokens, depth 0.5, {args.trials} prompts each\n",
                  tasks_table(results), ""]
    (args.out / "summary.md").write_text("\n".join(parts) + "\n")
    print("\n".join(parts))


def recall_table(means: dict, runs: dict[str, dict[str, int]], args) -> str:
    """A row per variant (mean ± std over its seeds' runs), then the baselines and ceilings."""
    rows = {**runs, **{name: [name] for name in [*args.baselines, ORACLE_CEILING, WINDOW_CEILING]}}
    lines = ["| variant | label | scorer | inputs | seeds | " + " | ".join(f"k={b}" for b in args.budgets) + " |",
             "|---" * (5 + len(args.budgets)) + "|"]
    for name, seeded in rows.items():
        v = VARIANTS.get(name, Variant("", "", ""))
        cells = []
        for b in args.budgets:
            values = [means[run, b] for run in seeded]
            spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            cells.append(f"{statistics.fmean(values):.3f}{spread}")
        seeds = len(seeded) if name in runs else ""
        lines.append(f"| {name} | {v.label} | {v.scorer} | {v.inputs} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tasks_table(results) -> str:
    """Rows: dense, then each selector at each budget; columns: tasks; cells: mean score."""
    scores: dict[tuple, list[float]] = {}
    for r in results:
        scores.setdefault((r.selector, r.budget, r.task), []).append(r.score)
    tasks = list(dict.fromkeys(r.task for r in results))
    settings = list(dict.fromkeys((r.selector, r.budget) for r in results))
    lines = ["| selector | budget | " + " | ".join(tasks) + " |", "|---" * (2 + len(tasks)) + "|"]
    for selector, budget in settings:
        cells = [f"{sum(scores[selector, budget, t]) / len(scores[selector, budget, t]):.2f}" for t in tasks]
        lines.append(f"| {selector or DENSE} | {'' if budget is None else budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
