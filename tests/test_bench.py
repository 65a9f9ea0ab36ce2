"""The decode-attention benchmark runs every selector's real path and reports honest ratios."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.eval.bench import SDPA, Shape, bench_decode_attention, fast_step, hook_step, markdown


def test_bench_times_dense_and_each_selector_in_one_run():
    records = bench_decode_attention(
        ["oracle", "snapkv", "hook:quest"], batch_sizes=[1, 2], contexts=[64, 128], budget_fraction=0.25,
        geometry="smollm2-135m", dtype=torch.float32, device="cpu", replays=2, repeat=2, progress=False,
    )
    assert len(records) == 2 * 2 * 4
    dense = {(r.batch, r.context): r.milliseconds for r in records if r.selector == SDPA}
    for r in records:
        assert r.milliseconds > 0
        assert r.budget == int(0.25 * r.context)
        assert r.speedup == pytest.approx(dense[(r.batch, r.context)] / r.milliseconds)
    table = markdown(records)
    assert "B=2, 0.125K" in table and "| oracle |" in table


@pytest.mark.parametrize(("name", "layers"), [("oracle", 1), ("snapkv", 1), ("learned", 1), ("snapkv", 3)])
def test_fast_step_holds_what_the_fast_path_holds(name, layers, tmp_path):
    """After the session's own prefill, query-aware selectors keep every token reachable and evicting
    ones hold only their budget, step after step, in every layer of the step, as `atskv.generate` would."""
    shape = Shape(1, 64, (4, 2, 16), torch.float32, torch.device("cpu"))
    step = fast_step(name, shape, budget=0.25, room=8, folder=tmp_path, layers=layers)
    assert len(step.layers) == layers
    for taken in range(1, 4):
        out = step()
        assert out.shape == (1, 1, 4, 16) and torch.isfinite(out).all()
        for layer in step.layers:
            held = int((layer.slot_pos >= 0).sum(-1).max())
            assert held == (64 + taken if name == "oracle" else math.ceil(0.25 * (64 + taken)))  # of the context


def test_a_step_of_several_layers_steps_each_and_reports_per_layer():
    records = bench_decode_attention(
        ["snapkv"], batch_sizes=[1], contexts=[64], budget_fraction=0.25, geometry="smollm2-135m",
        dtype=torch.float32, device="cpu", replays=1, repeat=1, progress=False, layers=3,
    )
    assert [r.layers for r in records] == [3, 3]
    assert "layers per timed step" in markdown(records) and "B=1 0.0625K: 3" in markdown(records)


def test_hook_step_attends_over_the_budget_it_should():
    shape = Shape(1, 64, (4, 2, 16), torch.float32, torch.device("cpu"))
    step = hook_step("snapkv", shape, budget=16)
    assert step().shape == (1, 1, 4, 16)
    assert int(step.layers[0].occupied.sum(-1).max()) == 16


def test_bench_refuses_unknown_geometry_and_bad_budget():
    with pytest.raises(ValueError, match="unknown geometry"):
        bench_decode_attention(["oracle"], geometry="gpt5", device="cpu")
    with pytest.raises(ValueError, match="budget_fraction"):
        bench_decode_attention(["oracle"], budget_fraction=0, device="cpu")
    with pytest.raises(ValueError, match="layers must be at least 1"):
        bench_decode_attention(["oracle"], device="cpu", layers=0)


def test_bench_fetch_refuses_bad_input_and_a_machine_without_cuda(capsys, monkeypatch):
    from tests.conftest import run_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args, message in [
        (["--geometry", "gpt5"], "unknown geometry 'gpt5'"),
        (["--fetched", "[0]"], "fetched counts >= 1"),
        ([], "there is none here"),
    ]:
        assert run_cli(["bench", "fetch", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


@pytest.mark.gpu
def test_bench_fetch_times_the_gather_and_the_copy_of_the_same_bytes(tmp_path):
    from atskv.eval import host_fetch

    records = host_fetch.measure(4096, [16, 100, 10**6], kv_heads=2, head_dim=64, repeats=2)
    assert [r.tokens for r in records] == [16, 96, 4096]  # whole pages, at most the store
    assert all(r.bytes == 2 * 2 * r.tokens * 64 * 2 and r.gather_us > 0 and r.copy_us > 0 for r in records)
    table = host_fetch.write(records, tmp_path, dict(gpu="g", kv_heads=2, head_dim=64, stored_tokens=4096))
    assert "| 4096 |" in table.read_text() and (tmp_path / "fetch.json").exists()
