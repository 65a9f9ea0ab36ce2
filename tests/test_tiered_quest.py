"""Quest's page bounds when slots below the covered count change: under `atskv.tiered` demotion
frees slots and promotion and new tokens refill them, so bounds cached by slot go stale unless
the pages whose slots changed are bounded again. Every scoring must equal Quest's scores from
bounds built from scratch on the same view and page grid, over the slots it may attend only (pad
keys of a left-padded row and free slots never enter a bound)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import atskv
from atskv.kernels.quest import masked_page_bounds, quest_page_scores
from atskv.selectors.base import LayerView, select_top_budget
from atskv.selectors.quest import QuestSelector, _grid_shift, _page_counts
from tests.conftest import random_prompt, tiny_model

# moves on a 64-token prompt: the GPU tier holds 24 per layer and KV head, 8 candidates come back a step
TIGHT = dict(sinks=2, recent=4, refresh_every=4, retrieve=8)


def rows_on_the_grid(view: LayerView, size: int, held: torch.Tensor):
    """Per row: its keys `[1, Hkv, shift + S, D]` and `held` slots (`[B, Hkv, S]`) after the `shift`
    empty slots that put it on Quest's page grid (`_grid_shift`), and the shift."""
    shifts = _grid_shift(view, size).flatten().expand(view.keys.shape[0]).tolist()
    for b, shift in enumerate(shifts):
        keys = torch.nn.functional.pad(view.keys[b : b + 1], (0, 0, shift, 0))
        yield keys, torch.nn.functional.pad(held[b : b + 1], (shift, 0)), shift


def from_scratch(view: LayerView, size: int) -> torch.Tensor:
    """Quest's token scores `[B, Hkv, Tq, S]` from bounds built anew, row by row, over the slots
    some query of `view` may attend."""
    rows = []
    for b, (keys, held, shift) in enumerate(rows_on_the_grid(view, size, view.valid.any(2))):
        low, high = masked_page_bounds(keys, held, size)
        pages = quest_page_scores(view.query[b : b + 1], low, high)
        rows.append(pages.repeat_interleave(size, dim=-1)[..., shift : shift + view.keys.shape[2]])
    return torch.cat(rows)


@dataclass
class Checked(QuestSelector):
    """Quest, asserting at every scoring that its incremental bounds give the scores (and the
    pick) of bounds built from scratch on the same view."""

    checked: int = 0
    after_moves: int = 0

    def scores(self, view: LayerView) -> torch.Tensor:
        scores = super().scores(view).expand_as(view.valid)
        expected = from_scratch(view, self.page_size).expand_as(view.valid)
        valid = view.valid
        torch.testing.assert_close(scores[valid], expected[valid], rtol=0, atol=0)
        budget = max(1, int(valid[:, :, -1].sum(-1).min()) // 2)  # a pick that has to choose
        picks = [select_top_budget(s, valid, budget, view.slot_pos, view.context) for s in (scores, expected)]
        assert torch.equal(*picks)
        self.checked += 1
        self.after_moves += bool(view.layer.may_have_free)
        return scores

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's decode pick ranks pages by the same bounds: those of every page that holds
        a slot the query may attend equal bounds built from scratch."""
        low, high, _ = self._bounds(view)
        for b, (keys, held, _) in enumerate(rows_on_the_grid(view, self.page_size, view.valid[:, :, -1])):
            expected = masked_page_bounds(keys, held, self.page_size)
            used = _page_counts(held, self.page_size) > 0  # [1, Hkv, pages of the row]
            for bound, truth in zip((low[b : b + 1], high[b : b + 1]), expected):
                assert torch.equal(bound[:, :, : used.shape[-1]][used], truth[used])
        self.checked += 1
        return super().decode_indices(view)


@pytest.mark.parametrize("padding", [0, 9])
@pytest.mark.parametrize("page_size", [4, 16])
def test_quest_under_the_tiered_store_ranks_on_bounds_of_the_active_tokens(page_size, padding):
    model = tiny_model("llama")
    ids = random_prompt(64, seed=3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    selector = Checked(page_size=page_size)
    with torch.no_grad(), atskv.tiered(model, selector, budget=24, **TIGHT) as session:
        model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    stats = session.cache.stats
    assert stats.demoted_tokens > 0 and stats.promoted_tokens > 0, "slots below the covered count were refilled"
    assert selector.after_moves >= 5 * len(session.managed_layers)


def test_bounds_follow_a_slot_refilled_below_the_covered_count():
    """The unit case: a slot freed and refilled with another token (as demotion, then promotion
    or a new token, do) between two scorings of a layer."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=1)
    selector = Checked(page_size=4)
    with torch.no_grad(), atskv.tiered(model, selector, budget=24, **{**TIGHT, "retrieve": 0}) as session:
        cache = session.new_cache()
        model(ids[:, :32], past_key_values=cache)
        for t in range(32, 40):
            model(ids[:, t : t + 1], past_key_values=cache)
    assert session.cache.stats.demoted_tokens > 0
    assert selector.after_moves > 0
