"""Scoring kernels of the query-aware selectors (Quest page bounds, SparQ/SparCas partial logits):
the torch references against plain loops, the Triton kernels (Triton's interpreter on CPU)
against the references."""

from __future__ import annotations

import pytest
import torch

from atskv.kernels.partial_scores import partial_scores
from atskv.kernels.quest import page_bounds, quest_page_scores

SHAPES = [(1, 64), (3, 256), (4, 64)]  # (group size, head dim)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1e-3, atol=1e-2)}


def both_paths(monkeypatch, fn, *args, **kwargs):
    """`fn` through the torch reference and through the Triton kernel (env-forced dispatch)."""
    monkeypatch.setenv("ATSKV_KERNELS", "reference")
    ref = fn(*args, **kwargs)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    return ref, fn(*args, **kwargs)


def loop_page_scores(query, keys, page_size):
    """Quest by hand: per page min/max, per query head the bound, max over the group."""
    b, hq, tq, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    pages = -(-s // page_size)
    out = torch.empty(b, hkv, tq, pages)
    for p in range(pages):
        page = keys[:, :, p * page_size : (p + 1) * page_size].float()
        lo, hi = page.amin(2), page.amax(2)  # [B, Hkv, D]
        for h in range(hkv):
            q = query[:, h * g : (h + 1) * g].float()  # [B, G, Tq, D]
            bound = torch.maximum(q * lo[:, h, None, None], q * hi[:, h, None, None]).sum(-1)
            out[:, h, :, p] = bound.amax(1)
    return out


def loop_partial_scores(query, keys, dims, compact):
    b, hq, tq, _ = query.shape
    g = hq // keys.shape[1]
    out = torch.empty(b, hq, tq, keys.shape[2])
    for i in range(b):
        for j in range(hq):
            for t in range(tq):
                sel = dims[i, j, t]
                k = keys[i, j // g].float()
                k = k if compact else k[:, sel]
                out[i, j, t] = k @ query[i, j, t, sel].float()
    return out


def test_page_bounds_cover_each_page_including_a_partial_last_one():
    keys = torch.randn(2, 3, 37, 8)
    low, high = page_bounds(keys, 16)
    assert low.shape == high.shape == (2, 3, 3, 8)
    for p, (start, stop) in enumerate([(0, 16), (16, 32), (32, 37)]):
        assert torch.equal(low[:, :, p], keys[:, :, start:stop].amin(2))
        assert torch.equal(high[:, :, p], keys[:, :, start:stop].amax(2))


def test_quest_reference_matches_loop():
    torch.manual_seed(0)
    query, keys = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 45, 16)
    low, high = page_bounds(keys, 8)
    torch.testing.assert_close(quest_page_scores(query, low, high), loop_page_scores(query, keys, 8))
    assert quest_page_scores(query[:, :, 0], low, high).shape == (2, 2, 6)  # one query per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), SHAPES)
def test_quest_triton_matches_reference(monkeypatch, group, head_dim, dtype):
    torch.manual_seed(group * head_dim)
    b, hkv, slots = 2, 2, 150  # 10 pages of 16: not a multiple of any block
    keys = torch.randn(b, hkv, slots, head_dim).to(dtype)
    low, high = page_bounds(keys, 16)
    room_low = torch.zeros(b, hkv, 13, head_dim, dtype=dtype)  # bounds read as a view of a larger buffer
    room_low[:, :, :10] = low
    for query in (torch.randn(b, hkv * group, head_dim), torch.randn(b, hkv * group, 3, head_dim)):
        query = query.to(dtype)
        ref, tri = both_paths(monkeypatch, quest_page_scores, query, room_low[:, :, :10], high)
        assert tri.dtype == torch.float32 and tri.shape == ref.shape
        torch.testing.assert_close(tri, ref, **TOL[dtype])


def test_partial_scores_reference_matches_loop():
    torch.manual_seed(1)
    query, keys = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 21, 16)
    dims = query.abs().topk(4, dim=-1).indices  # per head and per query
    torch.testing.assert_close(partial_scores(query, keys, dims), loop_partial_scores(query, keys, dims, False))
    shared = dims[:, ::3, :1].repeat_interleave(3, dim=1)  # one set per KV group, [B, Hq, 1, r]
    compact = keys.gather(-1, shared[:, ::3, 0].unsqueeze(2).expand(-1, -1, 21, -1))
    expected = loop_partial_scores(query, compact, shared.expand(-1, -1, 3, -1), True)
    torch.testing.assert_close(partial_scores(query, compact, shared, compact=True), expected)
    torch.testing.assert_close(partial_scores(query, keys, shared), expected)  # same logits from the full keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), SHAPES)
def test_partial_scores_triton_matches_reference(monkeypatch, group, head_dim, dtype):
    torch.manual_seed(group + head_dim)
    b, hkv, tq, slots, rank = 2, 2, 2, 150, head_dim // 8
    hq = hkv * group
    query = torch.randn(b, hq, tq, head_dim).to(dtype)
    keys = torch.randn(b, hkv, slots + 7, head_dim).to(dtype)[:, :, :slots]  # a view of a larger buffer
    dims = query.float().abs().topk(rank, dim=-1).indices
    ref, tri = both_paths(monkeypatch, partial_scores, query, keys, dims)
    torch.testing.assert_close(tri, ref, **TOL[dtype])
    group_dims = torch.randperm(head_dim)[:rank].expand(b, hkv, rank)  # SparCas: one set per KV head
    compact = keys.gather(-1, group_dims.unsqueeze(2).expand(-1, -1, slots, -1))
    per_head = group_dims.repeat_interleave(group, dim=1).unsqueeze(2)  # broadcast over the queries
    ref, tri = both_paths(monkeypatch, partial_scores, query, compact, per_head, compact=True)
    torch.testing.assert_close(tri, ref, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (4, 128), (8, 64), (4, 256)])
def test_scoring_kernels_on_cuda(monkeypatch, group, head_dim, dtype):
    torch.manual_seed(0)
    b, hkv, slots = 2, 4, 32_771
    query = torch.randn(b, hkv * group, head_dim, device="cuda", dtype=dtype)
    keys = torch.randn(b, hkv, slots, head_dim, device="cuda", dtype=dtype)
    low, high = page_bounds(keys, 16)
    ref, tri = both_paths(monkeypatch, quest_page_scores, query, low, high)
    torch.testing.assert_close(tri, ref, **TOL[dtype])
    dims = query.float().abs().topk(head_dim // 8, dim=-1).indices.unsqueeze(2)
    ref, tri = both_paths(monkeypatch, partial_scores, query.unsqueeze(2), keys, dims)
    torch.testing.assert_close(tri, ref, **TOL[dtype])
    compact = keys[..., : head_dim // 8].contiguous()
    group_dims = torch.arange(head_dim // 8, device="cuda").expand(b, hkv * group, 1, -1)
    ref, tri = both_paths(monkeypatch, partial_scores, query.unsqueeze(2), compact, group_dims, compact=True)
    torch.testing.assert_close(tri, ref, **TOL[dtype])
