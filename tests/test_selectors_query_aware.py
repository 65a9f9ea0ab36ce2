"""Quest, SparQ and SparCas inside `atskv.sparse` on tiny models, each against a direct computation
from the query and keys the selector was shown (loops over query heads, written out here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import atskv
from atskv.kernels.quest import page_bounds, quest_page_scores
from atskv.selectors.base import LayerView, Selector, select_top_budget
from tests.conftest import random_prompt, tiny_model

PROMPT = 38
BUDGET = 12


@dataclass
class Recorder(Selector):
    """Passes `inner`'s scores through and keeps a copy of what it saw and returned."""

    inner: Selector
    calls: list[dict] = field(default_factory=list)
    prompts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> last prompt query
    query_aware = True

    def prefill(self, view: LayerView) -> None:
        self.prompts[view.layer_idx] = view.query[:, :, -1:].clone()
        self.inner.prefill(view)

    def scores(self, view: LayerView):
        out = self.inner.scores(view)
        state = view.layer.state.get(self.inner.name)
        self.calls.append(
            dict(
                layer=view.layer_idx,
                query=view.query.clone(),
                keys=view.keys.clone(),
                valid=view.valid.clone(),
                scaling=view.scaling,
                slot_pos=view.slot_pos.clone(),
                context=view.context.clone(),
                scores=out.clone(),
                dims=state.dims.clone() if hasattr(state, "dims") else None,
            )
        )
        return out


def run(family, selector, *, steps=9, sparse_prefill=False):
    """Prompt + `steps` greedy decode steps with every global layer managed; the recorder."""
    model = tiny_model(family)
    recorder = Recorder(selector)
    ids = random_prompt(PROMPT, seed=7)
    length = dict(max_new_tokens=steps + 1, min_new_tokens=steps + 1)
    with atskv.sparse(model, recorder, budget=BUDGET, dense_layers=0, sparse_prefill=sparse_prefill):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **length)
    assert recorder.calls, "the selector was never asked"
    return recorder


def masked_softmax(logits, valid):
    return logits.masked_fill(~valid, -math.inf).softmax(-1)


def quest_reference(call, page_size):
    query, keys = call["query"], call["keys"]
    b, hq, tq, _ = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    out = torch.empty(b, hkv, tq, s)
    for start in range(0, s, page_size):
        page = keys[:, :, start : start + page_size]
        lo, hi = page.amin(2), page.amax(2)  # [B, Hkv, D]
        for h in range(hkv):
            q = query[:, h * g : (h + 1) * g]  # the group's query heads, [B, G, Tq, D]
            bound = torch.maximum(q * lo[:, h, None, None], q * hi[:, h, None, None]).sum(-1)  # [B, G, Tq]
            out[:, h, :, start : start + page_size] = bound.amax(1).unsqueeze(-1)
    return out


def sparq_reference(call, rank):
    query, keys, valid = call["query"], call["keys"], call["valid"]
    b, hq, tq, d = query.shape
    g = hq // keys.shape[1]
    out = torch.zeros(valid.shape)
    for i in range(b):
        for j in range(hq):
            for t in range(tq):
                q = query[i, j, t]
                dims = q.abs().topk(rank).indices
                approx = keys[i, j // g][:, dims] @ q[dims]
                temperature = math.sqrt(d * float(q[dims].abs().sum() / q.abs().sum()))  # scaling is 1/sqrt(d) here
                out[i, j // g, t] += masked_softmax(approx / temperature, valid[i, j // g, t])
    return out


def sparcas_reference(call, dims):
    query, keys, valid = call["query"], call["keys"], call["valid"]
    b, hq, tq, _ = query.shape
    g = hq // keys.shape[1]
    out = torch.zeros(valid.shape)
    for i in range(b):
        for j in range(hq):
            sel = dims[i, j // g]
            logits = query[i, j][:, sel] @ keys[i, j // g][:, sel].T * call["scaling"]  # [Tq, S]
            out[i, j // g] += masked_softmax(logits, valid[i, j // g])
    return out


def sparcas_dims(query, num_kv_heads, n_dims):
    b, hq, _, d = query.shape
    return query[:, :, -1].abs().view(b, num_kv_heads, hq // num_kv_heads, d).sum(2).topk(n_dims, -1).indices


def assert_scores_match(call, expected):
    """Same scores on every slot the query may see, hence the same keep-mask."""
    valid = call["valid"]
    torch.testing.assert_close(call["scores"].expand_as(valid)[valid], expected[valid], rtol=1e-4, atol=1e-6)
    keep = [select_top_budget(s, valid, BUDGET, call["slot_pos"], call["context"]) for s in (call["scores"], expected)]
    assert torch.equal(*keep)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("sparse_prefill", [False, True])
def test_quest_scores_are_page_bounds_and_pick_whole_pages(family, sparse_prefill):
    page = 4
    rec = run(family, atskv.make_selector("quest", page_size=page), sparse_prefill=sparse_prefill)
    whole_page_checks = 0
    for call in rec.calls:
        assert_scores_match(call, quest_reference(call, page))
        slots = call["keys"].shape[2]
        if call["query"].shape[2] == 1 and slots % page == 0:  # the budget buys 3 full pages
            keep = select_top_budget(call["scores"], call["valid"], BUDGET, call["slot_pos"], call["context"])
            per_page = keep[:, :, 0].view(*keep.shape[:2], slots // page, page).sum(-1)
            assert set(per_page.unique().tolist()) == {0, page}
            assert bool((per_page.sum(-1) == BUDGET).all())
            whole_page_checks += 1
    assert whole_page_checks >= 2


def test_quest_incremental_bounds_equal_bounds_rebuilt_from_scratch():
    rec = run("llama", atskv.make_selector("quest", page_size=4))
    for call in rec.calls:
        low, high = page_bounds(call["keys"], 4)
        pages = quest_page_scores(call["query"], low, high)
        assert_scores_match(call, pages.repeat_interleave(4, dim=-1)[..., : call["keys"].shape[2]])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("sparse_prefill", [False, True])
def test_sparq_matches_direct_computation(family, sparse_prefill):
    rec = run(family, atskv.make_selector("sparq", rank_fraction=0.25), steps=4, sparse_prefill=sparse_prefill)
    for call in rec.calls:
        assert_scores_match(call, sparq_reference(call, rank=4))  # head dim 16


def test_sparq_triton_path_matches_direct_computation(monkeypatch):
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    rec = run("llama", atskv.make_selector("sparq", rank_fraction=0.25), steps=3)
    for call in rec.calls:
        assert_scores_match(call, sparq_reference(call, rank=4))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sparcas_refreshes_dims_every_u_steps(family):
    """Dimensions from the prompt's last query until decode step U, then from the query of steps
    U and 2U; the partial scores always use the current ones."""
    every, n_dims = 4, 4
    rec = run(family, atskv.make_selector("sparcas", dims=n_dims, refresh_every=every))
    hkv = rec.calls[0]["keys"].shape[1]
    steps, dims = {}, {}
    for call in rec.calls:
        layer = call["layer"]
        steps[layer] = step = steps.get(layer, 0) + 1
        if layer not in dims:
            dims[layer] = sparcas_dims(rec.prompts[layer], hkv, n_dims)
        if step % every == 0:
            stale, dims[layer] = dims[layer], sparcas_dims(call["query"], hkv, n_dims)
            assert not torch.equal(stale.sort(-1).values, dims[layer].sort(-1).values), "the test needs new dims"
            stale_scores = sparcas_reference(call, stale)
            assert not torch.allclose(stale_scores, call["scores"].expand_as(stale_scores), atol=1e-4)
        assert torch.equal(call["dims"], dims[layer].sort(-1).values)
        assert_scores_match(call, sparcas_reference(call, dims[layer]))
    assert min(steps.values()) >= 2 * every


def test_sparcas_sparse_prefill_takes_dims_from_last_prompt_query():
    rec = run("llama", atskv.make_selector("sparcas", dims=4, refresh_every=64), steps=3, sparse_prefill=True)
    prefill_calls = [c for c in rec.calls if c["query"].shape[2] == PROMPT]
    assert prefill_calls
    for call in prefill_calls:
        dims = sparcas_dims(call["query"], call["keys"].shape[1], 4)
        assert_scores_match(call, sparcas_reference(call, dims))


@pytest.mark.parametrize("budget", [32, 40, 0.3])
def test_quest_page_ranking_on_the_index_path_matches_the_token_mask_path(budget):
    """Quest's decode_indices (top pages, listed newest first) keeps exactly the slots the mask
    path keeps from its per-token scores (top budget, ties towards recent tokens), also with left
    padding and a budget that cuts a page."""
    from atskv.selectors.base import select_top_budget
    from atskv.selectors.quest import QuestSelector

    checked = []

    class Checked(QuestSelector):
        def decode_indices(self, view):
            indices, lengths = super().decode_indices(view)
            keep = select_top_budget(self.scores(view), view.valid, view.budget, view.slot_pos, view.context)[:, :, -1]
            counted = (torch.arange(indices.shape[-1]) < lengths.unsqueeze(-1)).int()
            chosen = torch.zeros(keep.shape, dtype=torch.int).scatter_add_(-1, indices, counted)
            assert int(chosen.max()) <= 1, "a slot was counted twice"
            chosen = chosen > 0
            assert torch.equal(chosen, keep)
            checked.append(view.layer_idx)
            return indices, lengths

    model = tiny_model("llama")
    ids = random_prompt(70, seed=9, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding in the second row
    with atskv.sparse(model, Checked(), budget=budget, dense_layers=0), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert len(checked) == 4 * model.config.num_hidden_layers


def test_sparq_breaks_equal_query_magnitudes_towards_the_lower_dimension():
    """The rank-r dimensions of SparQ (and of its fused decode kernel) do not depend on how a
    device's topk orders ties: equal |q| go to the lower dimension."""
    from atskv.kernels.sparq_decode import top_channels

    query = torch.tensor([[0.5, -2.0, 1.0, -1.0, 2.0, 1.0]])
    dims, share = top_channels(query, 3)
    assert dims.tolist() == [[1, 4, 2]]
    assert share.item() == pytest.approx(5.0 / 7.5)


def _shuffled_view(recent_queries: int, seed: int = 0) -> LayerView:
    """A random layer of 40 slots (two KV heads of groups of 2, head dim 16) holding positions 0..35
    shuffled over the slots per row, 4 of them free, seen by the newest `recent_queries` queries."""
    from atskv.slot_cache import SlotLayer

    g = torch.Generator().manual_seed(seed)
    b, hkv, s, tq = 2, 2, 40, recent_queries
    slot_pos = torch.stack([torch.randperm(s, generator=g) for _ in range(b * hkv)]).view(b, hkv, s)
    slot_pos = slot_pos.masked_fill(slot_pos >= 36, -1)
    query_pos = torch.arange(36 - tq, 36)
    valid = (slot_pos >= 0).unsqueeze(2) & (slot_pos.unsqueeze(2) <= query_pos.view(1, 1, tq, 1))
    layer = SlotLayer()
    layer.seen = 36
    return LayerView(0, torch.randn(b, 2 * hkv, tq, 16, generator=g), torch.randn(b, hkv, s, 16, generator=g), valid,
                     slot_pos, (query_pos + 1).view(1, 1, tq), 16**-0.5, BUDGET, layer)  # fmt: skip


@pytest.mark.parametrize("recent", [5, 20])
def test_sparq_recent_positions_are_chosen_within_the_budget(recent):
    """`recent`: each query's last positions (up to its own) are kept whatever SparQ's scores say,
    and the budget's count stays exact; past the budget (20 > 12) the newest. The mask path over
    three queries and the index path's decode step."""
    selector = atskv.make_selector("sparq", recent=recent)
    view = _shuffled_view(3)
    keep = select_top_budget(selector.scores(view), view.valid, BUDGET, view.slot_pos, view.context)
    plain = select_top_budget(atskv.make_selector("sparq").scores(view), view.valid, BUDGET, view.slot_pos,
                              view.context)  # fmt: skip
    pos = view.slot_pos.unsqueeze(2).expand_as(keep)
    newest = view.context.unsqueeze(-1) - 1  # [1, 1, Tq, 1]: each query's own position
    window = view.valid & (pos > newest - min(recent, BUDGET))
    assert torch.equal(keep.sum(-1), torch.full(keep.shape[:3], BUDGET)) and not torch.equal(keep, plain)
    assert bool((keep | ~window).all())
    decode = _shuffled_view(1)
    indices, lengths = selector.decode_indices(decode)
    assert torch.equal(lengths, torch.full((2, 2), BUDGET))
    for b in range(2):
        for h in range(2):
            picked = decode.slot_pos[b, h, indices[b, h, :BUDGET]]
            assert set(range(35, 35 - min(recent, BUDGET), -1)) <= set(picked.tolist())


def test_sparq_recent_is_a_selector_option():
    """`recent` reaches SparQ by name, through the command line's options and inside a composition."""
    from atskv.selectors import selector_options, selectors_for_model

    assert atskv.make_selector("sparq", recent=32).recent == 32
    assert atskv.make_selector("sparq").recent == 0  # the paper's SparQ
    options = selector_options(["sparq", "h2o+sparq"], {"sparq": {"recent": 32}, "h2o+sparq": {"sparq": {"recent": 8}}})
    alone, hybrid = selectors_for_model(["sparq", "h2o+sparq"], "tiny", options)
    assert alone.recent == 32 and hybrid.attention.recent == 8
