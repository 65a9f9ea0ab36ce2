"""Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774): query-aware selection of whole pages from per-page key bounds.

The slots are cut into pages of `page_size` consecutive tokens (paper default 16). Each page keeps
the element-wise min and max of its keys, and a query rates a page by the upper bound
`sum_d max(q_d * min_d, q_d * max_d)` of its logits there (`atskv.kernels.quest`, max-pooled over
the GQA group). Every token gets its page's score, so the hook's top-budget keeps whole pages: a
budget that is a multiple of the page size buys the paper's "top budget/16 pages". Not evicting:
the whole cache stays reachable for the next query.

A page is bounded by the keys of its slots that some query of the view may attend (`valid`): pad
keys of a left-padded row, free slots and the tail a composition packs after a shorter row's
tokens (`atskv.selectors.hybrid.resident_view`) never enter a bound (a page without any is bounded
by zeros; none of its slots can be picked). The bounds live in the layer's state, with the
position each slot held when its page was bounded, and are updated incrementally: pages past the
slots covered so far are bounded as they arrive; pages below that are bounded again only where a
slot now holds another token or changed validity (under `atskv.tiered` demotion and promotion
refill slots below the old count; a composition's packed view re-packs). A layer's own slots that
were never freed only grow at their end, so there that comparison (and its host sync) is skipped:
the plain run stays incremental and sync-free. A left-padded row's pages still follow the batch's
slot layout (they start at the batch's first slot, the fast path's at the row's first token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atskv.kernels.quest import masked_page_bounds, quest_page_scores
from atskv.kernels.quest_decode import quest_pick, quest_step_scores
from atskv.selectors.base import LayerView, Selector, budget_tokens
from atskv.selectors.buffers import with_room


@dataclass
class _PageBounds:
    low: torch.Tensor  # [B, Hkv, room, D]
    high: torch.Tensor
    slots: int  # slots covered so far
    held: torch.Tensor | None = None  # [B, Hkv, P] int32 tokens per page: the fast path's static cache
    # reference path: [B, Hkv, room] the position each covered slot held when its page was bounded,
    # -1 where it was not attendable (`_bounds` re-bounds the pages where that changed)
    bounded: torch.Tensor | None = None


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
        """Page bounds of every slot in `view` over its attendable slots (module docstring):
        recomputing only the pages past the covered slots and, unless the view is provably
        append-only, those where a covered slot's token or validity changed."""
        keys, size = view.keys, self.page_size
        slots = keys.shape[2]
        tokens = view.slot_pos.masked_fill(~view.valid.any(2), -1)  # [B, Hkv, S]: -1 where not attendable
        state = view.layer.state.get(self.name)
        if state is None or state.bounded is None or state.bounded.shape[:2] != tokens.shape[:2]:
            empty = keys.new_empty(*keys.shape[:2], 0, keys.shape[3])
            state = _PageBounds(empty, empty, 0, bounded=tokens.new_empty(*tokens.shape[:2], 0))
            view.layer.state[self.name] = state
        covered = min(state.slots, slots)
        if covered and not _append_only(view):
            changed = _page_counts(tokens[..., :covered] != state.bounded[..., :covered], size)  # [B, Hkv, P]
            pages = changed.flatten(0, 1).amax(0).nonzero()[:, 0]  # a host sync
            if pages.numel():
                self._rebound(state, keys, tokens, pages, covered)
        if slots != state.slots:  # new slots, or fewer: from the last, partial page on
            first = covered // size
            low, high = masked_page_bounds(keys[:, :, first * size :], tokens[..., first * size :] >= 0, size)
            end = first + low.shape[2]
            state.low, state.high = with_room(state.low, end), with_room(state.high, end)
            state.low[:, :, first:end] = low
            state.high[:, :, first:end] = high
            state.bounded = with_room(state.bounded, slots)
            state.bounded[..., covered:slots] = tokens[..., covered:]
            state.slots = slots
        pages = math.ceil(slots / size)
        return state.low[:, :, :pages], state.high[:, :, :pages]

    def _rebound(self, state: _PageBounds, keys, tokens, pages: torch.Tensor, covered: int) -> None:
        """Recompute the bounds of `pages` (page ids `[n]`) over the attendable ones (`tokens >= 0`)
        of the first `covered` slots of `keys`, and record which token each of those slots holds."""
        size = self.page_size
        pad = -covered % size
        by_page = torch.nn.functional.pad(keys[:, :, :covered], (0, 0, 0, pad)).unflatten(2, (-1, size))
        held = torch.nn.functional.pad(tokens[..., :covered] >= 0, (0, pad)).unflatten(-1, (-1, size))
        low, high = masked_page_bounds(by_page[:, :, pages].flatten(2, 3), held[:, :, pages].flatten(2, 3), size)
        state.low[:, :, pages] = low
        state.high[:, :, pages] = high
        state.bounded[..., :covered] = tokens[..., :covered]  # pages not re-bounded held these already


def _append_only(view: LayerView) -> bool:
    """Whether `view` is its layer's own slot layout (not a packed copy) and the layer never freed
    a slot: its slots then only grew at the end since the bounds were taken (a slot's validity
    does not change either: padding is fixed, every later query sees every earlier token)."""
    own = view.layer.slot_pos
    return not view.layer.may_have_free and own is not None and view.slot_pos.data_ptr() == own.data_ptr()


def _page_counts(valid: torch.Tensor, size: int) -> torch.Tensor:
    """`[B, Hkv, P]` int32: how many slots of each page `valid` (`[B, Hkv, S]`) allows."""
    pad = -valid.shape[-1] % size
    return torch.nn.functional.pad(valid, (0, pad)).unflatten(-1, (-1, size)).sum(-1, dtype=torch.int32)
