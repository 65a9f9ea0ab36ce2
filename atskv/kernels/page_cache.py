"""A GPU page cache for pages read back from a host tier: its least-recently-used bookkeeping
(`assign_slots`, the fast path's and the plugin's), and the plugin's whole decode step after the
page ranking in one kernel a layer (`parked_read`).

A step of the plugin's host tier (`atskv.runtime.vllm.host_tier`) takes each row's best parked
pages, finds or assigns them cache blocks, and lists their parked tokens after the row's own
read list. In torch that is ~35 small kernels a layer (gathers and write-backs of the maps,
scans, scatters), most of the tier's cost beside the page copy and the ranking itself in an
H100 profile at 32K x 8; the kernel is one program a (row, KV head).
"""

from __future__ import annotations

import torch

from atskv.kernels.backend import jit, tl, triton, use_triton


def assign_slots(slot_of, page_in, used, clock, pages) -> tuple[torch.Tensor, torch.Tensor]:
    """A page cache's bookkeeping for one read of `pages` `[N, Hkv, R]` (distinct per row), in
    place: `slot_of` `[N, Hkv, P + 1]` (-1: not cached; last: a sink), `page_in` `[N, Hkv, C + 1]`
    (last: a sink), `used` `[N, Hkv, C]` each slot's last read (`clock` `[1]`, already moved on).
    The missing pages take the least recently used slots no page of this read holds, the lowest
    slot first among equals. Returns each page's slot and whether it was there already (a hit:
    nothing to copy)."""
    r = pages.shape[-1]
    slot = slot_of.gather(2, pages)
    hit = slot >= 0
    slots = used.shape[-1]  # a hit's slot is busy; a miss marks the extra last column (the hits' must not be undone)
    busy = torch.zeros(*used.shape[:2], slots + 1, dtype=torch.bool, device=used.device)
    busy = busy.scatter_(2, torch.where(hit, slot, slots), True)[..., :slots]
    order = used * (slots + 1) + torch.arange(slots, device=used.device)  # distinct: ties go to the lowest slot
    free = order.masked_fill(busy, torch.iinfo(torch.long).max).topk(r, dim=-1, largest=False).indices
    slot = torch.where(hit, slot, free.gather(2, ((~hit).cumsum(-1) - 1).clamp(min=0)))
    sink_page = slot_of.shape[-1] - 1
    slot_of.scatter_(2, torch.where(hit, sink_page, page_in.gather(2, slot)), -1)  # evicted pages
    slot_of.scatter_(2, pages, slot)
    page_in.scatter_(2, slot, pages)
    used.scatter_(2, slot, clock.expand_as(slot))
    return slot, hit


def parked_read(best, parked_in_page, rows, slot_of, page_in, used, clock, fetched, cache_start, block_table,
                parked, positions, lengths, block_size: int):  # fmt: skip
    """One decode step of the plugin's host tier after the page ranking. Rows `b` of region
    `rows[b]` (`[B]`; the spare last region: none) read their best pages `best` `[B, Hkv, R]`,
    those holding parked tokens (`parked_in_page` `[S, Hkv, P]`, a count a page) wanted. In place
    on the regions' cache maps `slot_of` `[S, Hkv, P + 1]`, `page_in` `[S, Hkv, C + 1]`, `used`
    `[S, Hkv, C]` (`assign_slots`, `clock` `[1]` already moved on) and `fetched` `[1]` (+ the
    misses). A page's cache block is `block_table[b]`'s logical block `cache_start[rows[b]] /
    block_size` + its slot. Returns the read list: `positions` `[B, Hkv, K]`'s first `lengths`
    `[B, Hkv]`, then the parked tokens (`parked` `[S, Hkv, P * block_size]` bool) of the wanted
    pages at their cached positions, zeros after, `[B, Hkv, K + R * block_size + 1]`; its counts;
    and for the page copy each page's block `[B, Hkv, R]` and whether it must be fetched (wanted
    and missed)."""
    if use_triton(positions):
        return parked_read_triton(best, parked_in_page, rows, slot_of, page_in, used, clock, fetched, cache_start,
                                  block_table, parked, positions, lengths, block_size)  # fmt: skip
    return parked_read_reference(best, parked_in_page, rows, slot_of, page_in, used, clock, fetched, cache_start,
                                 block_table, parked, positions, lengths, block_size)  # fmt: skip


def parked_read_reference(best, parked_in_page, rows, slot_of, page_in, used, clock, fetched, cache_start,
                          block_table, parked, positions, lengths, size: int):  # fmt: skip
    """Plain torch: the regions' maps gathered by row, `assign_slots`, written back."""
    b, kv_heads, _ = best.shape
    wanted = parked_in_page[rows].gather(2, best) > 0
    maps = [m[rows] for m in (slot_of, page_in, used)]
    slot, hit = assign_slots(*maps, clock, best)
    for m, new in zip((slot_of, page_in, used), maps):
        m[rows] = new
    first = cache_start[rows].view(-1, 1, 1) + slot * size  # each page's first logical position
    logical_block = (first // size).clamp(max=block_table.shape[1] - 1).view(b, -1)
    blocks = block_table.long().gather(1, logical_block).view(first.shape)
    missing = wanted & ~hit
    fetched += missing.sum()
    within = torch.arange(size, device=rows.device)
    tokens = (best.unsqueeze(-1) * size + within).flatten(-2)
    heads = torch.arange(kv_heads, device=rows.device).view(1, -1, 1)
    read = wanted.repeat_interleave(size, dim=-1) & parked[rows.view(-1, 1, 1), heads, tokens]
    listed = torch.cat([positions, positions.new_zeros(b, kv_heads, tokens.shape[-1] + 1)], -1)
    at = torch.where(read, lengths.unsqueeze(-1) + read.cumsum(-1) - 1, listed.shape[-1] - 1)
    listed.scatter_(2, at.long(), (first.unsqueeze(-1) + within).flatten(-2).to(listed.dtype))
    counts = lengths + read.sum(-1).to(lengths.dtype)
    listed.masked_fill_(torch.arange(listed.shape[-1], device=rows.device) >= counts.unsqueeze(-1), 0)
    return listed, counts, blocks, missing


@jit
def _parked_read_kernel(best_ptr, count_ptr, rows_ptr, slot_of_ptr, page_in_ptr, used_ptr, clock_ptr, fetched_ptr,
                        cache_start_ptr, table_ptr, parked_ptr, positions_ptr, lengths_ptr, listed_ptr, counts_ptr,
                        blocks_ptr, missing_ptr, H, R, C, P, W, K, SPARE, stride_table, SIZE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    item = tl.program_id(0)  # one (row, KV head)
    b, h = item // H, item % H
    region = tl.load(rows_ptr + b)
    r = tl.arange(0, BLOCK_R)
    own = (r * 0 + region) != SPARE  # a row without a region lists its own tokens alone and touches no map
    c = tl.arange(0, BLOCK_C)
    in_r, in_c = r < R, c < C
    best = tl.load(best_ptr + item * R + r, mask=in_r, other=0)
    line = region * H + h  # this (region, head)'s maps
    wanted = tl.load(count_ptr + line * P + best, mask=in_r, other=0) > 0
    slot = tl.load(slot_of_ptr + line * (P + 1) + best, mask=in_r, other=-1)
    hit = (slot >= 0) & in_r
    busy = tl.max(((slot[:, None] == c[None, :]) & hit[:, None]).to(tl.int32), axis=0) != 0
    used = tl.load(used_ptr + line * C + c, mask=in_c, other=0)
    order = tl.where(busy | ~in_c, 9223372036854775807, used * (C + 1) + c)
    rank = tl.sum((order[None, :] < order[:, None]).to(tl.int32), axis=1)  # each slot's place, least used first
    miss = in_r & ~hit
    nth_miss = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    chosen = tl.sum(tl.where(rank[None, :] == nth_miss[:, None], c[None, :], 0), axis=1)
    slot = tl.where(hit, slot, chosen)
    evicted = tl.load(page_in_ptr + line * (C + 1) + slot, mask=miss, other=P)
    tl.debug_barrier()  # every map read before any is written
    write = in_r & own
    tl.store(slot_of_ptr + line * (P + 1) + evicted, -1, mask=miss & own)
    tl.store(slot_of_ptr + line * (P + 1) + best, slot, mask=write)
    tl.store(page_in_ptr + line * (C + 1) + slot, best, mask=write)
    tl.store(used_ptr + line * C + slot, tl.load(clock_ptr) + tl.zeros_like(slot), mask=write)
    first = tl.load(cache_start_ptr + region).to(tl.int64) + slot * SIZE
    logical = tl.minimum(first // SIZE, W - 1)
    block = tl.load(table_ptr + b * stride_table + logical, mask=in_r, other=0).to(tl.int64)
    missing = wanted & miss
    tl.store(blocks_ptr + item * R + r, block, mask=in_r)
    tl.store(missing_ptr + item * R + r, missing.to(tl.int8), mask=in_r)
    tl.atomic_add(fetched_ptr, tl.sum(missing.to(tl.int64), axis=0))
    # the wanted pages' parked tokens, page by page, after the row's own list
    t = tl.arange(0, SIZE)
    token = best[:, None] * SIZE + t[None, :]
    read = tl.load(parked_ptr + line * (P * SIZE) + token, mask=in_r[:, None] & wanted[:, None], other=0) != 0
    per_page = tl.sum(read.to(tl.int32), axis=1)
    before = tl.cumsum(per_page, axis=0) - per_page  # the parked tokens listed before each page's
    length = tl.load(lengths_ptr + item)
    at = length + before[:, None] + tl.cumsum(read.to(tl.int32), axis=1) - 1
    width = K + R * SIZE + 1
    count = length + tl.sum(per_page, axis=0)
    tl.store(listed_ptr + item * width + at, (first[:, None] + t[None, :]).to(listed_ptr.dtype.element_ty), mask=read)
    for start in range(0, width, BLOCK_K):  # the row's own entries, and zeros after the count
        j = start + tl.arange(0, BLOCK_K)
        mine = tl.load(positions_ptr + item * K + j, mask=(j < length) & (j < K), other=0)
        tl.store(listed_ptr + item * width + j, mine, mask=(j < width) & ((j < length) | (j >= count)))
    tl.store(counts_ptr + item, count)


def parked_read_triton(best, parked_in_page, rows, slot_of, page_in, used, clock, fetched, cache_start, block_table,
                       parked, positions, lengths, size: int):  # fmt: skip
    b, kv_heads, r = best.shape
    k = positions.shape[-1]
    pages, slots = slot_of.shape[-1] - 1, used.shape[-1]
    if size & (size - 1):
        raise ValueError(f"parked_read needs a power-of-two block size, got {size}")
    for name, t in (("slot_of", slot_of), ("page_in", page_in), ("used", used), ("parked", parked),
                    ("parked_in_page", parked_in_page)):
        if not t.is_contiguous():
            raise ValueError(f"parked_read needs a contiguous {name}")
    positions, lengths = positions.contiguous(), lengths.contiguous()
    listed = positions.new_empty(b, kv_heads, k + r * size + 1)
    counts = torch.empty_like(lengths)
    blocks = torch.empty(b, kv_heads, r, dtype=torch.long, device=best.device)
    missing = torch.empty(b, kv_heads, r, dtype=torch.int8, device=best.device)
    _parked_read_kernel[(b * kv_heads,)](
        best.contiguous(), parked_in_page, rows.contiguous(), slot_of, page_in, used, clock,
        fetched, cache_start, block_table, parked.view(torch.int8), positions, lengths, listed, counts, blocks,
        missing, kv_heads, r, slots, pages, block_table.shape[1], k, slot_of.shape[0] - 1, block_table.stride(0),
        SIZE=size, BLOCK_R=triton.next_power_of_2(r), BLOCK_C=triton.next_power_of_2(slots), BLOCK_K=1024,
    )  # fmt: skip
    return listed, counts, blocks, missing.view(torch.bool)
