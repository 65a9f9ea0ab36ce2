"""The selector protocol: every KV selection policy, baseline or learned, is one `Selector`.

A selector scores the cached tokens of one managed layer, per KV head; the hook keeps the
top-`budget` valid tokens of each (batch row, KV head, query). Scores are `[B, Hkv, Tq, S]`
for query-aware selectors and `[B, Hkv, 1, S]` for query-agnostic ones (broadcast over the
queries). Per-token state a selector needs (H2O's accumulator, SnapKV's prompt scores) lives in
the cache layer as a *slot tensor*, so it follows its token through growth and compaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from atskv.budget import resolve_budget
from atskv.kernels.budget import kept_count

if TYPE_CHECKING:
    from atskv.slot_cache import SlotLayer


@dataclass
class LayerView:
    """What a selector sees of one managed layer during one forward call.

    `keys` are the physical cache slots (post-RoPE, never expanded to the query heads);
    `slot_pos` holds the logical position of the token in each slot (-1 for a free slot);
    `valid[b, h, q, s]` says whether query q may attend slot s at all (causality, padding, free;
    built from `visible`, or on first read from `slot_pos` where the caller left it None);
    `context` counts the tokens each query may see in the sequence, evicted ones included: a
    fractional budget is a fraction of that, not of what happens to be left in the cache.
    """

    layer_idx: int
    query: torch.Tensor  # [B, Hq, Tq, D]
    keys: torch.Tensor  # [B, Hkv, S, D]
    visible: torch.Tensor | None  # [B, Hkv, Tq, S] bool, or None: the held slots, computed if read (`valid`)
    slot_pos: torch.Tensor  # [B, Hkv, S] long
    context: torch.Tensor  # [B, 1, Tq] long: tokens each query may see, evicted ones included
    scaling: float
    budget: int | float
    layer: SlotLayer
    hidden: torch.Tensor | None = None  # [B, Tq, d_model]: the attention input of the new tokens (needs_hidden)
    token_ids: torch.Tensor | None = None  # [B, Tq]: their input ids (needs_hidden; None with inputs_embeds)
    # the longest context this step can have, when the caller fixes shapes ahead (a captured decode
    # step is replayed for every token: its top-k size must be the largest any step needs)
    longest: int | None = None

    @property
    def valid(self) -> torch.Tensor:
        """`[B, Hkv, Tq, S]` bool. The fast path's decode views leave it to this property: most of
        its kernels read `slot_pos` themselves, and `slot_pos >= 0` cost every layer a kernel."""
        if self.visible is None:
            self.visible = (self.slot_pos >= 0).unsqueeze(2)
        return self.visible

    @property
    def fixed_shapes(self) -> bool:
        """A decode step of the fast path: its shapes fixed ahead to `longest`, it may be captured in
        a CUDA graph and replayed for every token, so nothing read on the host may change per token."""
        return self.longest is not None

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.keys.shape[1]


class Selector:
    """Base class of all selectors. Subclasses are small dataclasses holding their hyper-parameters.

    Class attributes say what a selector is and can do; the runtimes ask them, not lists of names:
    - `query_aware`: its choice depends on the current query, so the full cache must stay reachable;
    - `evicts`: what it does not keep is dropped from the cache for good (real memory savings);
    - `keeps_all`: the budget is ignored (the dense reference).
    - `needs_attention` / `needs_hidden`: the hook passes the attention mass to `observe` / the
      new tokens' hidden states and ids in `LayerView.hidden` and `LayerView.token_ids`;
      `prompt_sample` s: a prompt chunk's mass from every s-th query, times s
      (`atskv.attention.sampled_queries`; an option of the selectors that take it).
    - `fast_path`: `atskv.generate` makes the reference's choices for it: its decode-time state
      lives in slot tensors or is written in place (`static_write`), with no Python value that
      changes per token (`tests/test_decode.py` checks the tokens against the reference);
      `fast_path_as_part`: also as a part of a composition there (`has_fast_path`).
    - `per_model`: the constructor argument that holds state made for one model (a predictor, a
      profile), found by `for_model` when not given; None: the name alone builds it.
    """

    name: ClassVar[str] = ""
    query_aware: ClassVar[bool] = False
    evicts: ClassVar[bool] = False
    keeps_all: ClassVar[bool] = False
    needs_attention: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    prompt_sample: ClassVar[int] = 1
    fast_path: ClassVar[bool] = False
    fast_path_as_part: ClassVar[bool] = True
    per_model: ClassVar[str | None] = None

    @classmethod
    def for_model(cls, model_name: str) -> object:
        """The default value of the `per_model` argument for the model named `model_name`."""
        raise NotImplementedError(f"{cls.name} needs no per-model state")

    def has_fast_path(self) -> bool:
        """Whether `atskv.generate` runs this selector as the reference does (`fast_path`); a
        selector made of others (a composition, SparK) asks its parts."""
        return self.fast_path

    def check_model(self, model) -> None:
        """Refuse a model this selector's per-model state was not made for (nothing to check here)."""

    def roles(self) -> tuple[Selector, Selector | None]:
        """Who decides what the cache holds, and who chooses what a query reads among it (None:
        the same selector; a composition names its two parts)."""
        return self, None

    def held_budget(self, budget: int | float) -> int | float | None:
        """The budget of what the cache holds when a query reads `budget` tokens: the same, or a
        composition's residency budget (None: it would hold every token)."""
        return budget

    def scores(self, view: LayerView) -> torch.Tensor:
        """Relevance of every slot, `[B, Hkv, Tq or 1, S]`; higher is kept first."""
        raise NotImplementedError

    def prefill(self, view: LayerView) -> None:
        """Called after a dense prefill step, to build per-token state from the prompt."""

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ids `[B, Hkv, k]` and how many count per row `[B, Hkv]` (the first that many, in
        any order: attention reads a set), for a decode step on the hook's index path. The default
        ranks `scores`; a selector with a coarser structure (Quest's pages) ranks its units
        instead, which is cheaper, and SparQ's fast path selects by a threshold."""
        return select_top_indices(self.scores(view)[:, :, 0], view.valid[:, :, 0], view)

    def decode_variant(self, layer) -> object:
        """Fast path: which variant of the decode step the next token runs, decided on the host
        from counts alone (each variant is its own captured graph); None: every step is the same.
        The learned selector's refresh steps are a variant."""
        return None

    def static_write(self, view: LayerView) -> None:
        """Fast path (`atskv.generate`): tokens were just written into the static cache (a prompt
        chunk, or one decode token at `layer.write_slot`); update state the cache does not reset
        itself (Quest's page bounds, the learned selector's fixed features), in place and, for a
        decode token, with no host sync."""

    def unwanted(self, view: LayerView) -> torch.Tensor | None:
        """Held slots `[B, Hkv, S]` an evicting selector drops even where its budget has room (the
        budget is then a cap, not a target, and rows keep different amounts); None: it fills its
        budget. Read right after `scores`, on the same state."""
        return None

    def retained(self, view: LayerView, attended: torch.Tensor | None) -> torch.Tensor:
        """Evicting selectors: the slots `[B, Hkv, S]` to hold after a step. After a sparse step,
        those the newest query attended (`attended`: what such a selector holds is its budget);
        after a dense one (None), its top budget as the newest query sees it. A composition that
        attends fewer tokens than it holds (`atskv.selectors.hybrid`) returns its residency instead."""
        if attended is not None:
            return attended
        last = slice(-1, None)
        scores = self.scores(view)[:, :, last]
        keep = select_top_budget(scores, view.valid[:, :, last], view.budget, view.slot_pos, view.context[:, :, last])
        return without_unwanted(keep, self.unwanted(view))[:, :, 0]

    def attention_keys(self, view: LayerView) -> torch.Tensor:
        """The keys attention runs on: the cached ones, unless the selector approximates them
        (SparK's pruned channels with recovery, which SparK's own scores also read; on the fast path
        it writes them into the cache instead)."""
        return view.keys

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        """Called after every attention with the mass each slot received, `[B, Hkv, S]` (summed over
        the query heads of the group and the queries); only for selectors that set `needs_attention`."""

    def eviction_scores(self, view: LayerView) -> tuple[torch.Tensor, float]:
        """Fast path: what the eviction kernel ranks an evicting selector's held slots by, `[B, Hkv,
        S]`, and the share of the budget it keeps newest-first whatever those say (`kernels.evict`:
        H2O's recent window). By default `scores` and none."""
        return self.scores(view)[:, :, 0], 0.0

    def mass_accumulator(self, view: LayerView) -> torch.Tensor | None:
        """Fast path: the float32 slot tensor `[B, Hkv, S]` that `observe` adds the mass into, if
        that is all it does; the decode attention kernel then adds it there in place (one kernel
        fewer per step) and `observe` is not called. None: the hook calls `observe`."""
        return None


def check_view_fits(view: LayerView, geometry, layers, made_for: str, remedy: str) -> None:
    """Refuse to run per-model state (a Kascade profile, a predictor: `made_for` a model whose
    `geometry` and managed `layers` it records) on a layer of another model or layout."""
    shape = (view.query.shape[1], view.keys.shape[1], view.keys.shape[-1])
    if shape != (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim):
        raise ValueError(
            f"{made_for} ({geometry.num_heads} query / {geometry.num_kv_heads} KV heads, head dim "
            f"{geometry.head_dim}); this model has {shape[0]} / {shape[1]}, head dim {shape[2]}; {remedy}"
        )
    if view.layer_idx not in layers:
        raise ValueError(
            f"layer {view.layer_idx} is managed by the hook but {made_for} covers layers {list(layers)}; "
            "run with the dense_layers it was made with"
        )


# the prompt's last queries a selector's `prefill` sees on the fast path (the reference path shows
# it the whole prompt): a window of queries (SnapKV's, the learned selector's) must fit in it
LAST_QUERIES = 64
def select_top_budget(
    scores: torch.Tensor, valid: torch.Tensor, budget: int | float, slot_pos: torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    """Keep-mask `[B, Hkv, Tq, S]`: the `budget` highest-scoring valid slots of every row
    (`context` `[B, 1, Tq]`: the base of a fractional budget).

    Ties (SnapKV's max-pooled plateaus, several +inf tokens) go to the most recent token, so the
    choice depends on positions only, never on where a token happens to sit in the slot buffer
    (which differs with padding and slot reuse)."""
    newest_first = slot_pos.argsort(dim=-1, descending=True).unsqueeze(2).expand_as(valid)
    scores = scores.expand_as(valid).masked_fill(~valid, -math.inf).gather(-1, newest_first)
    k_row = resolve_budget(budget, context).expand(valid.shape[:3]).minimum(valid.sum(-1))  # [B, Hkv, Tq]
    k_max = int(k_row.max()) if k_row.numel() else 0
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k_max]
    top = newest_first.gather(-1, ranked)
    in_budget = torch.arange(k_max, device=top.device) < k_row.unsqueeze(-1)
    keep = torch.zeros_like(valid).scatter_(-1, top, in_budget)
    return keep & valid


def without_unwanted(keep: torch.Tensor, unwanted: torch.Tensor | None) -> torch.Tensor:
    """`keep` `[B, Hkv, Tq, S]` minus the slots a selector does not want at all (`[B, Hkv, S]`)."""
    return keep if unwanted is None else keep & ~unwanted.unsqueeze(2)


def select_top_indices(scores: torch.Tensor, valid: torch.Tensor, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode-step twin of `select_top_budget` for the index path: slot ids `[B, Hkv, k]` of
    the highest-scoring valid slots, best first, and how many of them count per row, `[B, Hkv]`
    (`scores`, `valid`: `[B, Hkv, S]`, one decode query).

    `k` comes from host-side counts (tokens seen, slots held), so no device sync is needed.
    Unlike `select_top_budget`, exact ties are broken by `torch.topk`, not by recency: only
    selectors that give many tokens the same score (Quest's pages) can choose differently, and
    then only among equally rated tokens."""
    k = min(budget_tokens(view), view.keys.shape[2])
    ranked = torch.where(valid, scores.float().clamp(min=torch.finfo(torch.float32).min), -math.inf)
    indices = ranked.topk(k, dim=-1, sorted=True).indices
    return indices, budget_lengths(view, valid)


def budget_tokens(view: LayerView) -> int:
    """The budget in tokens for the newest query of the longest row, from host-side counts only."""
    longest = view.longest if view.fixed_shapes else view.layer.seen
    return kept_count(view.budget, longest)  # plain arithmetic: a decode step must not read tensors back


def budget_lengths(view: LayerView, valid: torch.Tensor) -> torch.Tensor:
    """Tokens each (row, KV head) keeps on a decode step: its budget, at most its valid slots."""
    return resolve_budget(view.budget, view.context[:, :, -1]).minimum(valid.sum(-1))  # [B, Hkv]
