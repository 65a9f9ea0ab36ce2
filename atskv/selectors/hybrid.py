"""Residency + query-aware selection in one selector, named by composition:
`learned+sparq`, `h2o+quest`, `snapkv+oracle`, ...

An evicting, query-agnostic selector (H2O, SnapKV, StreamingLLM, the learned predictor) saves
memory but commits every later query to one set of tokens; a query-aware one (SparQ, Quest, the
oracle) chooses per query but keeps the whole cache. Here each does its own job with its own
budget (`HybridBudget`): the *residency* part decides which tokens the cache holds and evicts the
rest (its choice made after each step's attention, as it would make it alone at the residency
budget); the *attention* part chooses, for each query, the tokens attended among the resident
ones (the session's budget). The cache therefore holds at most the residency budget plus the
step's new token.

The attention part sees the resident tokens as if they were the whole cache: packed to the
front in position order, whatever slots eviction left them in. So Quest's pages are runs of
resident tokens, and the recall probe (which marks evicted slots instead of freeing them) scores
as the real run does. State it keeps in `layer.state` under its name (Quest's page bounds,
SparCas's compact keys) assumes slots that only grow; it is dropped whenever a resident token is
evicted and rebuilt on the next query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from atskv.budget import check_budget
from atskv.errors import InputError
from atskv.selectors.base import LayerView, Selector
from atskv.slot_cache import slot_index

RESIDENCY_FACTOR = 4  # default residency: this many times the attention budget


@dataclass(frozen=True)
class HybridBudget:
    """A hybrid's two budgets, each in the units of every budget (`check_budget`): `attention`,
    the tokens each query attends; `residency`, the tokens the cache holds (None: every token)."""

    attention: int | float
    residency: int | float | None

    def __post_init__(self):
        check_budget(self.attention)
        if self.residency is None:
            return
        check_budget(self.residency)
        if type(self.residency) is type(self.attention) and self.residency < self.attention:
            raise InputError(
                f"residency budget {self.residency} is below the attention budget {self.attention}: "
                "the cache would hold fewer tokens than a query may attend"
            )

    @classmethod
    def of(cls, attention: int | float, residency: int | float | None = None) -> HybridBudget:
        """`residency` when given, else `RESIDENCY_FACTOR` times `attention` (a fraction that
        reaches 1 keeps every token)."""
        if residency is None:
            scaled = attention * RESIDENCY_FACTOR
            residency = None if isinstance(scaled, float) and scaled >= 1.0 else scaled
        return cls(attention, residency)


@dataclass
class HybridSelector(Selector):
    """`residency`: an evicting, query-agnostic selector; `attention`: a query-aware, non-evicting
    one (instances; `make_selector("learned+sparq")` builds both by name). `residency_budget`: what
    the cache holds (None: `RESIDENCY_FACTOR` times the session's budget, the attention budget)."""

    residency: Selector
    attention: Selector
    residency_budget: int | float | None = None
    query_aware = True
    evicts = True

    def __post_init__(self):
        check_parts(self.residency, self.attention)
        if self.residency_budget is not None:
            check_budget(self.residency_budget)
        self.name = f"{self.residency.name}+{self.attention.name}"
        self.needs_attention = self.residency.needs_attention
        self.prompt_sample = self.residency.prompt_sample
        self.needs_hidden = self.residency.needs_hidden or self.attention.needs_hidden

    def has_fast_path(self) -> bool:
        return parts_have_fast_path(self.residency, self.attention)

    def check_model(self, model) -> None:
        self.residency.check_model(model)
        self.attention.check_model(model)

    def roles(self) -> tuple[Selector, Selector | None]:
        return self.residency, self.attention

    def held_budget(self, budget: int | float) -> int | float | None:
        return self.budgets(budget).residency

    def budgets(self, attention: int | float) -> HybridBudget:
        """Both budgets, for the session's (attention) budget."""
        return HybridBudget.of(attention, self.residency_budget)

    def scores(self, view: LayerView) -> torch.Tensor:
        packed, slots = resident_view(view)
        scores = self.attention.scores(packed).expand_as(packed.valid)
        index = slots.unsqueeze(2).expand_as(scores)
        return torch.full_like(view.valid, -math.inf, dtype=scores.dtype).scatter_(-1, index, scores)

    def prefill(self, view: LayerView) -> None:
        self.residency.prefill(view)
        self.attention.prefill(resident_view(view)[0])

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        self.residency.observe(view, attention_mass)

    def static_write(self, view: LayerView) -> None:
        self.residency.static_write(view)
        self.attention.static_write(view)

    def decode_variant(self, layer) -> object:
        return self.residency.decode_variant(layer)

    def unwanted(self, view: LayerView) -> torch.Tensor | None:
        return self.residency.unwanted(view)

    def retained(self, view: LayerView, attended: torch.Tensor | None) -> torch.Tensor:
        """The residency part's choice at the residency budget, whatever was attended."""
        residency = self.budgets(view.budget).residency
        every = view.layer.seen  # a budget of every token seen: nothing is evicted
        held = self.residency.retained(replace(view, budget=every if residency is None else residency), None)
        if bool((view.valid[:, :, -1] & ~held).any()):  # the attention part's packed layout changes
            view.layer.state.pop(self.attention.name, None)
        return held


def check_parts(residency: Selector | type[Selector], attention: Selector | type[Selector]) -> None:
    """Refuse parts (selectors, or their classes: the registry checks names before building any)
    that cannot play their role: residency needs an evicting, query-agnostic selector; attention
    a query-aware one that keeps the cache and observes nothing (it sees only the packed view)."""
    if not (residency.evicts and not residency.query_aware):
        raise InputError(
            f"{residency.name!r} cannot decide residency: that takes an evicting, query-agnostic selector "
            "(h2o, snapkv, streaming_llm, learned)"
        )
    if not (attention.query_aware and not attention.evicts and not attention.needs_attention):
        raise InputError(
            f"{attention.name!r} cannot choose among the resident tokens: that takes a query-aware selector "
            "that keeps the cache (sparq, quest, oracle)"
        )


def parts_have_fast_path(residency: Selector | type[Selector], attention: Selector | type[Selector]) -> bool:
    """Whether `atskv.generate` runs the composition of these parts (selectors, or their classes)
    as the reference does: both have a fast path and may be a composition's part there."""
    return all(part.fast_path and part.fast_path_as_part for part in (residency, attention))


def resident_view(view: LayerView) -> tuple[LayerView, torch.Tensor]:
    """The view the attention part scores, and the slots `[B, Hkv, R]` it packs: the slots some
    query of `view` may attend, in position order, at the front (R: the most any row has; a
    shorter row's tail is marked free and invalid)."""
    visible = view.valid.any(2)  # [B, Hkv, S]
    width = int(visible.sum(-1).max())
    slots = view.slot_pos.masked_fill(~visible, torch.iinfo(torch.long).max).argsort(-1)[..., :width]
    held = visible.gather(-1, slots)
    packed = replace(
        view,
        keys=view.keys.gather(2, slot_index(slots, view.keys)),
        visible=view.valid.gather(-1, slots.unsqueeze(2).expand(*view.valid.shape[:3], width)),
        slot_pos=view.slot_pos.gather(-1, slots).masked_fill(~held, -1),
    )
    return packed, slots
