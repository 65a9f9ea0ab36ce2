"""Quest page bounds over a paged KV cache (vLLM's layout), and the map from a request's logical
slots to the cache's physical ones.

A paged cache holds a layer's keys as `[num_blocks, block_size, Hkv, D]` physical blocks; request
`r`'s token `t` lives in block `block_table[r, t // block_size]` at offset `t % block_size`. Its
physical slot `block * block_size + offset` indexes the cache viewed as `[num_slots, Hkv, D]`; the
sparse decode kernel (`atskv.kernels.sparse_decode`, given the block table) makes that map itself
and reads a paged cache in place (`physical_slots` is the map in torch, for its reference).

One page is one cache block. Its bounds (Quest's element-wise key min and max) live per physical
block, `[num_blocks + 1, Hkv, D]` (the last row takes the writes of padding tokens): a block shared
by requests (prefix caching) is bounded once. `update_page_bounds` keeps them current from the
tokens each forward writes, without a host sync, so it runs inside CUDA graphs; `paged_page_scores`
scores every page of each request against its decode query through the block table.
"""

from __future__ import annotations

import math

import torch

from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.quest import quest_page_scores_reference


def empty_page_bounds(num_blocks: int, kv_heads: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, ...]:
    """Bounds `[num_blocks + 1, Hkv, D]` of a cache whose blocks hold nothing yet."""
    shape = (num_blocks + 1, kv_heads, head_dim)
    low = torch.full(shape, math.inf, dtype=dtype, device=device)
    return low, torch.full_like(low, -math.inf)


def update_page_bounds(low: torch.Tensor, high: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, block_size: int):
    """Folds the keys `[N, Hkv, D]` just written at physical `slots` `[N]` (int, -1: a padding token)
    into their blocks' bounds, in place. A token at offset 0 starts its block afresh (blocks fill in
    order, so that is a block's first token, also when the block is reused by another request); later
    tokens only widen it, whatever forward (prefill chunk or decode step) they arrive in."""
    n = slots.shape[0]
    keys, slots = keys[:n].to(low.dtype), slots.long()
    spare = low.shape[0] - 1
    real = slots >= 0
    block = torch.where(real, torch.div(slots, block_size, rounding_mode="floor"), spare)
    fresh = torch.where(real & (slots % block_size == 0), block, spare)
    low.index_fill_(0, fresh, math.inf)
    high.index_fill_(0, fresh, -math.inf)
    low.index_reduce_(0, block, keys, "amin")
    high.index_reduce_(0, block, keys, "amax")


def physical_slots(logical: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slot ids (int32, the shape of `logical` `[B, Hkv, K]`) of each request's logical
    slots; `block_table` `[B, W]`. Logical slots must be in `[0, W * block_size)`."""
    b = logical.shape[0]
    logical = logical.long()
    block = block_table.long().gather(1, (logical // block_size).view(b, -1)).view(logical.shape)
    return (block * block_size + logical % block_size).int()


def request_slots(table_row: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Physical slots (long) `[length]` of one request's positions `0 .. length - 1`, its block
    table row `table_row` `[W]` (`physical_slots` for a single request in order)."""
    positions = torch.arange(length, device=table_row.device).view(1, 1, -1)
    return physical_slots(positions, table_row.view(1, -1), block_size).view(-1).long()


def paged_page_scores(query, low, high, block_table, seq_lens, block_size: int) -> torch.Tensor:
    """Quest bound of every logical page of each request, max-pooled over the GQA group: float32
    `[B, Hkv, W]`, -inf past the request's last page. `query` `[B, Hq, D]` (one decode query per
    request), `low`/`high` `[num_blocks + 1, Hkv, D]`, `block_table` `[B, W]`, `seq_lens` `[B]`."""
    if use_triton(query):
        return paged_page_scores_triton(query, low, high, block_table, seq_lens, block_size)
    return paged_page_scores_reference(query, low, high, block_table, seq_lens, block_size)


def paged_page_scores_reference(query, low, high, block_table, seq_lens, block_size: int) -> torch.Tensor:
    """Plain torch: gather each request's page bounds `[B, Hkv, W, D]` and score them as Quest does."""
    page_low = low[block_table.long()].transpose(1, 2)
    page_high = high[block_table.long()].transpose(1, 2)
    scores = quest_page_scores_reference(query, page_low, page_high)
    pages = torch.arange(block_table.shape[1], device=query.device)
    used = pages < torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor").view(-1, 1, 1)
    return scores.masked_fill(~used, -math.inf)


def paged_page_scores_triton(query, low, high, block_table, seq_lens, block_size: int) -> torch.Tensor:
    """One program: one (request, KV head) and BLOCK_P pages, their bounds gathered through the block
    table and scored against the group's query heads by two tensor-core products
    (`max(q lo, q hi) = relu(q) hi + min(q, 0) lo`, since hi >= lo)."""
    return _launch_page_scores(query, low, high, block_table, seq_lens, block_table.shape[1], block_size)


def region_page_scores(query, low, high, rows, held, counts, pages: int, block_size: int) -> torch.Tensor:
    """A host tier's page scores (`atskv.runtime.vllm.host_tier`): row `b` scores the pages of its
    region `rows[b]` (`[B]`), page p of region r bounded by `low`/`high` row `r * pages + p`, as
    `paged_page_scores` scores a request's; -inf past the region's `held` `[S]` tokens and where
    `counts` `[S, Hkv, pages]` (its parked tokens a page) is 0. `[B, Hkv, pages]` float32."""
    if use_triton(query):
        return _launch_page_scores(query, low, high, rows, held, pages, block_size, counts)
    region = rows.clamp(max=(low.shape[0] - 1) // pages - 1)  # a row without one: another's, none of it held
    table = region.view(-1, 1) * pages + torch.arange(pages, device=rows.device)  # a region's pages, in order
    scores = paged_page_scores_reference(query, low, high, table, held[rows], block_size)
    return scores.masked_fill(counts[rows] == 0, -math.inf)


def _launch_page_scores(query, low, high, table, lengths, width: int, block_size: int, counts=None):
    """`_paged_scores_kernel` over `table` (a block table, or with `counts` each row's region)."""
    b, hq, d = query.shape
    hkv = low.shape[1]
    out = torch.empty(b, hkv, width, dtype=torch.float32, device=query.device)
    block_p = 64
    grid = (b * hkv, triton.cdiv(width, block_p))
    _paged_scores_kernel[grid](
        query, low, high, table, lengths, table if counts is None else counts, out, hkv, width, block_size,
        *query.stride(), *low.stride(), table.stride(0), table.stride(-1),
        GROUP=hq // hkv, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), HEAD_DIM=d, BLOCK_P=block_p,
        REGIONS=counts is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        UPCAST_DOT=not query.is_cuda, num_warps=4, **dependent_launch(query, grid),
    )  # fmt: skip
    return out


@jit
def _paged_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, table_ptr, len_ptr, count_ptr, out_ptr, num_kv_heads, width, block_size,
    stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_nd, stride_tb, stride_tw,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    REGIONS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`REGIONS`: `table_ptr` holds each row's region, whose `width` pages are its bound rows from
    region * width on, `len_ptr` each region's held tokens and `count_ptr` its parked tokens a page."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // num_kv_heads, bh % num_kv_heads
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    owner = b
    if REGIONS:
        owner = tl.load(table_ptr + b * stride_tb).to(tl.int64)
    pages = (tl.load(len_ptr + owner).to(tl.int64) + block_size - 1) // block_size
    used = p < pages
    row = out_ptr + bh * width + p
    if tl.program_id(1) * BLOCK_P >= pages:  # past the request's last page
        tl.store(row, tl.full([BLOCK_P], float("-inf"), tl.float32), mask=p < width)
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    in_group = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=in_group[:, None], other=0.0)  # fmt: skip
    if REGIONS:  # a page with nothing parked scores -inf
        used &= tl.load(count_ptr + (owner * num_kv_heads + h) * width + p, mask=used, other=0) > 0
        block = owner * width + p
    else:
        block = tl.load(table_ptr + b * stride_tb + p * stride_tw, mask=used, other=0).to(tl.int64)
    at = block[:, None] * stride_nb + h * stride_nh + d[None, :] * stride_nd
    lo = tl.load(lo_ptr + at, mask=used[:, None], other=0.0)
    hi = tl.load(hi_ptr + at, mask=used[:, None], other=0.0)
    if UPCAST_DOT:  # Triton's interpreter multiplies bf16 as raw integers
        q, lo, hi = q.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32)
    zero = tl.zeros_like(q)
    positive, negative = tl.maximum(q, zero).to(hi.dtype), tl.minimum(q, zero).to(lo.dtype)  # max/min upcast bf16
    bound = tl.dot(positive, tl.trans(hi), input_precision=DOT_PRECISION)  # [G, P]
    bound += tl.dot(negative, tl.trans(lo), input_precision=DOT_PRECISION)
    bound = tl.where(in_group[:, None], bound, float("-inf"))
    best = tl.where(used, tl.max(bound, 0), float("-inf"))
    tl.store(row, best, mask=p < width)


def sink_recent_positions(seq_lens: torch.Tensor, budget: int | float, sinks: int, width: int, kv_heads: int):
    """StreamingLLM's read set as logical positions `[B, Hkv, width]` (int32) and how many count
    `[B, Hkv]`: the first `sinks` tokens, then the most recent ones up to the budget (`kept_tokens`'
    rule), the same for every KV head; past the count, position 0. One kernel on CUDA."""
    if use_triton(seq_lens):
        b = seq_lens.shape[0]
        positions = torch.empty(b, width, dtype=torch.int32, device=seq_lens.device)
        lengths = torch.empty(b, dtype=torch.int32, device=seq_lens.device)
        block = 1024
        grid = (b, triton.cdiv(width, block))
        _sink_recent_kernel[grid](seq_lens, positions, lengths, width, budget, sinks,
                                  FRACTION=isinstance(budget, float), BLOCK=block,
                                  **dependent_launch(seq_lens, grid))  # fmt: skip
    else:
        kept = kept_tokens(budget, seq_lens.long())
        j = torch.arange(width, device=seq_lens.device)
        recent = seq_lens.view(-1, 1).long() - kept.view(-1, 1) + j
        positions = torch.where(j < kept.clamp(max=sinks).view(-1, 1), j, recent)
        positions = torch.where(j < kept.view(-1, 1), positions, 0).int()
        lengths = kept.int()
    b = seq_lens.shape[0]
    return positions.unsqueeze(1).expand(b, kv_heads, width), lengths.view(-1, 1).expand(b, kv_heads)


@jit
def _sink_recent_kernel(len_ptr, pos_ptr, kept_ptr, width, budget, sinks, FRACTION: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    context = tl.load(len_ptr + b).to(tl.int64)
    kept = budget_limit(context, budget, FRACTION)
    position = tl.where(j < tl.minimum(kept, sinks), j, context - kept + j)
    tl.store(pos_ptr + b * width + j, tl.where(j < kept, position, 0).to(tl.int32), mask=j < width)
    if tl.program_id(1) == 0:
        tl.store(kept_ptr + b, kept.to(tl.int32))
