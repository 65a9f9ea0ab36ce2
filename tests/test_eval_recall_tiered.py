"""Recall through the two-tier store (`attention_recall(..., tiered=...)`): the probe moves tokens
as `atskv.tiered` does but attends densely, and counts for each query what the tiered run read,
the active tokens it attended plus the parked ones retrieval fetched."""

from __future__ import annotations

import pytest
import torch

from atskv.errors import InputError
from atskv.eval.recall import RecallSums, TieredRecallProbe, attention_recall
from atskv.runtime.reference.sparse import attach
from atskv.runtime.reference.sparsity import LayerPolicy
from atskv.runtime.reference.tiered import tiered_configs
from atskv.selectors import make_selector
from tests.conftest import EVERY_TOKEN, random_prompt, tiny_model
from tests.test_hybrid import predictor_dir as hybrid_predictor_dir

predictor_dir = hybrid_predictor_dir  # the fixture: an exported predictor for the tiny Llama

N_QUERIES = 4
TIGHT = dict(sinks=2, recent=4, refresh_every=2, index="exact")


def by_key(report, name):
    return {(r.budget, r.layer): r for r in report.records if r.selector == name}


def test_with_nothing_moved_a_composition_reads_what_it_reads_under_sparse():
    """Every token resident and retrieval off: the tiered run attends the attention part's pick
    among every token, as `atskv.sparse` does, so the two recalls agree (positions mapped right)."""
    model = tiny_model("llama")
    windows = random_prompt(40, seed=2, batch=2)
    keep_all = dict(policy=LayerPolicy(beta=1e-9, q_min=0.0, q_max=0.0), sinks=2, recent=4, refresh_every=1000,
                    retrieve=0)  # fmt: skip
    hybrid = make_selector("h2o+sparq", residency_budget=EVERY_TOKEN)
    report = attention_recall(model, windows, [hybrid], [6], tiered=[hybrid], tiering=keep_all,
                              n_queries=N_QUERIES, batch_size=2, progress=False)  # fmt: skip
    sparse, tiered = by_key(report, "h2o+sparq"), by_key(report, "tiered:h2o+sparq")
    assert set(sparse) == set(tiered) == {(6, 2), (6, 3)}
    for key in sparse:
        assert tiered[key].recall == pytest.approx(sparse[key].recall, abs=1e-5)
        assert tiered[key].reads == pytest.approx(6.0)
        assert tiered[key].recall < 0.999  # 6 of ~38 tokens: something was missed


def test_retrieval_of_every_parked_token_reads_the_whole_context():
    """A tight GPU tier parks most of the prompt; fetching every parked token back each step makes
    every query read the whole context (recall 1), while with retrieval off it reads only the tier."""
    model = tiny_model("llama")
    windows = random_prompt(48, seed=4, batch=2)
    reports = {
        retrieve: attention_recall(model, windows, [], [16], tiered=["h2o"], tiering={**TIGHT, "retrieve": retrieve},
                                   n_queries=N_QUERIES, batch_size=2, progress=False)  # fmt: skip
        for retrieve in (0, 64)
    }
    off, every = by_key(reports[0], "tiered:h2o"), by_key(reports[64], "tiered:h2o")
    for key in off:
        assert off[key].reads <= 16
        assert off[key].recall < 0.95
        assert every[key].recall == pytest.approx(1.0, abs=1e-5)
        assert every[key].reads > 40  # the whole context: 44 + the decoded tokens


def test_the_probe_decodes_as_the_dense_model():
    """Its attention is dense over its own copy of the context, whatever the tiers hold, so its
    logits are the plain model's (the copy holds every token in position order)."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=5, batch=2)
    selector = make_selector("h2o")
    probe = TieredRecallProbe(model, selector, *tiered_configs(selector, 16, 2, {**TIGHT, "retrieve": 4}),
                              RecallSums("h2o", [16]))  # fmt: skip
    with torch.no_grad():
        expected = model(ids).logits[:, -N_QUERIES:]
        with attach(model, probe):
            cache = probe.new_cache()
            model(ids[:, :-N_QUERIES], past_key_values=cache, use_cache=True)
            got = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(36, 40)]
    assert probe.cache.stats.demoted_tokens > 0, "the tier parked tokens"
    torch.testing.assert_close(torch.cat(got, 1), expected, atol=1e-4, rtol=1e-4)


def test_the_table_shows_what_a_tiered_query_read():
    model = tiny_model("llama")
    report = attention_recall(model, random_prompt(48, seed=6), ["h2o"], [16], tiered=["h2o"],
                              tiering={**TIGHT, "retrieve": 8}, n_queries=N_QUERIES, progress=False)  # fmt: skip
    rows = {line.split("|")[1].strip(): line for line in report.markdown().splitlines()[2:]}
    assert "read)" in rows["tiered:h2o"] and "read)" not in rows["h2o"]


def test_a_gpu_tier_too_small_for_sinks_and_recent_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="cannot hold"):
        attention_recall(model, random_prompt(48), ["h2o"], [8], tiered=["h2o"], tiering={"index": "exact"},
                         n_queries=N_QUERIES, progress=False)  # fmt: skip


def test_a_composition_retrieves_a_third_of_its_attention_budget_unless_told():
    """Its default retrieval: a quarter of what a query reads comes back from the host (one
    selector's default, 1/8 of the prompt, would read past the composition's budget)."""
    hybrid = make_selector("h2o+sparq")
    assert tiered_configs(hybrid, 96, 2, {})[1].retrieve == 32
    assert tiered_configs(hybrid, 0.06, 2, {})[1].retrieve == pytest.approx(0.02)
    assert tiered_configs(hybrid, 96, 2, {"retrieve": 5})[1].retrieve == 5
    assert tiered_configs(make_selector("h2o"), 96, 2, {})[1].retrieve == 0.125
    model = tiny_model("llama")
    report = attention_recall(model, random_prompt(48, seed=7, batch=2), [], [6], tiered=[hybrid], tiering=TIGHT,
                              n_queries=N_QUERIES, batch_size=2, progress=False)  # fmt: skip
    for record in by_key(report, "tiered:h2o+sparq").values():
        assert record.reads == pytest.approx(6 + 2)  # its pick and two parked tokens, every query


def test_a_learned_selector_for_another_model_is_refused_before_any_forward(predictor_dir):
    """Resolved against the model first, as a session does: the mismatch is reported before the
    dense ceiling run, not after it."""
    other = tiny_model("llama")
    other.config.vocab_size += 1  # same geometry, another vocabulary: another config hash
    other.atskv_name = "other-llama"
    forwards = []
    other.register_forward_pre_hook(lambda *args: forwards.append(1))
    learned = make_selector("learned", predictor=predictor_dir)
    with pytest.raises(InputError, match="cannot run on 'other-llama'"):
        attention_recall(other, random_prompt(48), [learned], [16], n_queries=N_QUERIES, progress=False)
    with pytest.raises(InputError, match="cannot run on 'other-llama'"):
        attention_recall(other, random_prompt(48), [], [16], tiered=[learned], n_queries=N_QUERIES, progress=False)
    assert not forwards
