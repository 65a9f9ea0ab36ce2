"""Perplexity while decoding with a selector: the cost in language-modelling quality of a budget.

Each held-out window of `length` tokens is prefilled densely up to its last `n_eval` tokens, which
are then decoded one at a time, teacher-forced, under `atskv.sparse` (so evicting selectors really
evict and query-aware ones select at every step, as in generation). The negative log-likelihood
of those `n_eval` tokens gives the perplexity; the dense model's, on the same windows, is beside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from atskv.budget import check_budget
from atskv.eval.method import DENSE
from atskv.eval.report import write_report
from atskv.models.cache_names import returned_cache, with_cache
from atskv.runtime.reference.tiered import memory_session
from atskv.selectors import Selector, make_selector


@dataclass
class PerplexityRecord:
    selector: str
    budget: int | float | None
    length: int
    nll: float
    perplexity: float
    tokens: int

    @property
    def label(self) -> str:
        return DENSE if self.budget is None else f"{self.selector}@{self.budget}"


def decode_nll(model, windows: torch.Tensor, n_eval: int) -> torch.Tensor:
    """Summed NLL of the last `n_eval` tokens of each window `[N, T]` (prefill, then one token per
    step through the model's own cache: whatever `atskv.sparse` is active applies)."""
    context = windows.shape[1] - n_eval
    out = model(windows[:, :context], use_cache=True)
    given, logits = with_cache(model, returned_cache(out)), [out.logits[:, -1]]
    for t in range(context, windows.shape[1] - 1):  # the cache grows in place: the same object each step
        out = model(windows[:, t : t + 1], **given, use_cache=True)
        logits.append(out.logits[:, -1])
    logits = torch.stack(logits, dim=1).float()  # [N, n_eval, V]
    return F.cross_entropy(logits.flatten(0, 1), windows[:, context:].flatten(), reduction="sum")


def evaluate_perplexity(
    model,
    windows_by_length: dict[int, torch.Tensor],
    selectors: Sequence[str | Selector],
    budgets: Sequence[int | float],
    *,
    n_eval: int = 64,
    dense_layers: int = 2,
    batch_size: int = 4,
    progress: bool = True,
    tiering: dict | None = None,
) -> list[PerplexityRecord]:
    """Dense and every selector x budget on the windows of every length (`{length: [N, length]}`),
    under `atskv.sparse`, or `atskv.tiered` with the `tiering` options when given."""
    for budget in budgets:
        check_budget(budget)
        for length in windows_by_length:
            if isinstance(budget, int) and budget >= length - n_eval:
                raise ValueError(
                    f"budget {budget} keeps the whole {length - n_eval}-token prompt of the {length}-token windows; "
                    "choose a smaller budget or longer windows"
                )
    selectors = [make_selector(s) if isinstance(s, str) else s for s in selectors]
    runs = [(None, None)] + [(s, b) for s in selectors for b in budgets]
    device = next(model.parameters()).device
    total = len(runs) * sum(math.ceil(len(w) / batch_size) for w in windows_by_length.values())
    bar = tqdm(total=total, desc="perplexity", disable=not progress)
    records = []
    for length, windows in windows_by_length.items():
        if windows.shape[1] != length or length <= n_eval:
            shape = tuple(windows.shape)
            raise ValueError(f"windows for length {length} have shape {shape}; need [N, {length}] > n_eval")
        for selector, budget in runs:
            nll = 0.0
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size].to(device)
                with torch.no_grad():
                    if selector is None:
                        nll += float(decode_nll(model, batch, n_eval))
                    else:
                        with memory_session(model, selector, budget, dense_layers=dense_layers, tiering=tiering):
                            nll += float(decode_nll(model, batch, n_eval))
                bar.update()
            tokens = len(windows) * n_eval
            name = DENSE if selector is None else selector.name
            records.append(PerplexityRecord(name, budget, length, nll / tokens, math.exp(nll / tokens), tokens))
    bar.close()
    return records


def markdown(records: list[PerplexityRecord]) -> str:
    """Rows: dense first, then selector@budget; columns: window lengths; cells: perplexity (and the
    ratio to dense on the same windows)."""
    lengths = sorted({r.length for r in records})
    dense = {r.length: r.perplexity for r in records if r.budget is None}
    rows = list(dict.fromkeys(r.label for r in records))
    cell = {(r.label, r.length): r.perplexity for r in records}
    lines = ["| setting | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for label in rows:
        cells = []
        for n in lengths:
            ppl = cell.get((label, n))
            ratio = "" if label == DENSE or ppl is None else f" ({ppl / dense[n]:.3f}x)"
            cells.append("" if ppl is None else f"{ppl:.2f}{ratio}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(records: list[PerplexityRecord], out: Path) -> dict[str, Path]:
    """table.md and perplexity.json (a list of records) under `out`."""
    return write_report(out, markdown(records), list(records), json_name="perplexity.json")
