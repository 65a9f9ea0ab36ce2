"""Quest's page bounds over the slots a query may attend, on the reference path (`atskv.sparse`):
a left-padded row's pad keys stay out of its pages, and a composition's packed view
(`atskv.selectors.hybrid.resident_view`, rows of different lengths) re-bounds the pages whose
slots it re-packed. (That a padded row's pages start at its first real token, as on the fast
path: tests/test_decode.py.)"""

from __future__ import annotations

import torch

import atskv
from atskv.runtime.reference.sparse import SparseSession, SparsityConfig, attach
from atskv.selectors.h2o import H2OSelector
from atskv.selectors.hybrid import HybridSelector
from tests.conftest import left_padded
from tests.test_tiered_quest import Checked


def test_quest_on_a_padded_batch_bounds_only_what_a_query_may_attend():
    model, ids, mask = left_padded("llama", 40, 9, seed=5)
    selector = Checked(page_size=4)
    with torch.no_grad(), atskv.sparse(model, selector, 8, dense_layers=2):
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert selector.checked > 0


def test_a_compositions_packed_rows_of_different_lengths_rebound_their_pages():
    """Padding makes the packed rows differ in length before any eviction: each step a shorter
    row's new token lands inside pages bounded before (over its packed tail)."""
    model, ids, mask = left_padded("llama", 40, 9, seed=5)
    part = Checked(page_size=4)
    session = SparseSession(model, HybridSelector(H2OSelector(), part, residency_budget=64), SparsityConfig(8))
    with torch.no_grad(), attach(model, session):
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert part.checked >= 11 * len(session.managed_layers)


def test_a_plain_run_bounds_only_the_pages_of_new_slots_and_compares_nothing(monkeypatch):
    """Append-only slots (a layer that never freed one): each decode step bounds the new token's
    page and nothing else, and the comparison with the covered slots (a host sync) is skipped."""
    import atskv.selectors.quest as quest

    bounded, plain = [], quest.masked_page_bounds

    def recording(keys, held, size):
        bounded.append(keys.shape[2])
        return plain(keys, held, size)

    monkeypatch.setattr(quest, "masked_page_bounds", recording)
    proven, append_only = [], quest._append_only
    monkeypatch.setattr(quest, "_append_only", lambda view: proven.append(append_only(view)) or True)
    model, ids, mask = left_padded("llama", 40, 9, seed=5)
    with torch.no_grad(), atskv.sparse(model, atskv.make_selector("quest", page_size=4), 8, dense_layers=2):
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    # 41 slots, the padded row's shifted right by 3 onto its page grid: 11 pages
    assert bounded[:2] == [44, 44], "every page at the first decode step, once per managed layer"
    assert len(bounded) == 2 + 6 * 2 and max(bounded[2:]) <= 2 * 4, "then the new slot's page on either row's grid"
    assert len(proven) == 6 * 2 and all(proven)
