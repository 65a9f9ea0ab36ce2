"""The fast path's host tier (`atskv/runtime/fast/host_pages.py`, `atskv.generate(..., tier=...)`): what it
fetches against a brute-force reference, residency bookkeeping, and generation that reads every
parked page equal to dense generation."""

from __future__ import annotations

import pytest
import torch

import atskv
from atskv.kernels.quest import quest_page_scores_reference
from atskv.runtime.fast.host_pages import (
    HostPages,
    HostRetrieval,
    device_alias,
    pinned_peak,
    pinned_zeros,
    reset_peak_pinned,
)  # fmt: skip
from tests.conftest import random_prompt, tiny_model

B, H, D, PAGE = 2, 2, 8, 4


def _filled(count: int = 22, tokens: int = 40, read: int = 3) -> tuple[HostPages, torch.Tensor, torch.Tensor]:
    """Rows parked with `count` prompt tokens each, row 1 left-padded by 3 positions; `read` pages
    read back per fetch, a cache of twice that; pages ranked by Quest's bounds, which these tests
    compute by hand."""
    torch.manual_seed(0)
    pages = HostPages(B, H, tokens, D, torch.float32, torch.device("cpu"), PAGE, read, 2 * read, summary="bounds")
    keys, values = torch.randn(B, H, tokens, D), torch.randn(B, H, tokens, D)
    for row in range(B):
        pages.park(row, keys[row : row + 1], values[row : row + 1], first_position=3 * row, count=count)
    return pages, keys, values


def test_fetch_takes_the_best_parked_pages_by_their_quest_bound():
    pages, keys, values = _filled()
    resident = torch.full((B, H, 6), -1)
    resident[:, :, :5] = torch.tensor([0, 1, 2, 3, 17])  # page 0 wholly resident, one token of page 4
    for row in range(B):
        pages.mark_resident(row, resident[row] + 3 * row)
    query = torch.randn(B, 2 * H, D)
    got_k, got_v, attend = pages.fetch(query)

    low = torch.stack([keys[..., p * PAGE : min(22, (p + 1) * PAGE), :].amin(2) for p in range(6)], 2)
    high = torch.stack([keys[..., p * PAGE : min(22, (p + 1) * PAGE), :].amax(2) for p in range(6)], 2)
    scores = quest_page_scores_reference(query, low, high)
    scores[..., 0] = -torch.inf  # nothing parked there
    best = scores.topk(3, dim=-1).indices
    for b in range(B):
        for h in range(H):
            tokens = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in best[b, h].tolist()])
            torch.testing.assert_close(got_k[b, h], keys[b, h, tokens])
            torch.testing.assert_close(got_v[b, h], values[b, h, tokens])
            expect = (tokens < 22) & ~torch.isin(tokens, resident[b, h])
            assert attend[b, h].tolist() == expect.tolist()


def test_a_page_asked_for_again_comes_from_the_gpu_cache(monkeypatch):
    from atskv.runtime.fast import host_pages

    copied = []
    real_copy = host_pages.page_copy

    def counting(source, target, pages, slots, need):
        copied.append(int(need.sum()))
        real_copy(source, target, pages, slots, need)

    monkeypatch.setattr(host_pages, "page_copy", counting)
    pages, keys, _ = _filled()
    for row in range(B):
        pages.mark_resident(row, torch.full((H, 4), -1))
    query = torch.randn(B, 2 * H, D)
    first = pages.fetch(query)
    again = pages.fetch(query)
    assert copied == [B * H * 3] * 2 + [0, 0]  # keys and values: all missed once, then all hit
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for seed in range(6):  # other queries push pages out and back in: a fetch is what a cold cache would give
        query = torch.randn(B, 2 * H, D, generator=torch.Generator().manual_seed(seed))
        cold, _, _ = _filled()
        for row in range(B):
            cold.mark_resident(row, torch.full((H, 4), -1))
        for a, b in zip(pages.fetch(query), cold.fetch(query)):
            assert torch.equal(a, b)


def test_an_appended_token_refreshes_its_cached_page():
    pages, _, _ = _filled(count=21, read=10)  # every page read back: page 5 (tokens 20..23) cached
    for row in range(B):
        pages.mark_resident(row, torch.full((H, 4), -1))
    pages.fetch(torch.randn(B, 2 * H, D))
    pages.append(torch.full((B, H, 1, D), 50.0), torch.full((B, H, 1, D), 50.0))  # token 21, in page 5
    pages.release(torch.tensor([21, 24]).view(B, 1, 1).expand(B, H, 1), torch.ones(B, H, 1, dtype=torch.bool))
    keys, _, attend = pages.fetch(torch.randn(B, 2 * H, D))
    found = (keys == 50).all(-1) & attend
    assert found.sum(-1).tolist() == [[1, 1], [1, 1]]  # the parked new token is read back, from fresh copies


def test_a_decode_token_is_written_resident_and_released_when_evicted():
    pages, _, _ = _filled()
    for row in range(B):
        pages.mark_resident(row, torch.full((H, 4), -1))
    new_k, new_v = torch.full((B, H, 1, D), 100.0), torch.full((B, H, 1, D), -100.0)
    pages.append(new_k, new_v)
    assert pages.count.flatten().tolist() == [23, 23]
    assert torch.equal(pages.host_keys[:, :, 22], new_k[:, :, 0])
    assert torch.equal(pages.host_values[:, :, 22], new_v[:, :, 0])
    assert bool(pages.resident[:, :, 22].all()) and int(pages.resident.sum()) == B * H
    assert bool((pages.summary.high[:, :, 22 // PAGE] == 100).all())  # the page's bound widened to the new key
    positions = torch.tensor([22, 22 + 3]).view(B, 1, 1).expand(B, H, 1)  # row 1's positions are offset by 3
    pages.release(positions, torch.tensor([True, False]).view(B, 1, 1).expand(B, H, 1))
    assert pages.resident[:, :, 22].tolist() == [[False, False], [True, True]]


@pytest.mark.parametrize("summary", ["bounds", "int4"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", ["snapkv", "h2o", "streaming_llm"])
def test_reading_back_every_parked_page_gives_dense_tokens(family, selector, summary):
    """Resident slots plus every parked token is the whole context, each once: dense attention,
    whatever summary ranks the pages."""
    model = tiny_model(family)
    ids = random_prompt(150, seed=2, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    run = dict(attention_mask=mask, max_new_tokens=12, dense_layers=1, prefill_chunk=64)
    dense = atskv.generate(model, ids, "dense", 0.5, **run)
    tiered = atskv.generate(model, ids, selector, 12, tier=HostRetrieval(tokens=10_000, summary=summary), **run)
    assert torch.equal(tiered, dense)


def test_a_partial_read_back_differs_from_eviction_alone():
    """A test of the fetch path that can fail: with only some pages read back the output is
    neither dense's nor eviction's in general (these seeds were checked to differ from both)."""
    model = tiny_model("llama")
    ids = random_prompt(150, seed=2)
    run = dict(max_new_tokens=12, dense_layers=1, prefill_chunk=64)
    evicted = atskv.generate(model, ids, "snapkv", 12, **run)
    tiered = atskv.generate(model, ids, "snapkv", 12, tier=HostRetrieval(tokens=32), **run)
    assert not torch.equal(tiered, evicted)


def test_a_tier_needs_an_evicting_selector():
    with pytest.raises(ValueError, match="evicting selector"):
        atskv.generate(tiny_model("llama"), random_prompt(80), "quest", 16, tier=HostRetrieval())
    with pytest.raises(ValueError, match="budget"):
        HostRetrieval(tokens=1.5)


def test_the_host_tier_accounts_its_bytes():
    pages, _, _ = _filled()
    assert pages.nbytes == 2 * B * H * 40 * D * 4
    assert pages.gpu_nbytes == 2 * B * H * 10 * D * 4 + B * H * 41 + 2 * B * H * 6 * PAGE * D * 4


@pytest.mark.gpu
def test_the_device_alias_reads_and_writes_pinned_memory_inside_a_graph():
    reset_peak_pinned()
    host = pinned_zeros((4, 64, 32), dtype=torch.bfloat16)
    assert pinned_peak() >= host.nbytes == 4 * 64 * 32 * 2  # exactly the size asked for
    host.copy_(torch.randn(4, 64, 32))
    alias = device_alias(host, torch.device("cuda"))
    assert alias.is_cuda and torch.equal(alias.cpu(), host)
    index = torch.tensor([[5], [9], [0], [63]], device="cuda").unsqueeze(-1).expand(4, 1, 32)
    out = torch.empty(4, 1, 32, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(alias.gather(1, index))
        alias[:, 1] = 7
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host.gather(1, index.cpu())) and bool((host[:, 1] == 7).all())


@pytest.mark.gpu
def test_fetches_through_pinned_memory_and_the_kernel_equal_the_cpu_ones():
    cpu, keys, values = _filled()
    gpu = HostPages(B, H, 40, D, torch.float32, torch.device("cuda"), PAGE, 3, 6, summary="bounds")  # as _filled's
    for row in range(B):
        gpu.park(row, keys[row : row + 1].cuda(), values[row : row + 1].cuda(), first_position=3 * row, count=22)
        for pages in (cpu, gpu):
            pages.mark_resident(row, torch.tensor([[0, 1, 5]] * H, device=pages.resident.device) + 3 * row)
    for seed in range(5):  # misses, then hits and evictions in the page cache
        query = torch.randn(B, 2 * H, D, generator=torch.Generator().manual_seed(seed % 3))
        for a, b in zip(cpu.fetch(query), gpu.fetch(query.cuda())):
            torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0)


@pytest.mark.gpu
def test_a_tiered_graph_replay_gives_the_eager_tokens():
    model = tiny_model("gemma3").cuda().to(torch.bfloat16)
    ids = random_prompt(300, seed=4, batch=2).cuda()
    run = dict(max_new_tokens=16, tier=HostRetrieval(tokens=64))
    eager = atskv.generate(model, ids, "snapkv", 32, cuda_graph=False, **run)
    assert torch.equal(eager, atskv.generate(model, ids, "snapkv", 32, cuda_graph=True, **run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_page_copy_kernel_matches_its_reference(monkeypatch, dtype):
    from atskv.kernels import page_copy as kernel

    torch.manual_seed(3)
    source = torch.randn(6, 9, 40).to(dtype)
    pages = torch.stack([torch.randperm(9)[:4] for _ in range(6)])
    slots = torch.stack([torch.randperm(5)[:4] for _ in range(6)])
    need = torch.rand(6, 4) < 0.5
    targets = []
    for choice in ("reference", "triton"):
        monkeypatch.setenv("ATSKV_KERNELS", choice)
        target = torch.full((6, 5, 40), 100.0).to(dtype)  # never drawn from randn
        kernel.page_copy(source, target, pages, slots, need)
        targets.append(target)
    assert torch.equal(targets[0], targets[1])
    n, r = need.nonzero(as_tuple=True)
    assert torch.equal(targets[0][n, slots[n, r]], source[n, pages[n, r]])
    assert bool((targets[0].view(6, -1) == 100).sum(-1).eq((5 - need.sum(-1)) * 40).all())  # nothing else written


def test_a_missing_page_never_takes_the_slot_of_a_page_read_beside_it():
    """A read of pages [0, 10] after [0, 8] in two slots: page 0 hits in slot 0, page 10 misses and
    must take slot 1 (page 8's, the only one this read does not hold), whatever order the
    bookkeeping's scatters write in."""
    from atskv.kernels.page_cache import assign_slots

    pages, slots = 22, 2
    slot_of = torch.full((1, 1, pages + 1), -1)
    page_in = torch.full((1, 1, slots + 1), pages)
    used, clock = torch.zeros(1, 1, slots, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    for read, want_slots, want_hits in (([0, 8], [0, 1], [False, False]), ([0, 10], [0, 1], [True, False])):
        clock += 1
        slot, hit = assign_slots(slot_of, page_in, used, clock, torch.tensor([[read]]))
        assert slot.view(-1).tolist() == want_slots and hit.view(-1).tolist() == want_hits
    assert (slot_of[0, 0] >= 0).nonzero().view(-1).tolist() == [0, 10], "page 8 left, nothing else"
