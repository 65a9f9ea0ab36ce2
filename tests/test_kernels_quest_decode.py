"""Quest's fused decode step (`atskv.kernels.quest_decode`): the Triton kernels (Triton's interpreter
on CPU) against the torch references, and the references against what they promise."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.kernels.quest import masked_page_bounds, quest_page_scores_reference
from atskv.kernels.quest_decode import (
    best_pages,
    pick_best,
    quest_pick,
    quest_pick_reference,
    quest_pick_triton,
    quest_step_scores,
)


def both_paths(monkeypatch, fn, *args):
    """`fn` through the torch reference and through the Triton kernel, each on its own copy of
    the arguments (the step updates bounds in place)."""
    out = []
    for choice in ("reference", "triton"):
        monkeypatch.setenv("ATSKV_KERNELS", choice)
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        out.append((fn(*copies), copies))
    return out


def static_layer(b=2, hkv=2, group=3, slots=45, d=16, size=8, dtype=torch.float32, seed=0):
    """A static cache after some decode steps: row 1 of head 0 has free slots (evicted), one page
    is empty, the last page is partial, and a token was just written at `write_slot`."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, slots, d, generator=g).to(dtype)
    slot_pos = torch.arange(slots).expand(b, hkv, slots).clone()
    slot_pos[:, :, 40:] = -1  # free slots past the end
    slot_pos[1, 0, torch.randperm(40, generator=g)[:12]] = -1
    slot_pos[0, 1, 8:16] = -1  # an empty page
    write_slot = torch.tensor([[39, 20], [3, 39]])
    held = slot_pos >= 0
    low, high = masked_page_bounds(keys, held, size)
    counts = torch.nn.functional.pad(held, (0, -slots % size)).unflatten(-1, (-1, size)).sum(-1, dtype=torch.int32)
    low[0, 0, 39 // size] += 5.0  # stale bounds for the written page: the step must recompute them
    counts[0, 0, 39 // size] = 0
    query = torch.randn(b, hkv * group, d, generator=g).to(dtype)
    return query, low, high, counts, keys, slot_pos, write_slot, size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_scores_kernel_matches_reference_and_updates_the_written_page(monkeypatch, dtype):
    args = static_layer(dtype=dtype)
    (ref, ref_args), (tri, tri_args) = both_paths(monkeypatch, quest_step_scores, *args)
    assert torch.equal(ref == -math.inf, tri == -math.inf)
    finite = ref > -math.inf
    torch.testing.assert_close(tri[finite], ref[finite], rtol=1e-5, atol=1e-4)
    for r, t in zip(ref_args[1:4], tri_args[1:4]):  # low, high, held: updated the same way
        torch.testing.assert_close(t, r)
    query, low, high, held, keys, slot_pos, _, size = ref_args
    truth_low, truth_high = masked_page_bounds(keys, slot_pos >= 0, size)
    assert torch.equal(low[0, 0, 4], truth_low[0, 0, 4]) and int(held[0, 0, 4]) == 8  # recomputed
    expected = quest_page_scores_reference(query, low, high).masked_fill(held == 0, -math.inf)
    assert torch.equal(ref, expected)
    assert (ref[0, 1, 1] == -math.inf) and (ref[:, :, 5] == -math.inf).all()  # empty pages


def reference_pick(scores, valid, limit, n_pages, size):
    """By hand: best pages by score (lower id first on ties), slots newest first, usable first."""
    b, h, _ = scores.shape
    slots = valid.shape[-1]
    out, lengths = [], torch.empty(b, h, dtype=torch.long)
    for i in range(b):
        for j in range(h):
            order = sorted(range(scores.shape[-1]), key=lambda p: (-scores[i, j, p].item(), p))[:n_pages]
            cands = [p * size + o for p in order for o in range(size - 1, -1, -1)]
            usable = [c for c in cands if c < slots and valid[i, j, c]]
            spare = [min(c, slots - 1) for c in cands if not (c < slots and valid[i, j, c])]
            out.append(usable + spare)
            lengths[i, j] = min(limit[i], len(usable))
    return torch.tensor(out).view(b, h, -1), lengths


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("budget", [10, 0.3])
def test_pick_kernel_matches_reference_and_a_plain_loop(monkeypatch, budget, positions):
    """`valid` as bools, or as the fast path passes it: slot positions, usable where >= 0."""
    g = torch.Generator().manual_seed(1)
    b, h, slots, size = 2, 3, 45, 8
    scores = torch.randn(b, h, 6, generator=g)
    scores[0, 0, 2] = scores[0, 0, 4]  # a tie: lower page id first
    scores[1, 2, 3] = -math.inf  # an empty page
    scores[1, 0] = -math.inf
    scores[1, 0, 4] = 0.5  # one page with tokens: the other picks tie at -inf, lowest ids first
    valid = torch.rand(b, h, slots, generator=g) > 0.3
    context = torch.tensor([40, 31])
    n_pages = 4
    usable = torch.randint(0, 99, valid.shape, generator=g).masked_fill(~valid, -1) if positions else valid
    (ref, _), (tri, _) = both_paths(monkeypatch, quest_pick, scores, usable, budget, context, n_pages, size)
    limit = [min(c, budget) if isinstance(budget, int) else max(1, math.ceil(c * budget)) for c in context.tolist()]
    expected, lengths = reference_pick(scores, valid, limit, n_pages, size)
    for indices, counted in (ref, tri):
        assert indices.dtype == torch.int32 and torch.equal(indices.long(), expected)
        assert torch.equal(counted.long(), lengths)


def test_pick_kernel_sorts_a_long_row(monkeypatch):
    """Thousands of pages (a 32K context of 16-token pages) in one program's search, the chosen
    pages ranked by seven programs."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(1, 2, 2048, generator=g)
    valid = torch.ones(1, 2, 2048 * 16, dtype=torch.bool)
    (ref, _), (tri, _) = both_paths(monkeypatch, quest_pick, scores, valid, 0.05, torch.tensor([32768]), 105, 16)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    assert int(tri[1][0, 0]) == math.ceil(32768 * 0.05)


@pytest.mark.parametrize(
    "knobs", [dict(), dict(chunk=8, block_j=16, radix=1), dict(chunk=64, block_j=8, radix=3), dict(radix=2)]
)
@pytest.mark.parametrize(
    "kind", ["distinct", "ties", "mostly empty", "exactly held", "all equal", "infinite", "wide", "ulps apart"]
)
def test_pick_kernel_matches_reference_across_programs(knobs, kind):
    """The search (one program per row, `radix` bits per pass) over spans from none (all equal) to
    all 32 bits (wide), stopping early or resolving every bit (ulps apart); ties at the n-th score
    beyond the places left (lowest ids win), fewer pages holding tokens than are picked or exactly
    as many: its chosen pages alone, then the whole pick, whose second kernel ranks them over
    several programs per row (`chunk` each) reading them in blocks (`block_j`), with a partial
    last page and unusable slots."""
    g = torch.Generator().manual_seed(4)
    b, h, pages, size, n_pages = 2, 3, 150, 8, 45
    scores = torch.randn(b, h, pages, generator=g)
    if kind == "ties":
        scores = scores.round()  # a handful of values: many pages tie at the n-th
    elif kind == "mostly empty":
        scores[:, :, 20:] = -math.inf  # the other picks tie at -inf
    elif kind == "exactly held":
        scores[:, :, n_pages:] = -math.inf
    elif kind == "all equal":
        scores[:] = 2.5
    elif kind == "infinite":
        scores[:, :, ::3] = math.inf
        scores[:, :, 1::4] = -math.inf
    elif kind == "wide":
        scores = scores * torch.logspace(-30, 30, pages)[torch.randperm(pages, generator=g)]
        scores[0, 0, 5] = -3e38
        scores[0, 1, 7] = math.inf
    elif kind == "ulps apart":  # keys 0-3 apart around the n-th: every bit resolved, some ties
        ulps = torch.randint(0, 4, (b, h, pages), generator=g, dtype=torch.int32)
        scores = (torch.full((b, h, pages), 7.0).view(torch.int32) + ulps).view(torch.float32)
        scores[..., :10] += 1.0
    slots = pages * size - 3
    valid = torch.rand(b, h, slots, generator=g) > 0.2
    case = (scores, valid, 0.05, torch.tensor([slots, 300]), n_pages, size)
    best = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_pages].sort(-1).values
    bits = (scores + 0.0).view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).gather(-1, best)  # the kernel's order-preserving keys
    chosen = pick_best(scores, n_pages, 4, knobs.get("radix", 2)).view(2, b, h, n_pages)
    assert torch.equal(chosen[0], keys) and torch.equal(chosen[1], best.int())  # in page order
    want = quest_pick_reference(*case)
    got = quest_pick_triton(*case, **knobs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["distinct", "ties", "mostly empty"])
def test_best_pages_are_the_same_pages_on_both_paths(monkeypatch, kind):
    """The host tier's pick: the kernel's search and the reference's stable sort give the same ids
    in page order, ties to the lower id, held pages before any that hold nothing."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 2, 300, generator=g)
    if kind == "ties":
        scores = scores.round()
    elif kind == "mostly empty":
        scores[:, :, 9:] = -math.inf
    (ref, _), (tri, _) = both_paths(monkeypatch, best_pages, scores, 16)
    assert torch.equal(ref, tri) and ref.dtype == torch.long
    assert (ref.diff(dim=-1) > 0).all()  # page order, no page twice
    if kind == "mostly empty":
        assert torch.equal(ref[..., :9], torch.arange(9).expand(3, 2, 9)) and (ref[..., 9:] >= 9).all()
    else:
        assert (scores.gather(-1, ref).amin(-1) >= scores.sort(-1, descending=True).values[..., 15]).all()


@pytest.mark.gpu
def test_both_kernels_match_their_references_on_the_gpu_at_a_32k_shape(monkeypatch):
    """Llama-3-8B attention shape, bf16, 32K slots, a 5% budget: the compiled kernels (not the
    interpreter) against the references, with the written page stale as after a decode write."""
    torch.manual_seed(3)
    b, hkv, group, slots, d, size = 2, 8, 4, 32768, 128, 16
    keys = torch.randn(b, hkv, slots, d, device="cuda", dtype=torch.bfloat16)
    slot_pos = torch.arange(slots, device="cuda").expand(b, hkv, slots).clone()
    slot_pos[:, :, 30000:] = -1
    held = slot_pos >= 0
    low, high = masked_page_bounds(keys, held, size)
    counts = held.unflatten(-1, (-1, size)).sum(-1, dtype=torch.int32)
    write_slot = torch.full((b, hkv), 29999, device="cuda")
    counts[:, :, 29999 // size] -= 1
    query = torch.randn(b, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    args = (query, low, high, counts, keys, slot_pos, write_slot, size)
    (ref, _), (tri, _) = both_paths(monkeypatch, quest_step_scores, *args)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-3)
    context = torch.full((b,), 30000, device="cuda")
    (ref, _), (tri, _) = both_paths(monkeypatch, quest_pick, ref, held, 0.05, context, 96, size)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
