"""Partial-dimension logits (SparQ, SparCas): each query head's dot products with the keys over only
r of the D head dimensions.

`dims[b, j, t, i]` names the i-th dimension query head j uses for query t. The keys are either the
full cache `[B, Hkv, S, D]` (SparQ: the r columns are gathered on the fly, per head and per query)
or a compact copy `[B, Hkv, S, r]` whose column i already holds dimension `dims[..., i]` (SparCas:
one dimension set per KV group, kept between refreshes). One function serves both, reading the
keys in place: `compact=` says which layout `keys` has. GQA stays grouped (head j reads KV head
j // G). `dims` may be a broadcast view (stride 0 over heads or queries): nothing is copied.
"""

from __future__ import annotations

import torch

from atskv.attention import grouped_queries
from atskv.kernels.backend import jit, tl, triton, use_triton


def partial_scores_reference(
    query: torch.Tensor, keys: torch.Tensor, dims: torch.Tensor, *, compact: bool = False
) -> torch.Tensor:
    """Plain-torch `partial_scores`. Full keys: the query is zeroed outside `dims` and multiplied
    with the whole key matrix (exactly the partial sum, with no `[.., S, r]` gather per query)."""
    hkv = keys.shape[1]
    q_sel = query.gather(-1, dims).float()  # [B, Hq, Tq, r]
    if compact:
        q = grouped_queries(q_sel, hkv)
    else:
        q = grouped_queries(torch.zeros_like(query, dtype=torch.float32).scatter_(-1, dims, q_sel), hkv)
    logits = q @ keys.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, Tq, S]
    return logits.flatten(1, 2)


@jit
def _partial_scores_kernel(
    q_ptr, k_ptr, dims_ptr, out_ptr,
    n_heads, n_queries, n_slots, rank, group,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sd_b, sd_h, sd_t, sd_r,
    so_b, so_h, so_t, so_s,
    COMPACT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One program: one (row, query head, query) and BLOCK_S slots."""
    row = tl.program_id(0)
    t = row % n_queries
    h = (row // n_queries) % n_heads
    b = (row // (n_queries * n_heads)).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    in_rank = i < rank
    dims = tl.load(dims_ptr + b * sd_b + h * sd_h + t * sd_t + i * sd_r, mask=in_rank, other=0)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + t * sq_t + dims * sq_d, mask=in_rank, other=0.0).to(tl.float32)
    key_col = i if COMPACT else dims
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    k_head = k_ptr + b * sk_b + (h // group) * sk_h
    tile = (s < n_slots)[:, None] & in_rank[None, :]
    k = tl.load(k_head + s[:, None].to(tl.int64) * sk_s + key_col[None, :] * sk_d, mask=tile, other=0.0)
    logits = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    tl.store(out_ptr + b * so_b + h * so_h + t * so_t + s * so_s, logits, mask=s < n_slots)


def partial_scores_triton(
    query: torch.Tensor, keys: torch.Tensor, dims: torch.Tensor, *, compact: bool = False
) -> torch.Tensor:
    """Triton `partial_scores` (any strides, broadcast `dims` included)."""
    b, hq, tq, _ = query.shape
    hkv, slots = keys.shape[1], keys.shape[2]
    rank = dims.shape[-1]
    dims = dims.expand(b, hq, tq, rank)
    out = torch.empty(b, hq, tq, slots, dtype=torch.float32, device=query.device)
    block_r = max(16, triton.next_power_of_2(rank))
    block_s = max(16, min(256, 8192 // block_r))
    grid = (b * hq * tq, triton.cdiv(slots, block_s))
    _partial_scores_kernel[grid](
        query, keys, dims, out, hq, tq, slots, rank, hq // hkv,
        *query.stride(), *keys.stride(), *dims.stride(), *out.stride(),
        COMPACT=compact, BLOCK_S=block_s, BLOCK_R=block_r,
    )  # fmt: skip
    return out


def partial_scores(
    query: torch.Tensor, keys: torch.Tensor, dims: torch.Tensor, *, compact: bool = False
) -> torch.Tensor:
    """Logits `[B, Hq, Tq, S]` float32 (unscaled) of `query` `[B, Hq, Tq, D]` over the dimensions
    `dims` (long, broadcastable to `[B, Hq, Tq, r]`). `keys`: `[B, Hkv, S, D]` full keys, or with
    `compact=True` a `[B, Hkv, S, r]` copy whose column i holds dimension `dims[..., i]`."""
    dims = dims.expand(*query.shape[:3], dims.shape[-1])
    if use_triton(query):
        return partial_scores_triton(query, keys, dims, compact=compact)
    return partial_scores_reference(query, keys, dims, compact=compact)
