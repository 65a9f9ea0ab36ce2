"""Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774): query-aware selection of whole pages from per-page key bounds.

The slots are cut into pages of `page_size` consecutive tokens (paper default 16). Each page keeps
the element-wise min and max of its keys, and a query rates a page by the upper bound
`sum_d max(q_d * min_d, q_d * max_d)` of its logits there (`atskv.kernels.quest`, max-pooled over
the GQA group). Every token gets its page's score, so the hook's top-budget keeps whole pages: a
budget that is a multiple of the page size buys the paper's "top budget/16 pages". Not evicting:
the whole cache stays reachable for the next query.

The bounds live in the layer's state and are updated incrementally: only the pages touched by new
slots are recomputed. That relies on slots being append-only in position order, which holds for
non-evicting selectors. With left padding a row's pages follow the batch's slot layout, so pad
keys enter the bounds of its first page (the hook still never attends to them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atskv.kernels.quest import masked_page_bounds, page_bounds, quest_page_scores
from atskv.kernels.quest_decode import quest_pick, quest_step_scores
from atskv.selectors.base import LayerView, Selector, budget_tokens
from atskv.selectors.buffers import with_room


@dataclass
class _PageBounds:
    low: torch.Tensor  # [B, Hkv, room, D]
    high: torch.Tensor
    slots: int  # slots covered so far
    held: torch.Tensor | None = None  # [B, Hkv, P] int32 tokens per page: the fast path's static cache


@dataclass
class QuestSelector(Selector):
    name = "quest"
    query_aware = True
    page_size: int = 16

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"quest's page_size must be >= 1 token, got {self.page_size}")

    def scores(self, view: LayerView):
        low, high = self._bounds(view)
        pages = quest_page_scores(view.query, low, high)  # [B, Hkv, Tq, P]
        return pages.repeat_interleave(self.page_size, dim=-1)[..., : view.keys.shape[2]]

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank pages rather than tokens (P = S / 16 candidates), then list the slots of the best
        pages, newest first within a page, usable slots first; the first k count (`quest_pick`).
        Two pages beyond ceil(k / 16) cover a partial last page and a padded first one. Same
        choice as ranking the token scores with ties broken towards recent tokens, except between
        pages of exactly equal bound. On the fast path the new token's page is updated and every
        page scored in one kernel (`quest_step_scores`)."""
        size = self.page_size
        state = view.layer.state.get(self.name)
        if state is not None and state.held is not None:  # the fast path: usable = held
            pages = quest_step_scores(view.query[:, :, -1], state.low, state.high, state.held, view.keys,
                                      view.slot_pos, view.layer.write_slot, size)  # fmt: skip
            valid = view.slot_pos
        else:
            valid = view.valid[:, :, -1]
            low, high = self._bounds(view)
            pages = quest_page_scores(view.query[:, :, -1], low, high)  # [B, Hkv, P]
            pages = pages.masked_fill(_page_counts(valid, size) == 0, -math.inf)  # a page of free slots only
        n_pages = min(math.ceil(budget_tokens(view) / size) + 2, pages.shape[-1])
        return quest_pick(pages, valid, view.budget, view.context[:, 0, -1], n_pages, size)

    def static_write(self, view: LayerView) -> None:
        """Fast path: at the first decode step, bounds and token counts of every page over the held
        slots (the static buffer has free slots past the end); after that `decode_indices` keeps
        the written page's up to date."""
        if not view.layer.decoding:  # a prompt chunk: bounds are built at the first decode step
            view.layer.state.pop(self.name, None)
            return
        if self.name not in view.layer.state:
            held = view.slot_pos >= 0
            low, high = masked_page_bounds(view.keys, held, self.page_size)
            counts = _page_counts(held, self.page_size)
            view.layer.state[self.name] = _PageBounds(low, high, view.keys.shape[2], counts)

    def _bounds(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Page bounds of every slot in `view`, recomputing only the pages new slots fall into."""
        keys, size = view.keys, self.page_size
        state = view.layer.state.get(self.name)
        if state is None:
            empty = keys.new_empty(*keys.shape[:2], 0, keys.shape[3])
            state = view.layer.state[self.name] = _PageBounds(empty, empty, 0)
        slots = keys.shape[2]
        if slots > state.slots:
            first = state.slots // size  # the last, partial page is recomputed with its new slots
            low, high = page_bounds(keys[:, :, first * size :], size)
            end = first + low.shape[2]
            state.low, state.high = with_room(state.low, end), with_room(state.high, end)
            state.low[:, :, first:end] = low
            state.high[:, :, first:end] = high
            state.slots = slots
        pages = math.ceil(slots / size)
        return state.low[:, :, :pages], state.high[:, :, :pages]


def _page_counts(valid: torch.Tensor, size: int) -> torch.Tensor:
    """`[B, Hkv, P]` int32: how many slots of each page `valid` (`[B, Hkv, S]`) allows."""
    pad = -valid.shape[-1] % size
    return torch.nn.functional.pad(valid, (0, pad)).unflatten(-1, (-1, size)).sum(-1, dtype=torch.int32)
