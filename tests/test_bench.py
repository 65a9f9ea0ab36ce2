"""The decode-attention benchmark runs every selector's real path and reports honest ratios."""

from __future__ import annotations

import pytest
import torch

from atskv.eval.bench import DENSE, bench_decode_attention, markdown, selector_step


def test_bench_times_dense_and_each_selector_in_one_run():
    records = bench_decode_attention(
        ["oracle", "snapkv"], batch_sizes=[1, 2], contexts=[64, 128], budget_fraction=0.25,
        geometry="smollm2-135m", dtype=torch.float32, device="cpu", steps=2, warmup=1, progress=False,
    )
    assert len(records) == 2 * 2 * 3
    dense = {(r.batch, r.context): r.milliseconds for r in records if r.selector == DENSE}
    for r in records:
        assert r.milliseconds > 0
        assert r.budget == int(0.25 * r.context)
        assert r.speedup == pytest.approx(dense[(r.batch, r.context)] / r.milliseconds)
    table = markdown(records)
    assert "B=2, 0.125K" in table and "| oracle |" in table


@pytest.mark.parametrize("name", ["oracle", "snapkv"])
def testselector_step_attends_over_the_budget_it_should(name):
    """Query-aware selectors keep the whole context reachable; evicting ones hold only the budget."""
    step = selector_step(name, batch=1, context=64, budget=16, geometry=(4, 2, 16), dtype=torch.float32, device="cpu")
    out = step()
    assert out.shape == (1, 1, 4, 16) and torch.isfinite(out).all()
    occupied = int(step.layer.occupied.sum(-1).max())
    assert occupied == (65 if name == "oracle" else 16)


def test_bench_refuses_unknown_geometry_and_bad_budget():
    with pytest.raises(ValueError, match="unknown geometry"):
        bench_decode_attention(["oracle"], geometry="gpt5", device="cpu")
    with pytest.raises(ValueError, match="budget_fraction"):
        bench_decode_attention(["oracle"], budget_fraction=0, device="cpu")
