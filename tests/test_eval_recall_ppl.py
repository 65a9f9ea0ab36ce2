"""The recall and perplexity harnesses against direct computations on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from atskv.eval.perplexity import decode_nll, evaluate_perplexity, markdown
from atskv.eval.recall import ORACLE_CEILING, WINDOW_CEILING, attention_recall
from tests.conftest import random_prompt, tiny_model

N_QUERIES = 5
BUDGETS = [8, 16]


@pytest.fixture(scope="module")
def recall_run():
    model = tiny_model("llama")
    windows = random_prompt(48, seed=3, batch=3)
    report = attention_recall(
        model, windows, ["dense", "oracle", "streaming_llm"], BUDGETS, n_queries=N_QUERIES, batch_size=2, progress=False
    )
    return model, windows, report


def _by(report, selector):
    return {(r.budget, r.layer): r for r in report.records if r.selector == selector}


def test_oracle_reaches_the_per_query_ceiling_and_dense_keeps_everything(recall_run):
    _, _, report = recall_run
    oracle, ceiling, dense = _by(report, "oracle"), _by(report, ORACLE_CEILING), _by(report, "dense")
    assert set(oracle) == set(ceiling) == {(b, layer) for b in BUDGETS for layer in (2, 3)}
    for key in oracle:
        assert oracle[key].recall == pytest.approx(ceiling[key].recall, abs=1e-6)
        assert oracle[key].mask_difference == pytest.approx(0.0, abs=1e-6)
        assert dense[key].recall == pytest.approx(1.0, abs=1e-5)
        assert 0 < _by(report, WINDOW_CEILING)[key].recall <= ceiling[key].recall + 1e-6


def test_streaming_llm_recall_equals_direct_computation(recall_run):
    """StreamingLLM keeps 4 sinks and the newest budget-4 tokens: its recall is the dense attention
    mass (eager attention, pooled over each KV group) on exactly those positions."""
    model, windows, report = recall_run
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(windows, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    t_total = windows.shape[1]
    hkv = model.config.num_key_value_heads
    measured = _by(report, "streaming_llm")
    for budget in BUDGETS:
        for layer in (2, 3):
            probs = attentions[layer]  # [B, Hq, T, T]
            pooled = probs.view(probs.shape[0], hkv, -1, t_total, t_total).mean(2)
            total = 0.0
            for t in range(t_total - N_QUERIES, t_total):
                kept = list(range(4)) + list(range(t - (budget - 4) + 1, t + 1))
                total += float(pooled[:, :, t, kept].sum())
            expected = total / (pooled.shape[0] * hkv * N_QUERIES)
            assert measured[(budget, layer)].recall == pytest.approx(expected, abs=1e-5)
            assert measured[(budget, layer)].mask_difference > 0


def test_the_recall_progress_bar_names_the_selectors_budgets_and_step_it_runs(capsys):
    """One tick a forward: the prompt, then each query, of the shared forward, then of each tiered probe."""
    attention_recall(tiny_model("llama"), random_prompt(24), ["snapkv", "h2o"], [8, 16], tiered=["h2o"],
                     tiering={"sinks": 2, "recent": 2, "refresh_every": 2}, n_queries=4)  # fmt: skip
    bar = capsys.readouterr().err
    assert "ceilings, snapkv, h2o at budgets 8, 16; window batch 1/1, prompt" in bar
    assert "h2o at budgets 8, 16; window batch 1/1, query 4/4" in bar
    assert "tiered:h2o at budget 8; window batch 1/1, query 1/4" in bar and "tiered:h2o at budget 16;" in bar
    assert "15/15" in bar


def test_recall_refuses_budgets_not_below_the_prompt():
    with pytest.raises(ValueError, match="budgets must be token counts"):
        attention_recall(tiny_model("llama"), random_prompt(20), ["oracle"], [16], n_queries=5, progress=False)


def test_report_writes_table_json_and_plot(recall_run, tmp_path):
    report = recall_run[2]
    report.write(tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "| oracle |" in table and ORACLE_CEILING in table and "k=16" in table
    assert (tmp_path / "recall.png").stat().st_size > 1000
    assert '"mask_difference"' in (tmp_path / "recall.json").read_text()


def test_decode_nll_equals_one_teacher_forced_forward():
    model = tiny_model("qwen2")
    windows = random_prompt(30, seed=1, batch=2)
    with torch.no_grad():
        logits = model(windows).logits[:, -9:-1]
        expected = F.cross_entropy(logits.flatten(0, 1), windows[:, -8:].flatten(), reduction="sum")
        assert float(decode_nll(model, windows, 8)) == pytest.approx(float(expected), rel=1e-5)


def test_perplexity_dense_row_and_keep_all_budget():
    model = tiny_model("llama")
    windows = {24: random_prompt(24, seed=2, batch=2), 32: random_prompt(32, seed=4, batch=2)}
    # 0.999 of a context under 1000 tokens rounds up to all of it (1.0 is no budget: int tokens or a fraction < 1)
    records = evaluate_perplexity(model, windows, ["oracle", "streaming_llm"], [0.999, 6], n_eval=8, progress=False)
    ppl = {(r.label, r.length): r.perplexity for r in records}
    for length in windows:
        assert ppl[("oracle@0.999", length)] == pytest.approx(ppl[("dense", length)], rel=1e-5)
        assert ppl[("streaming_llm@6", length)] != pytest.approx(ppl[("dense", length)], rel=1e-6)
        assert all(math.isfinite(v) for v in ppl.values())
    assert markdown(records).splitlines()[2].startswith("| dense |")


def test_perplexity_refuses_a_budget_that_keeps_the_whole_prompt():
    with pytest.raises(ValueError, match="keeps the whole"):
        evaluate_perplexity(tiny_model("llama"), {24: random_prompt(24)}, ["h2o"], [16], n_eval=8, progress=False)
