"""Quest page scores (Tang et al., 2024): an upper bound of each query's logits inside a page of keys.

A page keeps the element-wise min and max of its keys; for a query q the largest logit any key of
the page can reach is bounded by `sum_d max(q_d * min_d, q_d * max_d)`. The bound is taken per
query head and pooled over the GQA group with **max**: it stays an upper bound (of the largest
logit any head of the group can reach in the page), so a page one head needs sharply is not
outvoted by the heads that ignore it, which a sum would allow.
"""

from __future__ import annotations

import math

import torch

from atskv.attention import grouped_queries
from atskv.kernels.backend import jit, tl, triton, use_triton


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of keys `[B, Hkv, S, D]` over consecutive pages of `page_size`
    slots: two `[B, Hkv, ceil(S / page_size), D]` tensors; a last, partial page is bounded by the
    keys it holds."""
    b, h, s, d = keys.shape
    pages = math.ceil(s / page_size)
    pad = (0, 0, 0, pages * page_size - s)
    low = torch.nn.functional.pad(keys, pad, value=math.inf).view(b, h, pages, page_size, d).amin(3)
    high = torch.nn.functional.pad(keys, pad, value=-math.inf).view(b, h, pages, page_size, d).amax(3)
    return low, high


def masked_page_bounds(keys: torch.Tensor, held: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page min/max of `keys` `[B, Hkv, S, D]` over the slots `held` marks (`[B, Hkv, S]`); a page with
    none gets zeros (mask its score out)."""
    pad = -keys.shape[2] % size
    keys = torch.nn.functional.pad(keys, (0, 0, 0, pad)).unflatten(2, (-1, size))  # [B, Hkv, P, size, D]
    held = torch.nn.functional.pad(held, (0, pad)).unflatten(-1, (-1, size)).unsqueeze(-1)
    low = keys.masked_fill(~held, torch.inf).amin(3)
    high = keys.masked_fill(~held, -torch.inf).amax(3)
    empty = ~held.any(3)
    return low.masked_fill(empty, 0), high.masked_fill(empty, 0)


def quest_page_scores_reference(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Plain-torch `quest_page_scores`. Uses `max(q*lo, q*hi) = relu(q)*hi + min(q, 0)*lo` (valid
    since hi >= lo), i.e. two matmuls instead of a `[.., P, D]` product per query."""
    q, squeeze = _four_dims(query)
    q = grouped_queries(q.float(), page_min.shape[1])  # [B, Hkv, G, Tq, D]
    low, high = page_min.float().unsqueeze(2), page_max.float().unsqueeze(2)
    bound = q.clamp(min=0) @ high.transpose(-1, -2) + q.clamp(max=0) @ low.transpose(-1, -2)
    out = bound.amax(dim=2)  # [B, Hkv, Tq, P]
    return out.squeeze(2) if squeeze else out


@jit
def _quest_kernel(
    q_ptr, lo_ptr, hi_ptr, out_ptr,
    n_kv_heads, n_queries, n_pages, head_dim,
    sq_b, sq_h, sq_t, sq_d,
    sl_b, sl_h, sl_p, sl_d,
    sh_b, sh_h, sh_p, sh_d,
    so_b, so_h, so_t, so_p,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program: one (row, KV head, query) and BLOCK_P pages. The page bounds are read once and
    scored against every query head of the group."""
    row = tl.program_id(0)
    t = row % n_queries
    h = (row // n_queries) % n_kv_heads
    b = (row // (n_queries * n_kv_heads)).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    tile = (p < n_pages)[:, None] & (d < head_dim)[None, :]
    lo = tl.load(lo_ptr + b * sl_b + h * sl_h + p[:, None] * sl_p + d[None, :] * sl_d, mask=tile, other=0.0)
    hi = tl.load(hi_ptr + b * sh_b + h * sh_h + p[:, None] * sh_p + d[None, :] * sh_d, mask=tile, other=0.0)
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        q_head = q_ptr + b * sq_b + (h * GROUP + g) * sq_h + t * sq_t
        q = tl.load(q_head + d * sq_d, mask=d < head_dim, other=0.0).to(tl.float32)[None, :]
        best = tl.maximum(best, tl.sum(tl.maximum(q * lo, q * hi), axis=1))
    tl.store(out_ptr + b * so_b + h * so_h + t * so_t + p * so_p, best, mask=p < n_pages)


def quest_page_scores_triton(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Triton `quest_page_scores` (any strides; no copy of the bounds)."""
    q, squeeze = _four_dims(query)
    b, hq, tq, d = q.shape
    hkv, pages = page_min.shape[1], page_min.shape[2]
    out = torch.empty(b, hkv, tq, pages, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    block_p = max(16, min(128, 4096 // block_d))
    grid = (b * hkv * tq, triton.cdiv(pages, block_p))
    _quest_kernel[grid](
        q, page_min, page_max, out, hkv, tq, pages, d,
        *q.stride(), *page_min.stride(), *page_max.stride(), *out.stride(),
        GROUP=hq // hkv, BLOCK_P=block_p, BLOCK_D=block_d,
    )  # fmt: skip
    return out.squeeze(2) if squeeze else out


def quest_page_scores(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Quest bound of every page, max-pooled over each GQA group, float32.

    `query` `[B, Hq, D]` (one query per row) gives `[B, Hkv, P]`; `[B, Hq, Tq, D]` gives
    `[B, Hkv, Tq, P]`. `page_min`/`page_max` `[B, Hkv, P, D]` as built by `page_bounds`."""
    if use_triton(query):
        return quest_page_scores_triton(query, page_min, page_max)
    return quest_page_scores_reference(query, page_min, page_max)


def _four_dims(query: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (query.unsqueeze(2), True) if query.dim() == 3 else (query, False)
