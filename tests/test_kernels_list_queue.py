"""A kept list read as a queue (`atskv.kernels.list_queue`, the learned selector's decode step inside
vLLM without a refresh): its read sets against the list step's (`atskv.kernels.kept_lists`) over a
generation, and the Triton kernel (Triton's interpreter on the CPU) against the torch reference,
over random block tables, with ties, pins, padded rows and requests no ranking wrote."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.kernels.budget import kept_count
from atskv.kernels.kept_lists import kept_list_step_reference, list_slots
from atskv.kernels.list_queue import queue_read, queue_read_reference, queue_read_triton

BLOCK, HKV = 4, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ranked_lists(ranked_at: list[int], width_blocks: int, budget, pins: int, seed: int):
    """Each request ranked at its length L0: n0 distinct positions below L0 with few distinct scores
    (ties) and `pins` at +inf, over a shuffled pool of blocks. Returns the list as a list step
    keeps it (entries in a random order) and as a queue (lowest (score, position) first, (L0, n0)
    at the first slot), the table and the queues as Python lists."""
    g = torch.Generator().manual_seed(seed)
    blocks = len(ranked_at) * width_blocks + 5
    table = torch.randperm(blocks, generator=g)[: len(ranked_at) * width_blocks].view(len(ranked_at), -1).int()
    slots = blocks * BLOCK
    kept = torch.randint(-9, 999, (slots + 1, HKV), generator=g, dtype=torch.int32)
    values = torch.randint(0, 4, (slots + 1, HKV), generator=g).float()
    queued, ranked = kept.clone(), torch.randint(-9, 999, (slots + 1, 2), generator=g, dtype=torch.int32)
    queues = []
    for r, length in enumerate(ranked_at):
        n0 = kept_count(budget, length)
        at = list_slots(table[r : r + 1], torch.tensor([length]), BLOCK, n0, slots)[0]
        ranked[table[r, 0].long() * BLOCK] = torch.tensor([length, n0], dtype=torch.int32)
        queues.append([])
        for h in range(HKV):
            positions = torch.randperm(length, generator=g)[:n0]
            scores = torch.randint(0, 4, (n0,), generator=g).float()
            scores[:pins] = math.inf  # `window_share`'s pins
            kept[at, h], values[at, h] = positions.int(), scores
            queue = sorted(zip(scores.tolist(), positions.tolist()))
            queued[at, h] = torch.tensor([p for _, p in queue], dtype=torch.int32)
            queues[r].append([p for _, p in queue])
    return (kept, values), (queued, ranked), table, queues


@pytest.mark.parametrize("budget, pins", [(0.05, 5), (40, 10), (24, 24), (0.3, 0)])
def test_a_queue_reads_what_the_list_step_reads(budget, pins):
    """The learned selector's step (no recent window, every new token at +inf, scores that never
    change) evicts in an order fixed at the ranking: the queue's newest entries are what it reads,
    step after step, including a generation that outlasts the finite entries."""
    ranked_at, steps, width_blocks = [600, 200, 313], 300, 230
    (kept, values), (queued, ranked), table, queues = ranked_lists(ranked_at, width_blocks, budget, pins, seed=0)
    width = kept_count(budget, width_blocks * BLOCK)
    for k in range(1, steps + 1):
        seq_lens = torch.tensor([length + k for length in ranked_at], dtype=torch.int32)
        stepped, stepped_counts = kept_list_step_reference(kept, values, table, seq_lens, BLOCK, budget, 0.0,
                                                           math.inf, width + 1)  # fmt: skip
        read, counts = queue_read_reference(queued, ranked, table, seq_lens, BLOCK, budget, width)
        assert torch.equal(counts, stepped_counts)
        for r, length in enumerate(ranked_at):
            count = int(counts[r, 0])
            evicted = len(queues[r][0]) + k - count
            for h in range(HKV):
                want = (queues[r][h] + list(range(length, length + k)))[evicted : evicted + count]
                assert read[r, h, :count].tolist() == want, (k, r, h)
                assert sorted(stepped[r, h, :count].tolist()) == sorted(want), (k, r, h)
                assert not read[r, h, count:].any()


@pytest.mark.parametrize("budget", [5, 40, 0.3])
@pytest.mark.parametrize("block", [8, 1024])
def test_the_queue_kernel_matches_its_reference(budget, block):
    """Ranked requests at and past their ranking, a padded row of length 0 and a request whose first
    slot holds an earlier tenant's (L0, n0) and entries (no ranking wrote them): the kernel reads
    what the reference reads, and the last only positions it holds, its newest among them."""
    ranked_at, width_blocks = [37, 1, 100, 6, 120], 32
    _, (queued, ranked), table, _ = ranked_lists(ranked_at, width_blocks, budget, pins=2, seed=1)
    ranked[table[1, 0].long() * BLOCK] = torch.tensor([900, 70], dtype=torch.int32)  # never ranked
    seq_lens = torch.tensor([40, 0, 100, 9, 121], dtype=torch.int32)
    want = queue_read_reference(queued, ranked, table, seq_lens, BLOCK, budget, kept_count(budget, 128))
    unranked = (torch.tensor([57], dtype=torch.int32), table[1:2])
    stale = queue_read_reference(queued, ranked, unranked[1], unranked[0], BLOCK, budget, kept_count(budget, 128))
    for args, expected in (((table, seq_lens), want), ((unranked[1], unranked[0]), stale)):
        got = queue_read_triton(queued.to(DEVICE), ranked.to(DEVICE), args[0].to(DEVICE), args[1].to(DEVICE), BLOCK,
                                budget, kept_count(budget, 128), block=block)  # fmt: skip
        assert torch.equal(got[1].cpu(), expected[1]) and torch.equal(got[0].cpu(), expected[0])
    read = stale[0][0, :, : int(stale[1][0, 0])]
    assert bool(((read >= 0) & (read < 57)).all()) and bool((read == 56).any())
    assert not want[0][1].any() and not want[1][1].any()


@pytest.mark.parametrize("budget", [5, 0.3])
def test_every_layers_queue_read_at_once_is_each_layers_read(budget):
    """A step's layers ranked alike (one `ranked`) with lists of their own: one kernel over the
    list of them reads, layer by layer, what each layer's own read does; the reference alike."""
    ranked_at, width_blocks = [37, 1, 100, 6, 120], 32
    _, (queued, ranked), table, _ = ranked_lists(ranked_at, width_blocks, budget, pins=2, seed=2)
    layers = [queued, queued.flip(1).contiguous(), torch.randint(-9, 130, queued.shape, dtype=torch.int32)]
    seq_lens = torch.tensor([40, 0, 100, 9, 121], dtype=torch.int32)
    width = kept_count(budget, 128)
    each = [queue_read_reference(k, ranked, table, seq_lens, BLOCK, budget, width) for k in layers]
    assert not torch.equal(each[0][0], each[1][0])  # the layers' reads differ
    on = [k.to(DEVICE) for k in layers]
    for positions, counts in (queue_read_triton(on, ranked.to(DEVICE), table.to(DEVICE), seq_lens.to(DEVICE), BLOCK,
                                                budget, width, block=16),
                              queue_read(layers, ranked, table, seq_lens, BLOCK, budget, width)):  # fmt: skip
        assert positions.shape == (3, 5, HKV, width)
        assert torch.equal(counts.cpu(), each[0][1])
        for layer, (want, _) in enumerate(each):
            assert torch.equal(positions[layer].cpu(), want), layer
