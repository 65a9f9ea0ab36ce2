"""A query that may attend nothing reads zeros on the reference path too: where the learned
selector with a threshold finds every token of a row unwanted at a refresh (its newest too), the
reference session (`atskv.sparse`, `grouped_attention`) used to average the whole slot buffer,
stale slots included, while the fast path (`atskv.generate`) reads nothing."""

from __future__ import annotations

import pytest
import torch

import atskv
from atskv.runtime.reference.sparse import SparseSession
from atskv.selectors.learned import LearnedSelector
from tests.conftest import random_prompt, tiny_model
from tests.test_decode import _random_predictor


@pytest.mark.parametrize("padding", [0, 11])
def test_a_row_whose_every_token_is_unwanted_reads_zeros_as_on_the_fast_path(monkeypatch, tmp_path, padding):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = random_prompt(60, seed=5, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    predictor = _random_predictor(model, tmp_path, [1, 2, 3])

    def selector():  # the predictor's own decision (p > 1/2), refreshed on decode steps 4 and 8
        return LearnedSelector(predictor=predictor, refresh_every=4, threshold=0.0)

    empty_rows, with_slots = 0, 0
    attend_kept = SparseSession.attend_kept

    def checked(session, view, values, keep):
        nonlocal empty_rows, with_slots
        out = attend_kept(session, view, values, keep)  # [B, Tq, Hq, D]
        if view.query.shape[2] == 1:
            empty = ~keep[:, :, -1].any(-1)  # [B, Hkv]
            by_kv_head = out[:, -1].unflatten(1, (empty.shape[1], -1))  # [B, Hkv, G, D]
            assert bool((by_kv_head[empty] == 0).all()), "a row that attends nothing reads zeros"
            assert bool(by_kv_head[~empty].abs().sum(-1).gt(0).all())
            empty_rows += int(empty.sum())
            with_slots += int((~empty).sum())
        return out

    monkeypatch.setattr(SparseSession, "attend_kept", checked)
    with torch.no_grad(), atskv.sparse(model, selector(), 24, dense_layers=1):
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert empty_rows > 0 and with_slots > 0, "some rows attended nothing at a refresh, others did not"
    fast = atskv.generate(model, ids, selector(), 24, attention_mask=mask, max_new_tokens=12, dense_layers=1,
                          prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, reference)
