"""The host tier's decode step after the page ranking (`atskv.kernels.page_cache.parked_read`):
the Triton kernel (Triton's interpreter on the CPU) against the torch reference over several
steps of one cache, so that pages hit, miss and evict and pages with nothing parked are passed
over; a row without a region lists its own tokens alone; and the least recently used slot goes
first, the lowest among equals."""

from __future__ import annotations

import pytest
import torch

from atskv.kernels.page_cache import assign_slots, parked_read_reference, parked_read_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REGIONS, HKV, PAGES, SIZE, SLOTS, READ, K = 2, 2, 12, 4, 5, 3, 9


def cache(seed: int) -> dict:
    """Two regions and the spare, their maps empty, their tokens parked at random (a quarter of the
    pages none), each page's count of them."""
    g = torch.Generator().manual_seed(seed)
    spare = REGIONS + 1
    parked = torch.cat([torch.rand(REGIONS, HKV, PAGES * SIZE, generator=g) < 0.7,
                        torch.zeros(1, HKV, PAGES * SIZE, dtype=torch.bool)])  # fmt: skip
    parked.view(spare, HKV, PAGES, SIZE)[torch.rand(spare, HKV, PAGES, generator=g) < 0.25] = False
    return {
        "slot_of": torch.full((spare, HKV, PAGES + 1), -1, dtype=torch.long),
        "page_in": torch.full((spare, HKV, SLOTS + 1), PAGES, dtype=torch.long),
        "used": torch.zeros(spare, HKV, SLOTS, dtype=torch.long),
        "clock": torch.zeros(1, dtype=torch.long),
        "fetched": torch.zeros(1, dtype=torch.long),
        "cache_start": torch.tensor([8, 20, 0], dtype=torch.int32),
        "parked": parked,
        "parked_in_page": parked.view(spare, HKV, PAGES, SIZE).sum(-1).int(),
    }


def step_inputs(g: torch.Generator, rows: torch.Tensor) -> dict:
    b = len(rows)
    best = torch.stack([torch.stack([torch.randperm(PAGES, generator=g)[:READ] for _ in range(HKV)])
                        for _ in range(b)])  # fmt: skip
    return {
        "best": best,
        "rows": rows,
        "block_table": torch.randint(0, 100, (b, 16), generator=g, dtype=torch.int32),
        "positions": torch.randint(0, 64, (b, HKV, K), generator=g, dtype=torch.int32),
        "lengths": torch.randint(0, K + 1, (b, HKV), generator=g, dtype=torch.int32),
    }


def run(read, state: dict, inputs: dict):
    state["clock"] += 1
    return read(inputs["best"], state["parked_in_page"], inputs["rows"], state["slot_of"], state["page_in"],
                state["used"], state["clock"], state["fetched"], state["cache_start"], inputs["block_table"],
                state["parked"], inputs["positions"], inputs["lengths"], SIZE)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_keeps_the_cache_and_lists_the_parked_tokens_as_its_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    want, got = cache(seed), {k: v.to(DEVICE) for k, v in cache(seed).items()}
    rows = torch.tensor([1, REGIONS, 0])  # the middle row has no region
    misses, passed_over = 0, 0
    for step in range(6):  # a cache of 5 slots read 3 pages a step: hits, misses and evictions
        inputs = step_inputs(g, rows)
        listed, counts, blocks, missing = run(parked_read_reference, want, inputs)
        k_listed, k_counts, k_blocks, k_missing = run(parked_read_triton, got,
                                                      {k: v.to(DEVICE) for k, v in inputs.items()})  # fmt: skip
        assert torch.equal(k_counts.cpu(), counts) and torch.equal(k_listed.cpu(), listed), step
        own = rows != REGIONS  # the spare region's maps are nobody's: the reference writes them, the kernel not
        assert torch.equal(k_blocks.cpu()[own], blocks[own]) and torch.equal(k_missing.cpu(), missing), step
        for name in ("slot_of", "page_in", "used"):
            assert torch.equal(got[name].cpu()[:REGIONS], want[name][:REGIONS]), (step, name)
        assert int(got["fetched"]) == int(want["fetched"])
        misses += int(missing.sum())
        empty = want["parked_in_page"][rows].gather(2, inputs["best"]) == 0
        assert not missing[empty].any()  # nothing parked there: nothing to fetch
        passed_over += int(empty[rows != REGIONS].sum())
    assert misses and int(want["fetched"]) == misses and passed_over
    spare = rows == REGIONS
    assert torch.equal(counts[spare], inputs["lengths"][spare]), "no region: its own tokens alone"


def test_the_least_recently_used_slot_goes_first_the_lowest_among_equals():
    slot_of = torch.full((1, 1, 9), -1, dtype=torch.long)
    page_in = torch.full((1, 1, 4), 8, dtype=torch.long)
    used = torch.zeros(1, 1, 3, dtype=torch.long)
    clock = torch.zeros(1, dtype=torch.long)
    slots = []
    for pages in ([[[5]]], [[[6]]], [[[5, 7]]], [[[1]]]):
        clock += 1
        slot, hit = assign_slots(slot_of, page_in, used, clock, torch.tensor(pages))
        slots.append((slot.view(-1).tolist(), hit.view(-1).tolist()))
    # empty slots in order; 5 hits at step 3 while 7 takes the free slot 2; page 1 then evicts 6 (slot 1, used at 2)
    assert slots == [([0], [False]), ([1], [False]), ([0, 2], [True, False]), ([1], [False])]
    assert slot_of[0, 0, 6] == -1 and slot_of[0, 0, 1] == 1 and page_in[0, 0, :3].tolist() == [5, 1, 7]
