"""The recall harness's shared forward (`SharedForward`): every (selector, budget) probe judged on
one dense forward per window batch, and a selector the budget leaves alone measured at every
budget by one probe, give the numbers each probe gave on a forward of its own."""

from __future__ import annotations

import pytest
import torch

from atskv.eval.recall import ORACLE_CEILING, WINDOW_CEILING, RecallProbe, SharedForward, attention_recall, budget_free
from atskv.models import model_geometry
from atskv.models.cache_names import with_cache
from atskv.runtime.reference.sparse import SparsityConfig, attach
from atskv.selectors import make_selector
from atskv.selectors.kascade import KascadeProfile, KascadeSelector
from atskv.slot_cache import kv_bytes
from tests.conftest import random_prompt, tiny_model
from tests.test_hybrid import predictor_dir as hybrid_predictor_dir

predictor_dir = hybrid_predictor_dir  # the fixture: an exported predictor for the tiny Llama

N_QUERIES = 4
BUDGETS = [4, 8, 16]
BASELINES = ["dense", "oracle", "quest", "sparq", "sparcas", "h2o", "snapkv", "streaming_llm"]


def kascade_for(model) -> KascadeSelector:
    """Kascade on the tiny Llama's managed layers 2 and 3: 2 an anchor, 3 reusing it, heads swapped."""
    profile = KascadeProfile(model="tiny-llama", geometry=model_geometry(model.config), managed_layers=[2, 3],
                             anchors=[2], head_map={3: [1, 0]}, similarity=[[1.0, 1.0], [1.0, 1.0]],
                             importance=[1.0, 1.0], topk=8, queries=8, dev_set="hand-made")  # fmt: skip
    return KascadeSelector(profile)


def every_selector(model, predictor):
    learned = {"predictor": predictor, "refresh_every": 2}
    return [
        *(make_selector(name) for name in BASELINES),
        make_selector("spark", base="h2o"),  # needs the attention, on keys of its own after the prompt
        kascade_for(model),  # carries its anchor layer's choice to the next layer
        make_selector("learned", **learned),  # carries the previous layer's attention to the next
        make_selector("learned", **learned, window_share=0.5),
        make_selector("h2o+sparq"),
        make_selector("learned+sparq", learned=learned),
    ]


def one_forward_per_probe(model, windows, selectors, budgets, batch_size) -> dict:
    """The harness before the shared forward: each probe, the ceilings' too, attached alone for a
    forward of its own per window batch. `{(selector, budget, layer): (mass, difference, n, reads)}`."""
    context = windows.shape[1] - N_QUERIES
    probes = [RecallProbe(model, make_selector("dense"), SparsityConfig(budgets[0]), budgets)]
    probes += [RecallProbe(model, s, SparsityConfig(b)) for s in selectors for b in budgets]
    sums = {}
    for i, probe in enumerate(probes):
        with attach(model, probe), torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size]
                given = with_cache(model, probe.new_cache())
                model(batch[:, :context], **given, use_cache=True)
                for t in range(context, batch.shape[1]):
                    model(batch[:, t : t + 1], **given, use_cache=True)
                probe.recorder.close_window(N_QUERIES)
        sums.update({key: tuple(acc) for key, acc in probe.recorder.sums.items() if i or key[0] != "dense"})
    return sums


def test_the_shared_forward_gives_each_probe_the_numbers_of_its_own_forward(predictor_dir):
    """Every selector kind (evicting, query-aware, needing the attention or the hidden states,
    carrying state between layers, compositions), three budgets, two window batches (one short):
    the same recall, mask difference and reads, bit for bit, and the same ceilings."""
    model = tiny_model("llama")
    windows = random_prompt(40, seed=11, batch=3)
    selectors = every_selector(model, predictor_dir)
    expected = one_forward_per_probe(model, windows, selectors, BUDGETS, batch_size=2)
    report = attention_recall(model, windows, every_selector(model, predictor_dir), BUDGETS, n_queries=N_QUERIES,
                              batch_size=2, progress=False)  # fmt: skip
    got = {(r.selector, r.budget, r.layer): r for r in report.records}
    assert len(got) == len(expected) > len(BUDGETS) * 2 * len(selectors)  # the ceilings too
    names = {s.name for s in selectors} | {ORACLE_CEILING, WINDOW_CEILING}
    assert {key[0] for key in got} == names
    for key, (mass, difference, n, reads) in expected.items():
        record = got[key]
        assert record.queries == n
        assert record.recall == mass / n, key
        if not key[0].startswith("ceiling"):
            assert (record.mask_difference, record.reads) == (difference / n, reads / n), key


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_the_shared_forward_equals_one_forward_per_probe_on_other_families(family):
    """Gemma 3's sliding-window layers (unmanaged, beside the managed global one) and one KV head."""
    model = tiny_model(family)
    windows = random_prompt(40, seed=12, batch=2)
    selectors = [make_selector(name) for name in BASELINES]
    expected = one_forward_per_probe(model, windows, selectors, BUDGETS, batch_size=2)
    report = attention_recall(model, windows, [make_selector(name) for name in BASELINES], BUDGETS,
                              n_queries=N_QUERIES, progress=False)  # fmt: skip
    got = {(r.selector, r.budget, r.layer): r.recall for r in report.records}
    assert got == {key: mass / n for key, (mass, _, n, _) in expected.items()}


def test_the_model_runs_once_per_window_batch_whatever_the_probes():
    model = tiny_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    attention_recall(model, random_prompt(40, seed=13, batch=3), BASELINES, BUDGETS, n_queries=N_QUERIES,
                     batch_size=2, progress=False)  # fmt: skip
    assert len(calls) == 2 * (1 + N_QUERIES)  # two window batches: the prompt, then each query


def test_the_probes_hold_selector_state_and_the_shared_cache_the_kv():
    """The KV is held once however many probes judge the forward: their own caches hold slot
    positions and selector state (H2O's accumulated mass, SnapKV's votes) but no keys or values."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=14, batch=2)
    probes = [RecallProbe(model, make_selector(name), SparsityConfig(b)) for name in ("h2o", "snapkv") for b in BUDGETS]
    shared = SharedForward(model, probes, dense_layers=2)
    with attach(model, shared), torch.no_grad():
        cache = shared.new_cache()
        model(ids, **with_cache(model, cache), use_cache=True)
    assert kv_bytes(cache) > 0
    for probe in probes:
        assert kv_bytes(probe.cache) == 0
        layer = probe.cache.layers[2]
        assert layer.seen == 40 and (layer.slot_pos[..., : layer.length] == torch.arange(40)).all()
        state = layer.slot_tensor(probe.selector.name)
        assert state.shape == (2, 2, 40) and state.isfinite().any()


def test_one_probe_measures_every_budget_only_where_the_budget_leaves_the_state_alone():
    model = tiny_model("llama")
    assert [budget_free(make_selector(name)) for name in BASELINES] == [True] * 5 + [False] * 3
    assert not budget_free(make_selector("h2o+sparq")) and budget_free(make_selector("spark", base="sparq"))
    RecallProbe(model, make_selector("quest"), SparsityConfig(4), budgets=BUDGETS)
    with pytest.raises(ValueError, match="one probe per budget"):
        RecallProbe(model, make_selector("snapkv"), SparsityConfig(4), budgets=BUDGETS)


def test_recall_scores_a_prompt_from_every_sth_query_as_the_reference_hook_does(monkeypatch):
    """H2O with `prompt_sample` 8 under the recall harness observes, layer by layer, the prompt mass
    the reference hook gives it on the same prompt (every 8th query counted back from the last,
    times 8: not the shared forward's mass from every query, which differs)."""
    from atskv.runtime.reference.sparse import sparse

    model = tiny_model("llama")
    windows = random_prompt(40, seed=14, batch=1)
    cls, seen = type(make_selector("h2o")), []
    plain = cls.observe

    def recording(self, view, mass):
        if view.query.shape[2] > 1:  # the prompt's
            seen.append((view.layer_idx, mass[..., : view.query.shape[2]].clone()))
        return plain(self, view, mass)

    monkeypatch.setattr(cls, "observe", recording)

    def prompt_masses(sample: int) -> dict:
        seen.clear()
        attention_recall(model, windows, [make_selector("h2o", prompt_sample=sample)], [8], n_queries=N_QUERIES,
                         progress=False)  # fmt: skip
        return dict(seen)

    every, sampled = prompt_masses(1), prompt_masses(8)
    seen.clear()
    with torch.no_grad(), sparse(model, make_selector("h2o", prompt_sample=8), 8):
        model(windows[:, : windows.shape[1] - N_QUERIES])
    reference = dict(seen)
    assert sampled.keys() == reference.keys() == every.keys() and reference
    for layer, mass in reference.items():
        torch.testing.assert_close(sampled[layer], mass)
        assert not torch.allclose(every[layer], mass)
