"""Task accuracy under a KV budget: the synthetic long-context tasks of `atskv.data.tasks`, each
example generated greedily with dense KV and with every selector at every budget, scored exactly.

Every (task, length, depth, seed) example is built once and reused for all settings; the seeds
of one (task, length, depth) run together as a left-padded batch. Results come as records, a
markdown table (mean score per task and length, then the GPU KV each example held), JSON and a
plot of score against budget.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from atskv.budget import check_budget
from atskv.data.prompts import encode_prompt
from atskv.data.tasks import DEPTH_FREE, TASKS, TaskExample
from atskv.eval.generation import Runtime, generate_batch, pad_left
from atskv.eval.method import DENSE
from atskv.eval.report import write_report
from atskv.selectors import Selector, check_selector_names


@dataclass(frozen=True)
class TaskResult:
    """One example under one setting. `length` is the requested prompt length (`prompt_tokens`
    the real one); `depth` is None for tasks without one; `selector`/`budget` None for dense;
    `kv_bytes`: the GPU KV of the example's share of its batch's cache (`GenerationRun.kv_bytes`)."""

    task: str
    length: int
    depth: float | None
    seed: int
    selector: str | None
    budget: int | float | None
    score: float
    text: str
    answers: tuple[str, ...]
    prompt_tokens: int
    kv_bytes: int

    @property
    def label(self) -> str:
        return DENSE if self.selector is None else f"{self.selector}@{self.budget}"


def check_plan(
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    selectors: Sequence[str],
    budgets: Sequence[int | float],
) -> None:
    """Refuse a bad plan before any work: unknown tasks or selectors, bad depths or budgets, and
    an int budget that keeps a whole prompt (>= the shortest length: that is dense attention)."""
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from: {', '.join(TASKS)}")
    if not lengths or min(lengths) < 1 or trials < 1 or not depths:
        raise ValueError(f"need lengths >= 1, depths and trials >= 1; got {list(lengths)}, {list(depths)}, {trials}")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
    for budget in budgets:
        check_budget(budget)
        if isinstance(budget, int) and budget >= min(lengths):
            raise ValueError(
                f"budget {budget} keeps the whole {min(lengths)}-token prompt, which is dense attention; "
                "choose a smaller budget or longer prompts"
            )
    check_selector_names([s for s in selectors if isinstance(s, str)])


def answer_room(tokenizer, examples: Sequence[TaskExample]) -> int:
    """New tokens enough to state the answers with some wording around them."""
    return 2 * max(len(tokenizer(" " + ex.answer, add_special_tokens=False)["input_ids"]) for ex in examples) + 4


def evaluate_tasks(
    loaded,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    selectors: Sequence[str | Selector],
    budgets: Sequence[int | float],
    dense_layers: int = 2,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    filler: str | None = None,
    progress: bool = True,
    tiering: dict | None = None,
) -> list[TaskResult]:
    """Dense and every selector x budget on `trials` seeded examples of each task, length and depth.

    `loaded`: a `LoadedModel` (model and tokenizer). Budgets: int = tokens per layer and KV
    head, float = fraction of the context. `max_new_tokens` None: twice the answer's tokens plus
    4, per batch. `batch_size`: examples per `generate` call. `filler`: haystack text (see
    `atskv.data.filler_text`); None for generated sentences. `tiering`: run the selectors under
    `atskv.tiered` with these options instead of `atskv.sparse`.
    """
    check_plan(tasks, lengths, depths, trials, selectors, budgets)
    model, tokenizer = loaded.model, loaded.tokenizer
    groups = [(t, n, d) for t in tasks for n in lengths for d in ([None] if t in DEPTH_FREE else depths)]
    settings = [(None, None)] + [(s, b) for s in selectors for b in budgets]
    batches = [range(i, min(i + batch_size, trials)) for i in range(0, trials, batch_size)]
    bar = tqdm(total=len(groups) * len(batches) * len(settings), desc="tasks", disable=not progress)
    results = []
    for task, length, depth in groups:
        for seeds in batches:
            at = 0.0 if depth is None else depth
            examples = [TASKS[task](tokenizer, length, at, seed, filler=filler) for seed in seeds]
            ids, mask = pad_left(tokenizer, [encode_prompt(tokenizer, ex.prompt, chat=False)[0] for ex in examples])
            new_tokens = max_new_tokens or answer_room(tokenizer, examples)
            for selector, budget in settings:
                bar.set_postfix_str(f"{task} {length}")
                runs = generate_batch(
                    model,
                    tokenizer,
                    ids,
                    mask,
                    selector=selector,
                    budget=budget,
                    dense_layers=dense_layers,
                    max_new_tokens=new_tokens,
                    examples=examples,
                    runtime=Runtime.reference(tiering=tiering),
                )
                results += [
                    TaskResult(
                        task, length, depth, seed, getattr(selector, "name", selector), budget, run.score, run.text,
                        ex.answers, run.prompt_tokens, run.kv_bytes,
                    )
                    for seed, ex, run in zip(seeds, examples, runs)
                ]
                bar.update()
    bar.close()
    return results


def _means(results: Sequence[TaskResult], key, value=lambda r: r.score) -> dict:
    """Mean `value(result)` (default: the score) per `key(result)`, in first-seen order."""
    groups = defaultdict(list)
    for r in results:
        groups[key(r)].append(value(r))
    return {k: sum(v) / len(v) for k, v in groups.items()}


def markdown(results: Sequence[TaskResult]) -> str:
    """The mean score, then below it the mean GPU KV per example in MiB (over depths and seeds):
    a score is read beside the memory it cost (a learned selector with a threshold holds what it
    wants, up to its budget)."""
    mib = _table(results, lambda r: r.kv_bytes / 2**20)
    return f"{_table(results, lambda r: r.score)}\n\nGPU KV per example, MiB (mean over examples)\n\n{mib}"


def _table(results: Sequence[TaskResult], value) -> str:
    """Rows: dense first, then selector@budget; columns: task x length; cells: the mean of `value`."""
    columns = list(dict.fromkeys((r.task, r.length) for r in results))
    rows = sorted(dict.fromkeys(r.label for r in results), key=lambda label: label != DENSE)
    mean = _means(results, lambda r: (r.label, r.task, r.length), value)
    lines = [
        "| setting | " + " | ".join(f"{task} {length}" for task, length in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for label in rows:
        cells = [f"{mean[key]:.2f}" if (key := (label, *col)) in mean else "" for col in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MARKERS = "osD^vPX*"


def plot(results: Sequence[TaskResult], path: Path) -> None:
    """Mean score against budget (over lengths, depths and seeds), one line per selector and one
    panel per task; dense as a horizontal line. Budgets sit at even steps in the given order, each
    selector's points a little apart and with a marker of its own (one budget's equal scores would
    hide each other); each panel's title says how many prompts a point is the mean of."""
    from matplotlib.figure import Figure  # renders with Agg; no pyplot, no display

    tasks = list(dict.fromkeys(r.task for r in results))
    budgets = list(dict.fromkeys(r.budget for r in results if r.selector is not None))
    selectors = list(dict.fromkeys(r.selector for r in results if r.selector is not None))
    mean = _means(results, lambda r: (r.task, r.selector, r.budget))
    counts = Counter((r.task, r.selector, r.budget) for r in results)
    fig = Figure(figsize=(4 * len(tasks), 3.4), layout="constrained")
    for ax, task in zip(fig.subplots(1, len(tasks), squeeze=False)[0], tasks):
        if (task, None, None) in mean:
            ax.axhline(mean[task, None, None], color="black", linestyle="--", label=DENSE)
        for n, selector in enumerate(selectors):
            apart = 0.25 * (n - (len(selectors) - 1) / 2) / max(len(selectors), 1)
            points = [(i + apart, mean[task, selector, b])
                      for i, b in enumerate(budgets) if (task, selector, b) in mean]  # fmt: skip
            ax.plot(*zip(*points), marker=MARKERS[n % len(MARKERS)], label=selector)
        prompts = sorted({c for (t, s, _), c in counts.items() if t == task and s is not None})
        over = f"{prompts[0]} prompt{'s' if prompts[0] != 1 else ''}" if len(prompts) == 1 else "prompts"
        ax.set(title=f"{task} (mean over {over})", xlabel="budget", ylabel="mean score", ylim=(-0.05, 1.05))
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    fig.axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=120)


def write(results: Sequence[TaskResult], out: Path) -> dict[str, Path]:
    """table.md, results.json (a list of records) and tasks.png under `out`."""
    return write_report(
        out, markdown(results), list(results), json_name="results.json",
        plot=lambda path: plot(results, path), png_name="tasks.png",
    )  # fmt: skip
