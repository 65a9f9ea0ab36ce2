"""The kept lists' decode step and read-mass update (`atskv.kernels.kept_lists`): the Triton kernels
(Triton's interpreter on the CPU) against the torch reference, on lists laid out through random
block tables, with tied values, padded rows of length 0, lists longer than a kernel's block and
lists stored past a split (`moved`: compacted ones)."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.kernels.budget import kept_count, kept_tokens
from atskv.kernels.kept_lists import (
    add_list_values,
    kept_list_step_reference,
    kept_list_step_triton,
    list_slots,
)

BLOCK, HKV = 4, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def lists(lengths: list[int], width: int, budget, seed: int, moved: bool = False):
    """Each request's list as a prefill left it (its held positions at its first logical slots, or
    with `moved` from a random split on a random shift further, values with ties), garbage
    elsewhere, over a shuffled pool of blocks; and the layouts (None without `moved`)."""
    g = torch.Generator().manual_seed(seed)
    blocks = len(lengths) * width + 5
    table = torch.randperm(blocks, generator=g)[: len(lengths) * width].view(len(lengths), width).int()
    slots = blocks * BLOCK
    kept = torch.randint(0, 999, (slots + 1, HKV), generator=g, dtype=torch.int32)
    values = torch.randint(0, 4, (slots + 1, HKV), generator=g).float()  # few distinct values: ties
    layout = torch.randint(0, 9, (slots + 1, 2), generator=g, dtype=torch.int32) if moved else None
    for r, n in enumerate(lengths):
        held = int(kept_tokens(budget, torch.tensor(max(n - 1, 0))))
        if moved:  # room after the held entries: the shift is at most what the budget leaves
            split = int(torch.randint(0, held + 1, (1,), generator=g))
            shift = int(torch.randint(0, max(1, n - 1 - held), (1,), generator=g))
            layout[table[r, 0].long() * BLOCK] = torch.tensor([split, shift], dtype=torch.int32)
        at = list_slots(table[r : r + 1], torch.tensor([n]), BLOCK, held, slots, layout)[0]
        for h in range(HKV):
            kept[at, h] = torch.randperm(max(n - 1, 1), generator=g)[:held].int()
    return kept, values, table, layout


@pytest.mark.parametrize("budget", [5, 40, 0.3])
@pytest.mark.parametrize("recent_fraction, new_value", [(0.0, math.inf), (0.5, 0.0)])
@pytest.mark.parametrize("block", [8, 1024])
@pytest.mark.parametrize("moved", [False, True])
def test_the_step_kernel_matches_its_reference(budget, recent_fraction, new_value, block, moved):
    lengths = [37, 0, 100, 6, 120]
    width_blocks = 32
    kept, values, table, layout = lists(lengths, width_blocks, budget, seed=1, moved=moved)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    slots = width_blocks * BLOCK
    width = min(slots, kept_count(budget, slots) + 1)
    want_kept, want_values = kept.clone(), values.clone()
    want = kept_list_step_reference(want_kept, want_values, table, seq_lens, BLOCK, budget, recent_fraction,
                                    new_value, width, layout)  # fmt: skip
    got_kept, got_values = kept.clone().to(DEVICE), values.clone().to(DEVICE)
    got = kept_list_step_triton(got_kept, got_values, table.to(DEVICE), seq_lens.to(DEVICE), BLOCK, budget,
                                recent_fraction, new_value, width, None if layout is None else layout.to(DEVICE),
                                block=block)  # fmt: skip
    assert torch.equal(got[1].cpu(), want[1])
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got_kept.cpu()[:-1], want_kept[:-1])  # the spare row: whatever padded rows wrote
    assert torch.equal(got_values.cpu()[:-1], want_values[:-1])
    assert not torch.equal(want_kept, kept), "the step must write the new tokens' entries"


@pytest.mark.parametrize("block", [8, 1024])
def test_a_list_no_prompt_ranked_reads_only_the_requests_own_positions(block):
    """Slots that no ranking wrote hold an earlier tenant's entries, here positions past the request
    and negative ones: kernel and reference read the newest token for them, never a position the
    request does not hold (its block table there may name another request's blocks)."""
    lengths, width_blocks, budget = [37, 100], 32, 40
    g = torch.Generator().manual_seed(4)
    table = torch.randperm(80, generator=g)[: 2 * width_blocks].view(2, width_blocks).int()
    kept = torch.randint(-50, 5000, (80 * BLOCK + 1, HKV), generator=g, dtype=torch.int32)
    values = torch.rand(80 * BLOCK + 1, HKV, generator=g)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    width = kept_count(budget, width_blocks * BLOCK) + 1
    want = kept_list_step_reference(kept.clone(), values.clone(), table, seq_lens, BLOCK, budget, 0.5, 0.0, width)
    got = kept_list_step_triton(kept.clone().to(DEVICE), values.clone().to(DEVICE), table.to(DEVICE),
                                seq_lens.to(DEVICE), BLOCK, budget, 0.5, 0.0, width, block=block)  # fmt: skip
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    for r, n in enumerate(lengths):
        read = want[0][r][:, : int(want[1][r, 0])]
        assert bool(((read >= 0) & (read < n)).all()) and bool((read == n - 1).any())


@pytest.mark.parametrize("block", [8, 1024])
@pytest.mark.parametrize("moved", [False, True])
def test_read_mass_is_added_to_the_listed_values(block, moved):
    lengths = [37, 0, 100, 6]
    kept, values, table, layout = lists(lengths, 32, 40, seed=2, moved=moved)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    mass = torch.rand(len(lengths), HKV, 41, generator=torch.Generator().manual_seed(3))
    want = values.clone()
    add_list_values(want, mass, table, seq_lens, BLOCK, layout)  # the reference on the CPU
    got = values.clone().to(DEVICE)
    import atskv.kernels.kept_lists as kl

    kl.use_triton, use = (lambda _: True), kl.use_triton
    try:
        add_list_values(got, mass.to(DEVICE), table.to(DEVICE), seq_lens.to(DEVICE), BLOCK,
                        None if layout is None else layout.to(DEVICE), block=block)  # fmt: skip
    finally:
        kl.use_triton = use
    torch.testing.assert_close(got.cpu()[:-1], want[:-1])
    assert not torch.equal(want, values)
