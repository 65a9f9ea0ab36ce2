"""Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv:2406.10774): query-aware selection of whole pages from per-page key bounds.

The slots are cut into pages of `page_size` consecutive tokens (paper default 16), a row's from its
first real token on, as when the row runs alone (where pages start: below). Each page keeps
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
the plain run stays incremental and sync-free.

Where pages start: on the fast path a row's held slots begin at its first real token (its static
cache drops left padding). On the reference path a left-padded batch keeps each row's pad slots
at the front of its own slot layout, so there the pages are cut from a grid on which each row's
slots sit `-pad % page_size` empty slots to the right (`_grid_shift`; pad: the tokens the row's
newest query does not see, fixed for the run): the row's first real token starts a page, and a
padded row picks the pages the fast path and the row alone pick. The grid stays put when the
tiered store frees and refills slots of that layout (a pad slot it refills lands in a page before
the first real token's). A composition's packed view holds no pad slots: its grid is not shifted,
its pages start at its first slot, the row's first resident token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atskv.kernels.quest import masked_page_bounds, quest_page_scores
from atskv.kernels.quest_decode import quest_pick, quest_step_scores
from atskv.selectors.base import LayerView, Selector, budget_tokens
from atskv.selectors.buffers import with_room
from atskv.slot_cache import slot_index


@dataclass
class _PageBounds:
    low: torch.Tensor  # [B, Hkv, room, D]
    high: torch.Tensor
    slots: int  # slots covered so far
    held: torch.Tensor | None = None  # [B, Hkv, P] int32 tokens per page: the fast path's static cache
    # reference path: [B, Hkv, room] the position each slot of the page grid (`_grid`) held when its
    # page was bounded, -1 where none or not attendable (`_bounds` re-bounds the pages where that changed)
    bounded: torch.Tensor | None = None


@dataclass
class QuestSelector(Selector):
    name = "quest"
    fast_path = True
    # not a composition's part on the fast path: Quest's pages need position-ordered slots
    fast_path_as_part = False
    query_aware = True
    page_size: int = 16

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"quest's page_size must be >= 1 token, got {self.page_size}")

    def scores(self, view: LayerView):
        low, high, shift = self._bounds(view)
        pages = quest_page_scores(view.query, low, high)  # [B, Hkv, Tq, P]
        page = (torch.arange(view.keys.shape[2], device=shift.device) + shift) // self.page_size  # [B or 1, 1, S]
        return pages.gather(-1, page.unsqueeze(2).expand(*pages.shape[:3], -1))

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank pages rather than tokens (P = S / 16 candidates), then list the slots of the best
        pages, newest first within a page, usable slots first; the first k count (`quest_pick`).
        Two pages beyond ceil(k / 16) cover a partial last page and a padded first one. Same
        choice as ranking the token scores with ties broken towards recent tokens, except between
        pages of exactly equal bound. On the fast path the new token's page is updated and every
        page scored in one kernel (`quest_step_scores`)."""
        size, slots = self.page_size, view.keys.shape[2]
        n_pages = math.ceil(budget_tokens(view) / size) + 2
        state = view.layer.state.get(self.name)
        if state is not None and state.held is not None:  # the fast path: usable = held, no grid shift
            pages = quest_step_scores(view.query[:, :, -1], state.low, state.high, state.held, view.keys,
                                      view.slot_pos, view.layer.write_slot, size)  # fmt: skip
            return quest_pick(pages, view.slot_pos, view.budget, view.context[:, 0, -1],
                              min(n_pages, pages.shape[-1]), size)  # fmt: skip
        low, high, shift = self._bounds(view)
        at = _grid(shift, slots, size)
        valid = _on_grid(view.valid[:, :, -1], at) & (at >= 0)  # [B, Hkv, W]
        pages = quest_page_scores(view.query[:, :, -1], low, high)  # [B, Hkv, P]
        pages = pages.masked_fill(_page_counts(valid, size) == 0, -math.inf)  # a page of free slots only
        grid_slots, lengths = quest_pick(pages, valid, view.budget, view.context[:, 0, -1],
                                         min(n_pages, pages.shape[-1]), size)  # fmt: skip
        return (grid_slots - shift).clamp(0, slots - 1).int(), lengths

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

    def _bounds(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bounds of every page of `view`'s page grid over its attendable slots, and the grid's
        shift (module docstring): recomputing only the pages from the one of the first uncovered
        slot on (a grid slot below the covered count holds a covered slot or none) and, unless the
        view is provably append-only, those where a grid slot's token or validity changed."""
        keys, size = view.keys, self.page_size
        slots = keys.shape[2]
        shift = _grid_shift(view, size)
        at = _grid(shift, slots, size)
        attendable = view.slot_pos.masked_fill(~view.valid.any(2), -1)
        tokens = _on_grid(attendable, at).masked_fill(at < 0, -1)  # [B, Hkv, W]: -1 where none or not attendable
        width = tokens.shape[-1]
        state = view.layer.state.get(self.name)
        if state is None or state.bounded is None or state.bounded.shape[:2] != tokens.shape[:2]:
            empty = keys.new_empty(*keys.shape[:2], 0, keys.shape[3])
            state = _PageBounds(empty, empty, 0, bounded=tokens.new_empty(*tokens.shape[:2], 0))
            view.layer.state[self.name] = state
        covered = min(state.slots, slots)
        if covered and not _append_only(view):
            seen = min(_grid_width(state.slots, size), width)  # grid slots bounded before
            changed = _page_counts(tokens[..., :seen] != state.bounded[..., :seen], size)  # [B, Hkv, P]
            pages = changed.flatten(0, 1).amax(0).nonzero()[:, 0]  # a host sync
            if pages.numel():
                self._rebound(state, keys, tokens, at, pages)
        if slots != state.slots:  # new slots, or fewer
            first, end = covered // size, width // size
            start = first * size
            low, high = masked_page_bounds(_on_grid(keys, at[..., start:]), tokens[..., start:] >= 0, size)
            state.low, state.high = with_room(state.low, end), with_room(state.high, end)
            state.low[:, :, first:end] = low
            state.high[:, :, first:end] = high
            state.bounded = with_room(state.bounded, width)
            state.bounded[..., start:width] = tokens[..., start:]
            state.slots = slots
        return state.low[:, :, : width // size], state.high[:, :, : width // size], shift

    def _rebound(self, state: _PageBounds, keys, tokens, at, pages: torch.Tensor) -> None:
        """Recompute the bounds of grid `pages` (page ids `[n]`) over their attendable slots
        (`tokens >= 0`; `at`: the view slot of each grid slot), and record which token each of
        their grid slots holds."""
        size = self.page_size
        grid = (pages.unsqueeze(-1) * size + torch.arange(size, device=pages.device)).flatten()  # [n * size]
        low, high = masked_page_bounds(_on_grid(keys, at[..., grid]), tokens[..., grid] >= 0, size)
        state.low[:, :, pages] = low
        state.high[:, :, pages] = high
        state.bounded[..., grid] = tokens[..., grid]


def _own_slots(view: LayerView) -> bool:
    """Whether `view` is its layer's own slot layout, not a packed copy."""
    own = view.layer.slot_pos
    return own is not None and view.slot_pos.data_ptr() == own.data_ptr()


def _append_only(view: LayerView) -> bool:
    """Whether `view` is its layer's own slot layout and the layer never freed a slot: its slots
    then only grew at the end since the bounds were taken (a slot's validity does not change
    either: padding is fixed, every later query sees every earlier token)."""
    return not view.layer.may_have_free and _own_slots(view)


def _grid_shift(view: LayerView, size: int) -> torch.Tensor:
    """`[B or 1, 1, 1]` long: the empty grid slots before each row's slot 0, so that on its own
    layout the slot after its left padding starts a page (module docstring); 0 on a packed view.
    Read off the newest query's context, with no host sync."""
    if not _own_slots(view):
        return torch.zeros(1, 1, 1, dtype=torch.long, device=view.keys.device)
    pad = view.layer.seen - view.context[:, :, -1:]  # tokens the newest query does not see
    return -pad % size


def _grid_width(slots: int, size: int) -> int:
    """Grid slots, in whole pages, for `slots` view slots shifted right by up to `size - 1`."""
    return math.ceil((slots + size - 1) / size) * size


def _grid(shift: torch.Tensor, slots: int, size: int) -> torch.Tensor:
    """`[B or 1, 1, W]`: the view slot at each grid slot, -1 at none."""
    at = torch.arange(_grid_width(slots, size), device=shift.device) - shift
    return at.masked_fill((at < 0) | (at >= slots), -1)


def _on_grid(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`x` (`[B, Hkv, S, ...]`, by view slot) at the grid slots `at` (`[B or 1, 1, n]`, `_grid`); slot
    0's entry where none: mask those (`at < 0`)."""
    index = at.clamp(min=0).expand(*x.shape[:2], -1)
    return x.gather(2, slot_index(index, x))


def _page_counts(valid: torch.Tensor, size: int) -> torch.Tensor:
    """`[B, Hkv, P]` int32: how many slots of each page `valid` (`[B, Hkv, S]`) allows."""
    pad = -valid.shape[-1] % size
    return torch.nn.functional.pad(valid, (0, pad)).unflatten(-1, (-1, size)).sum(-1, dtype=torch.int32)
