"""Attention recall: how much of the exact attention mass each selector's choice captures.

On held-out text windows, the prompt (all but the last `n_queries` tokens) is prefilled densely
and the last tokens are decoded one at a time, teacher-forced. Every managed layer runs the
selector as it would under `atskv.sparse` (same budget, same prompt state, same evictions, which
here only mark slots as no longer selectable) but attends densely, so every selector is judged on
the same dense trajectory. For each decode query, layer and KV head the probe records the exact
attention probabilities over the whole past context, pooled (averaged) over the group's query
heads, and reports:
- recall: the share of that mass on the slots the selector kept (for a composition such as
  `learned+sparq`, the slots its query-aware part attends at the budget, among those its
  residency part still holds: what it evicted is lost to every later query, as in the real run);
- mask difference: the share of the kept slots that are not in the per-query oracle top-k;
- two ceilings, per budget: the per-query oracle top-k (any selector's limit) and the best single
  set for the window (top-k of the mass summed over the window's queries: the limit of any
  query-agnostic policy that must commit to one set).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.eval.figures import save_figure
from atskv.eval.report import write_report
from atskv.hook.sparse import SparseSession, SparsityConfig, attach
from atskv.hook.gqa import grouped_probs, sdpa_attention
from atskv.selectors import Selector, make_selector
from atskv.selectors.base import LayerView

ORACLE_CEILING = "ceiling: per-query oracle"
WINDOW_CEILING = "ceiling: best single set"


@dataclass
class RecallRecord:
    """Recall of one selector at one budget in one layer, averaged over windows, queries and KV heads."""

    selector: str
    budget: int
    layer: int
    recall: float
    mask_difference: float | None
    queries: int


def pooled_probs(view: LayerView, valid: torch.Tensor) -> torch.Tensor:
    """Exact attention probabilities of the last query over the `valid` slots, averaged over the
    query heads of each KV group: `[B, Hkv, S]` (each row sums to 1)."""
    return grouped_probs(view.query[:, :, -1:], view.keys, valid[:, :, -1:], view.scaling)[:, :, :, 0].mean(2)


def topk_mass(mass: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest masses of each row among `valid` slots: (their sum `[B, Hkv]`, a keep-mask)."""
    k = min(k, mass.shape[-1])
    top = mass.masked_fill(~valid, -1.0).topk(k, dim=-1)
    keep = torch.zeros_like(valid).scatter_(-1, top.indices, True) & valid
    return (mass * keep).sum(-1), keep


class RecallProbe(SparseSession):
    """A `SparseSession` that selects like the real one but attends densely and records recall.

    Prefill steps are dense (as in the default sparse run) and only build selector state; each
    decode step of a managed layer adds one sample per (row, KV head)."""

    def __init__(self, model, selector: Selector, config: SparsityConfig, ceiling_budgets: Sequence[int] = ()):
        super().__init__(model, selector, config)
        self.ceiling_budgets = list(ceiling_budgets)
        self.sums: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        self.window_mass: dict[int, torch.Tensor] = {}  # per layer: mass summed over the decode queries

    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        layer = self.cache.layers[module.layer_idx]
        full = self.view(module.layer_idx, layer, query, keys, attention_mask, scaling)
        selectable = layer.slot_tensor("recall_selectable", init=1.0) > 0  # what the real run would still hold
        view = dataclasses.replace(full, visible=full.valid & selectable.unsqueeze(2))
        sparse = self.is_sparse_step(query)
        keep = self.keep(view, sparse)
        if self.selector.needs_attention:  # the selector observes the attention it would have had
            self.attend_kept(view, values, keep)
        retained = self.finish(view, keep, sparse)
        if retained is not None:
            layer.slot_tensor("recall_selectable").masked_fill_(~retained, 0.0)
        if query.shape[2] == 1:
            self._record(module.layer_idx, full, keep[:, :, -1] if sparse else view.valid[:, :, -1])
        return sdpa_attention(query, keys, values, full.valid, scaling)

    def _record(self, layer_idx: int, full: LayerView, kept: torch.Tensor) -> None:
        valid = full.valid[:, :, -1]
        mass = pooled_probs(full, full.valid)
        n = mass.shape[0] * mass.shape[1]
        budget = self.config.budget
        _, oracle_keep = topk_mass(mass, valid, budget)
        acc = self.sums[(self.selector.name, budget, layer_idx)]
        acc[0] += float((mass * kept).sum())
        acc[1] += float(((kept & ~oracle_keep).sum(-1) / kept.sum(-1).clamp(min=1)).sum())
        acc[2] += n
        for k in self.ceiling_budgets:
            ceiling = self.sums[(ORACLE_CEILING, k, layer_idx)]
            ceiling[0] += float(topk_mass(mass, valid, k)[0].sum())
            ceiling[2] += n
        if self.ceiling_budgets:
            previous = self.window_mass.get(layer_idx)
            if previous is not None:  # the window grows by one slot per decode step
                mass[..., : previous.shape[-1]] += previous
            self.window_mass[layer_idx] = mass

    def window_ceilings(self, n_queries: int) -> None:
        """Close a window: the best single set's recall per budget, from the summed masses."""
        for layer_idx, summed in self.window_mass.items():
            everything = torch.ones_like(summed, dtype=torch.bool)
            for k in self.ceiling_budgets:
                acc = self.sums[(WINDOW_CEILING, k, layer_idx)]
                acc[0] += float(topk_mass(summed, everything, k)[0].sum())
                acc[2] += summed.shape[0] * summed.shape[1] * n_queries
        self.window_mass.clear()


@dataclass
class RecallReport:
    """All records of one recall evaluation, with the settings that change the numbers."""

    model: str
    window_tokens: int
    n_queries: int
    n_windows: int
    dense_layers: int
    records: list[RecallRecord]

    def mean_over_layers(self) -> dict[tuple[str, int], float]:
        grouped: dict[tuple[str, int], list[float]] = defaultdict(list)
        for r in self.records:
            grouped[(r.selector, r.budget)].append(r.recall)
        return {key: sum(v) / len(v) for key, v in grouped.items()}

    def markdown(self) -> str:
        """Rows: selectors then the two ceilings; columns: budgets; cells: recall averaged over layers."""
        means = self.mean_over_layers()
        budgets = sorted({b for _, b in means})
        names = list(dict.fromkeys(s for s, _ in means if not s.startswith("ceiling")))
        names += [ORACLE_CEILING, WINDOW_CEILING]
        lines = ["| selector | " + " | ".join(f"k={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
        for name in names:
            cells = [f"{means[(name, b)]:.3f}" if (name, b) in means else "" for b in budgets]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def write(self, out: Path) -> dict[str, Path]:
        """table.md, recall.json (settings and records) and recall.png (recall vs budget; recall
        per layer at one budget)."""
        return write_report(out, self.markdown(), self, json_name="recall.json", plot=self.plot, png_name="recall.png")

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        means = self.mean_over_layers()
        budgets = sorted({b for _, b in means})
        mid = budgets[len(budgets) // 2]
        fig, (ax_budget, ax_layer) = plt.subplots(1, 2, figsize=(12, 4.5))
        names = list(dict.fromkeys(s for s, _ in means if not s.startswith("ceiling")))
        colours = dict(zip(names, plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]))
        colours.update({ORACLE_CEILING: "black", WINDOW_CEILING: "dimgray"})
        for name in [*names, ORACLE_CEILING, WINDOW_CEILING]:
            style = dict(linestyle="--" if name.startswith("ceiling") else "-", color=colours[name], label=name)
            xs = [b for b in budgets if (name, b) in means]
            ax_budget.plot(xs, [means[(name, b)] for b in xs], marker="o", **style)
            layers = sorted((r.layer, r.recall) for r in self.records if r.selector == name and r.budget == mid)
            if layers:
                ax_layer.plot(*zip(*layers), marker=".", **style)
        ax_budget.set(xscale="log", xlabel="budget (tokens per KV head)", ylabel="attention recall", ylim=(0, 1.02))
        ax_budget.set_xticks(budgets, [str(b) for b in budgets])
        ax_budget.minorticks_off()
        ax_layer.set(xlabel="layer", ylabel=f"attention recall at k={mid}", ylim=(0, 1.02))
        ax_budget.legend(fontsize=7)
        windows = f"{self.n_windows} windows of {self.window_tokens} tokens"
        fig.suptitle(f"{self.model}: {windows}, last {self.n_queries} queries")
        save_figure(fig, path)


def attention_recall(
    model,
    windows: torch.Tensor,
    selectors: Sequence[str | Selector],
    budgets: Sequence[int],
    *,
    n_queries: int = 16,
    dense_layers: int = 2,
    batch_size: int = 4,
    model_name: str = "",
    progress: bool = True,
) -> RecallReport:
    """Recall of every selector at every budget on `windows` (`[N, T]` token ids, no padding).

    One probe run per (selector, budget) and window batch: evicting selectors' state depends on
    the budget, so nothing is shared between budgets except the ceilings, computed once."""
    if windows.dim() != 2 or windows.shape[1] <= n_queries:
        raise ValueError(f"windows must be [N, T] with T > n_queries={n_queries}, got {tuple(windows.shape)}")
    context = windows.shape[1] - n_queries
    budgets = sorted(set(budgets))
    too_big = [b for b in budgets if not isinstance(b, int) or not 1 <= b < context]
    if too_big:
        raise ValueError(
            f"recall budgets must be token counts in [1, {context}) for {context}-token prompts: {too_big}"
        )
    selectors = [make_selector(s) if isinstance(s, str) else s for s in selectors]
    runs = [(make_selector("dense"), budgets[0], True)]
    runs += [(s, b, False) for s in selectors for b in budgets]
    sums: dict[tuple[str, int, int], list[float]] = {}
    device = next(model.parameters()).device
    bar = tqdm(total=len(runs) * math.ceil(len(windows) / batch_size), desc="recall", disable=not progress)
    for selector, budget, ceilings in runs:
        probe = RecallProbe(model, selector, SparsityConfig(budget, dense_layers), budgets if ceilings else ())
        with attach(model, probe), torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size].to(device)
                cache = probe.new_cache()
                model(batch[:, :context], past_key_values=cache, use_cache=True)
                for t in range(context, batch.shape[1]):
                    model(batch[:, t : t + 1], past_key_values=cache, use_cache=True)
                if ceilings:
                    probe.window_ceilings(n_queries)
                bar.update()
        for key, acc in probe.sums.items():
            if not (ceilings and key[0] == "dense"):
                sums[key] = acc
    bar.close()
    records = [
        RecallRecord(
            name, budget, layer, acc[0] / acc[2], None if name.startswith("ceiling") else acc[1] / acc[2], int(acc[2])
        )
        for (name, budget, layer), acc in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))
    ]
    return RecallReport(model_name, windows.shape[1], n_queries, len(windows), dense_layers, records)
