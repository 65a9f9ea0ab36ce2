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
- reads: how many tokens a query attends, on average;
- two ceilings, per budget: the per-query oracle top-k (any selector's limit) and the best single
  set for the window (top-k of the mass summed over the window's queries: the limit of any
  query-agnostic policy that must commit to one set).

Selectors named in `tiered` run through the two-tier store instead (`TieredRecallProbe`), as the
rows `tiered:<selector>`: their tokens really move between the GPU tier and the host, and a
query's kept set is what the tiered run reads for it, the active tokens it attends plus the parked
ones retrieval brought back, so their reads exceed the budget by the retrieved count.

Every probe attends densely, so no probe's choice changes the trajectory: the model runs once per
window batch for all the `atskv.sparse` probes together (`SharedForward`), each managed layer's
attention call shown to each probe, instead of once per (selector, budget); a selector that evicts
nothing and observes no attention is one probe for all budgets (`budget_free`). The tiered probes
keep a forward each: their tiers hold a copy of the KV apiece.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.attention import grouped_attention, grouped_probs, sdpa_attention
from atskv.errors import is_int
from atskv.eval.method import TIERED, Method
from atskv.eval.report import write_report
from atskv.figures import save_figure
from atskv.models.cache_names import with_cache
from atskv.runtime.reference.sparse import SparseSession, SparsityConfig, attach
from atskv.runtime.reference.tiered import TieredSession, tiered_configs
from atskv.selectors import Selector, make_selector, resolve_selector
from atskv.selectors.base import LayerView
from atskv.slot_cache import SlotLayer, SparseKVCache

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
    reads: float | None = None  # tokens a query attends, on average


def pooled_probs(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention probabilities of the last query over the `valid` (`[B, Hkv, Tq, S]`) slots,
    averaged over the query heads of each KV group: `[B, Hkv, S]` (each row sums to 1)."""
    return grouped_probs(query[:, :, -1:], keys, valid[:, :, -1:], scaling)[:, :, :, 0].mean(2)


def topk_mass(mass: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest masses of each row among `valid` slots: (their sum `[B, Hkv]`, a keep-mask)."""
    k = min(k, mass.shape[-1])
    top = mass.masked_fill(~valid, -1.0).topk(k, dim=-1)
    keep = torch.zeros_like(valid).scatter_(-1, top.indices, True) & valid
    return (mass * keep).sum(-1), keep


class RecallSums:
    """Running sums of one probe run, per (selector, budget, layer) for each of its `budgets`: the
    mass kept, the mask difference, the samples and the tokens read; with `ceiling_budgets`, the
    two ceilings too."""

    def __init__(self, name: str, budgets: Sequence[int], ceiling_budgets: Sequence[int] = ()):
        self.name, self.budgets, self.ceiling_budgets = name, list(budgets), list(ceiling_budgets)
        self.sums: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
        self.window_mass: dict[int, torch.Tensor] = {}  # per layer: mass summed over the decode queries

    def add(self, layer_idx: int, mass: torch.Tensor, valid: torch.Tensor, kept: Sequence[torch.Tensor]) -> None:
        """One decode query's exact `mass` `[B, Hkv, S]` over the `valid` slots and what was `kept`
        at each budget."""
        n = mass.shape[0] * mass.shape[1]
        for budget, keep in zip(self.budgets, kept, strict=True):
            _, oracle_keep = topk_mass(mass, valid, budget)
            acc = self.sums[(self.name, budget, layer_idx)]
            acc[0] += float((mass * keep).sum())
            acc[1] += float(((keep & ~oracle_keep).sum(-1) / keep.sum(-1).clamp(min=1)).sum())
            acc[2] += n
            acc[3] += float(keep.sum())
        for k in self.ceiling_budgets:
            ceiling = self.sums[(ORACLE_CEILING, k, layer_idx)]
            ceiling[0] += float(topk_mass(mass, valid, k)[0].sum())
            ceiling[2] += n
        if self.ceiling_budgets:
            summed = mass.clone()  # `mass` is every probe's (`DenseStep.newest_mass`)
            previous = self.window_mass.get(layer_idx)
            if previous is not None:  # the window grows by one slot per decode step
                summed[..., : previous.shape[-1]] += previous
            self.window_mass[layer_idx] = summed

    def close_window(self, n_queries: int) -> None:
        """Close a window: the best single set's recall per budget, from the summed masses."""
        for layer_idx, summed in self.window_mass.items():
            everything = torch.ones_like(summed, dtype=torch.bool)
            for k in self.ceiling_budgets:
                acc = self.sums[(WINDOW_CEILING, k, layer_idx)]
                acc[0] += float(topk_mass(summed, everything, k)[0].sum())
                acc[2] += summed.shape[0] * summed.shape[1] * n_queries
        self.window_mass.clear()


@dataclass
class DenseStep:
    """One managed layer's attention call on the dense trajectory, as every probe judges it: the
    view of the whole context (`view.valid`: what dense attention sees) and what more than one
    probe reads of it, computed once, on first read."""

    view: LayerView
    values: torch.Tensor

    @cached_property
    def received_mass(self) -> torch.Tensor:
        """The mass each slot receives from dense attention over `view.valid`, `[B, Hkv, S]`: what
        a selector that needs the attention observes after the prompt's dense step."""
        v = self.view
        return grouped_attention(v.query, v.keys, self.values, v.valid, v.scaling, want_mass=True)[1]

    @cached_property
    def newest_mass(self) -> torch.Tensor:
        """The newest query's exact attention, pooled over each KV group: what recall is measured on."""
        return pooled_probs(self.view.query, self.view.keys, self.view.valid, self.view.scaling)


def budget_free(selector: Selector) -> bool:
    """Whether the budget leaves a selector's state alone: it evicts nothing and observes no
    attention, so what it holds and scores is the same at every budget (its scores do not read
    the budget either: none of these selectors' does) and one run measures it at all of them."""
    return not selector.evicts and not selector.needs_attention


class RecallProbe(SparseSession):
    """A `SparseSession` that selects like the real one but attends densely and records recall.

    Prefill steps are dense (as in the default sparse run) and only build selector state; each
    decode step of a managed layer adds one sample per (row, KV head) and budget: `config.budget`,
    or each of `budgets` for a `budget_free` selector. Attached alone it runs its own forward;
    `attention_recall` shows it the shared one (`SharedForward`)."""

    def __init__(
        self,
        model,
        selector: Selector,
        config: SparsityConfig,
        ceiling_budgets: Sequence[int] = (),
        budgets: Sequence[int] | None = None,
    ):
        super().__init__(model, selector, config)
        self.budgets = [config.budget] if budgets is None else list(budgets)
        if len(self.budgets) > 1 and not budget_free(selector):
            raise ValueError(f"{selector.name} evicts or observes the attention: one probe per budget")
        self.recorder = RecallSums(selector.name, self.budgets, ceiling_budgets)

    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        full = self.view(module.layer_idx, self.cache.layers[module.layer_idx], query, keys, attention_mask, scaling)
        self.judge(DenseStep(full, values))
        return sdpa_attention(query, keys, values, full.valid, scaling)

    def judge(self, step: DenseStep) -> None:
        """Choose as the real run would at this call (on this probe's cache layer, whose slots
        are the step's), let the selector observe, mark what it would evict as no longer
        selectable, and record a decode query's recall."""
        layer = self.cache.layers[step.view.layer_idx]
        full = dataclasses.replace(step.view, slot_pos=layer.slot_pos[..., : layer.length], budget=self.config.budget,
                                   layer=layer)  # fmt: skip
        selectable = layer.slot_tensor("recall_selectable", init=1.0) > 0  # what the real run would still hold
        sparse = self.is_sparse_step(full.query)
        # a dense step is the prompt's, the first on a fresh cache: every slot is still selectable
        # (and its `[B, Hkv, Tq, S]` mask is not copied once per probe)
        view = dataclasses.replace(full, visible=full.valid & selectable.unsqueeze(2)) if sparse else full
        kept = self.keeps(view, sparse, self.budgets)
        keep = kept[0]  # the only one where it matters below: a budget's state (`budget_free`)
        if self.selector.needs_attention:  # the selector observes the attention it would have had
            if not sparse and self.selector.attention_keys(view) is view.keys and self.selector.prompt_sample == 1:
                self.selector.observe(view, step.received_mass)
            else:
                self.attend_kept(view, step.values, keep)
        retained = self.finish(view, keep, sparse)
        if retained is not None:
            layer.slot_tensor("recall_selectable").masked_fill_(~retained, 0.0)
        if full.query.shape[2] == 1:
            self._record(step, [keep[:, :, -1] for keep in kept])

    def _record(self, step: DenseStep, kept: list[torch.Tensor]) -> None:
        self.recorder.add(step.view.layer_idx, step.newest_mass, step.view.valid[:, :, -1], kept)


class SelectorStateLayer(SlotLayer):
    """A slot layer that holds its slots' positions and selector state but no keys or values (it
    stores them with zero channels): a recall probe's in the shared forward, whose cache holds
    the keys and values once for every probe."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return super().update(key_states[..., :0], value_states[..., :0])


class SharedForward(SparseSession):
    """The dense forward of a window batch, run once for every probe in `probes`.

    Each managed layer's attention call is shown to every probe (`RecallProbe.judge`): the same
    inputs, bit for bit, as its own forward would give it, since probes attend densely. This
    session's cache holds the KV; a probe's keeps its selector state (`SelectorStateLayer`), its
    slots following this cache's, which never evicts."""

    def __init__(self, model, probes: Sequence[RecallProbe], dense_layers: int):
        super().__init__(model, make_selector("dense"), SparsityConfig(1, dense_layers))
        self.probes = list(probes)

    @property
    def needs_hidden(self) -> bool:
        return any(probe.needs_hidden for probe in self.probes)

    @property
    def recorders(self) -> list[RecallSums]:
        return [probe.recorder for probe in self.probes]

    def new_cache(self) -> SparseKVCache:
        """A cache for the next window batch, and fresh selector state for every probe."""
        for probe in self.probes:
            probe.bind(SparseKVCache(self.model.config, probe.managed_layers, lambda i: SelectorStateLayer()))
        return super().new_cache()

    def release(self) -> None:
        """Drop the last window batch's caches (a run after this one needs the memory)."""
        self.cache = None
        for probe in self.probes:
            probe.cache = None

    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        layer_idx, new = module.layer_idx, query.shape[2]
        full = self.view(layer_idx, self.cache.layers[layer_idx], query, keys, attention_mask, scaling)
        step = DenseStep(full, values)
        for probe in self.probes:
            # the call's tokens are the last `new` slots: this cache only appends
            probe.cache.layers[layer_idx].update(keys[:, :, -new:], values[:, :, -new:])
            probe.judge(step)
        return sdpa_attention(query, keys, values, full.valid, scaling)


class TieredRecallProbe(TieredSession):
    """A `TieredSession` that moves tokens between the tiers as the real run does (demotion,
    retrieval, promotion) but attends densely over a copy of the whole context it keeps in
    position order, so it is judged on the same trajectory as every other selector. A decode
    query's kept set is what the tiered run read for it: the active tokens it attended (a
    composition's attention pick) and the parked candidates fetched for it. Windows are unpadded."""

    def __init__(self, model, selector: Selector, config: SparsityConfig, tiering, recorder: RecallSums):
        super().__init__(model, selector, config, tiering)
        self.recorder = recorder
        self.context: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer: every token's key, value
        self._read: list[torch.Tensor] = []  # positions `[B, Hkv, n]` (-1: none) the step's query read

    @property
    def recorders(self) -> list[RecallSums]:
        return [self.recorder]

    def new_cache(self):
        self.context.clear()
        return super().new_cache()

    def release(self) -> None:
        """Drop the last window batch's tiers and context (a run after this one needs the memory)."""
        self.cache = None
        self.context.clear()

    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        layer = self.cache.layers[module.layer_idx]
        full_keys, full_values = self._grow_context(module.layer_idx, layer, keys, values, query.shape[2])
        self._read = []
        super().attend(module, query, keys, values, attention_mask, scaling)  # the real run's choices and moves
        tq, seen = query.shape[2], full_keys.shape[2]
        positions = torch.arange(seen, device=full_keys.device)
        visible = (positions <= positions[seen - tq :].unsqueeze(-1)).expand(*full_keys.shape[:2], tq, seen)
        if tq == 1:
            mass = pooled_probs(query, full_keys, visible, scaling)
            read = torch.zeros(*mass.shape[:2], seen + 1, dtype=torch.bool, device=mass.device)
            for chosen in self._read:
                read.scatter_(-1, torch.where(chosen >= 0, chosen, seen), True)
            self.recorder.add(module.layer_idx, mass, visible[:, :, -1], [read[..., :seen]])
        return sdpa_attention(query, full_keys, full_values, visible, scaling)

    def attended(self, view: LayerView, query: torch.Tensor) -> torch.Tensor:
        keep = super().attended(view, query)
        self._read.append(view.slot_pos.masked_fill(~keep[:, :, -1], -1))  # positions now: a rebalance moves slots
        return keep

    def _retrieve(self, layer, view: LayerView, log_normaliser: torch.Tensor):
        positions, on_device = super()._retrieve(layer, view, log_normaliser)
        self._read.append(on_device)
        return positions, on_device

    def _grow_context(self, layer_idx: int, layer, keys, values, tq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole context with this step's `tq` tokens appended, found in the active
        tier (where every new token lands) by their positions."""
        start = layer.seen - tq
        slot_pos = layer.slot_pos[..., : layer.length]
        order = torch.where(slot_pos >= start, slot_pos - start, tq).unsqueeze(-1)  # others to a spare row

        def arrived(tensor: torch.Tensor) -> torch.Tensor:
            b, h, _, d = tensor.shape
            spare = tensor.new_zeros(b, h, tq + 1, d)
            return spare.scatter_(2, order.expand(-1, -1, -1, d), tensor)[:, :, :tq]

        new = arrived(keys), arrived(values)
        previous = self.context.get(layer_idx)
        if previous is not None:
            new = tuple(torch.cat(pair, dim=2) for pair in zip(previous, new))
        self.context[layer_idx] = new
        return new


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
        """Rows: selectors then the two ceilings; columns: budgets; cells: recall averaged over
        layers, and for a tiered run the tokens a query read (its budget plus what it retrieved)."""
        means = self.mean_over_layers()
        reads: dict[tuple[str, int], list[float]] = defaultdict(list)
        for r in self.records:
            if r.reads is not None and Method.parse(r.selector).runtime == TIERED:  # ceilings read nothing
                reads[(r.selector, r.budget)].append(r.reads)
        budgets = sorted({b for _, b in means})
        names = list(dict.fromkeys(s for s, _ in means if not s.startswith("ceiling")))
        names += [ORACLE_CEILING, WINDOW_CEILING]
        lines = ["| selector | " + " | ".join(f"k={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]

        def cell(name: str, budget: int) -> str:
            if (name, budget) not in means:
                return ""
            read = reads.get((name, budget))
            return f"{means[(name, budget)]:.3f}" + (f" ({sum(read) / len(read):.0f} read)" if read else "")

        for name in names:
            cells = [cell(name, b) for b in budgets]
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
        # the oracle selector keeps each query's top-k: the per-query ceiling's curve, drawn once
        ceilings = [WINDOW_CEILING] if "oracle" in names else [ORACLE_CEILING, WINDOW_CEILING]
        for name in [*names, *ceilings]:
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
        windows = f"{self.n_windows} window{'s' if self.n_windows != 1 else ''} of {self.window_tokens} tokens"
        fig.suptitle(f"{self.model}: {windows}, last {self.n_queries} queries")
        save_figure(fig, path)


def attention_recall(
    model,
    windows: torch.Tensor,
    selectors: Sequence[str | Selector],
    budgets: Sequence[int],
    *,
    tiered: Sequence[str | Selector] = (),
    tiering: dict | None = None,
    n_queries: int = 16,
    dense_layers: int = 2,
    batch_size: int = 4,
    model_name: str = "",
    progress: bool = True,
) -> RecallReport:
    """Recall of every selector at every budget on `windows` (`[N, T]` token ids, no padding):
    `selectors` under `atskv.sparse`, `tiered` through the two-tier store with the `tiering`
    options (`TieringConfig` fields), labelled `tiered:<selector>`.

    The `selectors` share one dense forward per window batch (`SharedForward`) with the ceilings'
    probe: a probe per budget for a selector whose state the budget changes (evicting, or
    observing the attention it was given), one for every budget otherwise (`budget_free`). Each
    tiered probe runs a forward of its own."""
    if windows.dim() != 2 or windows.shape[1] <= n_queries:
        raise ValueError(f"windows must be [N, T] with T > n_queries={n_queries}, got {tuple(windows.shape)}")
    context = windows.shape[1] - n_queries
    budgets = sorted(set(budgets))
    too_big = [b for b in budgets if not is_int(b) or not 1 <= b < context]
    if too_big:
        raise ValueError(
            f"recall budgets must be token counts in [1, {context}) for {context}-token prompts: {too_big}"
        )

    def made(names):  # a learned selector trained for another model fails here, before any run
        return [resolve_selector(s, model) for s in names]

    def tiered_probe(selector: Selector, budget: int) -> TieredRecallProbe:
        configs = tiered_configs(selector, budget, dense_layers, tiering or {})
        return TieredRecallProbe(model, selector, *configs, RecallSums(str(Method(TIERED, selector.name)), [budget]))

    # every probe is built before any runs: a bad budget or tiering option fails before the work
    ceilings = RecallProbe(model, make_selector("dense"), SparsityConfig(budgets[0], dense_layers), budgets)
    chosen = made(selectors)
    # one probe for each budget of a selector the budget changes, one for all budgets of the others;
    # a copy of the selector for each probe: a selector may carry state from one layer to the next
    # within a forward step (Kascade's anchors, the learned selector's previous layer), and the
    # shared forward runs every probe's layer before the next layer
    probes = [
        RecallProbe(model, copy.deepcopy(s), SparsityConfig(group[0], dense_layers), budgets=group)
        for s in chosen
        for group in ([budgets] if budget_free(s) else [[b] for b in budgets])
    ]
    shared = SharedForward(model, [ceilings, *probes], dense_layers)
    runs = [shared, *(tiered_probe(s, b) for s in made(tiered) for b in budgets)]
    names = ", ".join(["ceilings", *(s.name for s in chosen)])
    described = [f"{names} at budget{'s' if len(budgets) > 1 else ''} {', '.join(map(str, budgets))}"]
    described += [f"{run.recorder.name} at budget {run.recorder.budgets[0]}" for run in runs[1:]]
    sums: dict[tuple[str, int, int], list[float]] = {}
    device = next(model.parameters()).device
    batches = math.ceil(len(windows) / batch_size)
    bar = tqdm(total=len(runs) * batches * (1 + n_queries), desc="recall", unit="forward", disable=not progress)
    for run, what in zip(runs, described):
        with attach(model, run), torch.no_grad():
            for number, start in enumerate(range(0, len(windows), batch_size), 1):
                batch = windows[start : start + batch_size].to(device)
                given = with_cache(model, run.new_cache())
                steps = [batch[:, :context], *(batch[:, t : t + 1] for t in range(context, batch.shape[1]))]
                for i, ids in enumerate(steps):  # the prompt, then each query
                    stage = f"query {i}/{n_queries}" if i else "prompt"
                    bar.set_postfix_str(f"{what}; window batch {number}/{batches}, {stage}", refresh=True)
                    model(ids, **given, use_cache=True, logits_to_keep=1)  # the logits are not read
                    bar.update()
                for recorder in run.recorders:
                    recorder.close_window(n_queries)
        run.release()
        for recorder in run.recorders:
            recorded = recorder.sums.items()
            if recorder is ceilings.recorder:  # the dense selector under the ceilings is not a row
                recorded = [(key, acc) for key, acc in recorded if key[0] != "dense"]
            sums.update(recorded)
    bar.close()
    records = []
    for (name, budget, layer), (mass, difference, n, reads) in sorted(sums.items()):
        measured = not name.startswith("ceiling")
        records.append(RecallRecord(
            name, budget, layer, mass / n, difference / n if measured else None, int(n), reads / n if measured else None
        ))  # fmt: skip
    return RecallReport(model_name, windows.shape[1], n_queries, len(windows), dense_layers, records)
