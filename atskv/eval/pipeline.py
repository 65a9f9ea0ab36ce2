"""The main job end to end at a small size, as `atskv demo` (and `make demo`) shows it: collect a
predictor's training data from a corpus, fit the predictor, export it, then run the exported
predictor against dense attention and baselines on pass-key retrieval and on attention recall
over held-out text. The defaults fit in a few minutes on a 2-core CPU with the embedded
SmolLM2-135M; every step writes under one folder, and a rerun into it resumes the collection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from atskv.budget import check_budget
from atskv.data import corpus_windows, filler_text
from atskv.errors import InputError
from atskv.eval import tasks as task_eval
from atskv.eval.recall import ORACLE_CEILING, attention_recall
from atskv.eval.report import write_report
from atskv.learned_options import check_window_share
from atskv.predictor.collect import collect
from atskv.predictor.export import export_checkpoint
from atskv.predictor.training import fit_predictor
from atskv.selectors import check_selector_names
from atskv.selectors.learned import LearnedSelector

PASSKEY_DEPTH = 0.5  # SmolLM2-135M finds a 2K-token pass key there when dense, not at 0.1 or 0.9


@dataclass
class DemoPlan:
    """What the demo does; the defaults are `atskv demo`'s."""

    corpus: str = "austen"  # training text
    windows: int = 8  # training windows (~52 MB of shards each at 2048 tokens)
    window_tokens: int = 2048
    epochs: int = 4
    heldout: str = "moby-dick"  # recall is measured on text not trained on
    recall_windows: int = 1
    recall_budgets: Sequence[int] = (64, 256)
    passkey_budget: int | float = 256
    passkey_trials: int = 2  # pass keys (seeds), all at `PASSKEY_DEPTH`
    baselines: Sequence[str] = ("snapkv", "h2o")
    dense_layers: int = 2
    seed: int = 0
    # the learned selector's question window (`LearnedSelector.window_share`): its predictor scores
    # a token from one pass, in which a pass key asked at the prompt's end is one query among
    # thousands; without it the demo's predictor missed the key that SnapKV found
    window_share: float = 0.5

    def check(self) -> None:
        """Refuse a bad plan before any work."""
        check_selector_names(list(self.baselines))
        for budget in (*self.recall_budgets, self.passkey_budget):
            check_budget(budget)
        check_window_share(self.window_share)
        if self.windows < 2 or min(self.epochs, self.recall_windows, self.passkey_trials) < 1:
            raise InputError("the demo needs windows >= 2 (one is held out for validation) and at least one epoch, "
                             "recall window and pass-key trial")


@dataclass
class DemoResult:
    table: str  # one row per method: pass-key accuracy and recall at each budget
    paths: dict[str, Path]  # what was written, by kind


def run_demo(loaded, out: str | Path, plan: DemoPlan = DemoPlan(), progress: bool = True, log=print) -> DemoResult:
    """Collect, fit, export, compare (see the module docstring) for `loaded` (a `LoadedModel`),
    writing under `out`; `log` gets one line per step."""
    plan.check()
    out = Path(out)
    log(f"1/4 collect: {plan.windows} windows of {plan.window_tokens} tokens of {plan.corpus} -> {out / 'collect'}")
    ids = corpus_windows(loaded.tokenizer, plan.corpus, plan.window_tokens, plan.windows)
    shards = collect(
        loaded.model, loaded.tokenizer, ids, out / "collect", dense_layers=plan.dense_layers, seed=plan.seed,
        model_name=loaded.name, corpus=plan.corpus, progress=progress,
    )  # fmt: skip
    log(f"2/4 fit: {plan.epochs} epochs -> {out / 'fit'}")
    validation = 1 / plan.windows  # one window held out
    checkpoint = fit_predictor(shards, out / "fit", epochs=plan.epochs, seed=plan.seed, progress=progress,
                               validation_fraction=validation)  # fmt: skip
    log(f"3/4 export -> {out / 'predictor'}")
    predictor = export_checkpoint(checkpoint, out / "predictor", loaded).parent
    learned = LearnedSelector(predictor=predictor, window_share=plan.window_share)
    learned.check_model(loaded.model)
    selectors = [learned, *plan.baselines]
    log(f"4/4 compare: learned, {', '.join(plan.baselines)} and dense on pass key and held-out recall ({plan.heldout})")
    passkey = task_eval.evaluate_tasks(
        loaded, ["passkey"], [plan.window_tokens], [PASSKEY_DEPTH], plan.passkey_trials, selectors,
        [plan.passkey_budget],
        dense_layers=plan.dense_layers, filler=filler_text("classic"), progress=progress,
    )  # fmt: skip
    paths = {f"passkey {kind}": path for kind, path in task_eval.write(passkey, out / "passkey").items()}
    heldout = corpus_windows(loaded.tokenizer, plan.heldout, plan.window_tokens, plan.recall_windows)
    recall = attention_recall(
        loaded.model, heldout, selectors, list(plan.recall_budgets), dense_layers=plan.dense_layers,
        model_name=loaded.name, progress=progress,
    )  # fmt: skip
    paths |= {f"recall {kind}": path for kind, path in recall.write(out / "recall").items()}
    table = summary(passkey, recall.mean_over_layers(), plan)
    paths["summary"] = write_report(out, table, {"passkey": passkey, "recall": recall}, json_name="summary.json",
                                    markdown_name="summary.md")["markdown"]  # fmt: skip
    return DemoResult(table, {"collection": shards, "checkpoint": checkpoint, "predictor": predictor, **paths})


def summary(passkey: list, recall: dict[tuple[str, int], float], plan: DemoPlan) -> str:
    """One row per method: pass-key accuracy (mean over depths) at the pass-key budget, attention
    recall at each recall budget; dense first, the oracle ceiling last."""
    accuracy = {}
    for r in passkey:
        accuracy.setdefault(r.selector or "dense", []).append(r.score)
    budgets = sorted(plan.recall_budgets)
    prompts = f"{plan.passkey_trials} prompt{'s' if plan.passkey_trials != 1 else ''}"
    head = (f"| method | pass key @{plan.passkey_budget} ({prompts}) | "
            + " | ".join(f"recall k={b}" for b in budgets) + " |")  # fmt: skip
    lines = [head, "|---" * (len(budgets) + 2) + "|"]
    for name in ["dense", "learned", *plan.baselines, ORACLE_CEILING]:
        key = f"{sum(accuracy[name]) / len(accuracy[name]):.2f}" if name in accuracy else ""
        dense = "1.000" if name == "dense" else ""  # dense attention reads every token
        cells = [f"{recall[(name, b)]:.3f}" if (name, b) in recall else dense for b in budgets]
        label = f"learned (window_share {plan.window_share:g})" if name == "learned" and plan.window_share else name
        lines.append(f"| {label} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
