"""Quest's decode step in two kernels, for the fast path's static cache (`atskv.hook.decode`).

The unfused step ran ~40 small torch kernels per layer (a page recompute by gather/scatter, the
page scores, a mask of empty pages, `topk`, candidate slots, a stable `argsort`), 165 us at the
Llama-3-8B shape, 32K, B=1 against ~52 us for SDPA over the whole context. Here:

- `quest_step_scores`: the page the new token went to gets its bounds and held count recomputed
  from its slots, in place, by the program that scores it; every page is scored against the
  query (max over the GQA group of `sum_d max(q_d lo_d, q_d hi_d)`, float32); a page holding no
  token scores -inf.
- `quest_pick`: per (row, KV head), the `n_pages` best pages in rank order, then their slots,
  newest first within a page, usable ones (in range and held) first in that order, the rest
  after them; and how many count: the row's budget, at most its usable slots. This is the index
  list the sparse decode kernel reads. The best pages are found by a search for the n-th largest
  score and ranked among themselves, not by sorting the row (Triton's bitonic sort of 2K pages
  took 100 us).

Each has a plain-torch reference with the same contract; tests compare them on random inputs.
"""

from __future__ import annotations

import math

import torch
from atskv.kernels.backend import jit, tl, triton, use_triton

from atskv.kernels.quest import masked_page_bounds, quest_page_scores_reference


def quest_step_scores(query, low, high, held, keys, slot_pos, write_slot, page_size: int) -> torch.Tensor:
    """Page scores `[B, Hkv, P]` (float32, -inf for pages holding nothing) after updating, in place,
    the bounds `low`/`high` `[B, Hkv, P, D]` and held counts `held` `[B, Hkv, P]` (int32) of the page
    holding `write_slot` `[B, Hkv]` (the slot a decode token was just written to). `query` `[B, Hq, D]`,
    `keys` `[B, Hkv, S, D]`, `slot_pos` `[B, Hkv, S]` (-1: free). An empty page's bounds are zeros."""
    if use_triton(query):
        return quest_step_scores_triton(query, low, high, held, keys, slot_pos, write_slot, page_size)
    return quest_step_scores_reference(query, low, high, held, keys, slot_pos, write_slot, page_size)


def quest_step_scores_reference(query, low, high, held, keys, slot_pos, write_slot, page_size: int) -> torch.Tensor:
    slots = keys.shape[2]
    page = (write_slot // page_size).unsqueeze(-1)  # [B, Hkv, 1]
    members = page * page_size + torch.arange(page_size, device=page.device)  # [B, Hkv, size]
    in_range = members < slots
    members = members.clamp(max=slots - 1)
    ok = in_range & (slot_pos.gather(2, members) >= 0)
    page_keys = keys.gather(2, members.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    lo, hi = masked_page_bounds(page_keys, ok, page_size)  # [B, Hkv, 1, D]
    index = page.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    low.scatter_(2, index, lo)
    high.scatter_(2, index, hi)
    held.scatter_(2, page, ok.sum(-1, keepdim=True, dtype=held.dtype))
    scores = quest_page_scores_reference(query, low, high)
    return scores.masked_fill(held == 0, -math.inf)


@jit
def _step_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, held_ptr, k_ptr, pos_ptr, w_ptr, out_ptr,
    n_kv_heads, n_pages, n_slots, head_dim,
    sq_b, sq_h, sq_d,
    sl_b, sl_h, sl_p, sl_d,
    sh_b, sh_h, sh_p, sh_d,
    sc_b, sc_h, sc_p,
    sk_b, sk_h, sk_s, sk_d,
    sp_b, sp_h, sp_s,
    sw_b, sw_h,
    GROUP: tl.constexpr, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and BLOCK_P pages; the program whose pages include the written one
    recomputes it first (no other program reads it)."""
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = bh % n_kv_heads
    first = tl.program_id(1) * BLOCK_P
    p = first + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    tile = (p < n_pages)[:, None] & d_ok[None, :]
    lo_at = lo_ptr + b * sl_b + h * sl_h + p[:, None] * sl_p + d[None, :] * sl_d
    hi_at = hi_ptr + b * sh_b + h * sh_h + p[:, None] * sh_p + d[None, :] * sh_d
    lo = tl.load(lo_at, mask=tile, other=0.0).to(tl.float32)
    hi = tl.load(hi_at, mask=tile, other=0.0).to(tl.float32)
    count = tl.load(held_ptr + b * sc_b + h * sc_h + p * sc_p, mask=p < n_pages, other=0)
    page = tl.load(w_ptr + b * sw_b + h * sw_h) // SIZE
    if (page >= first) & (page < first + BLOCK_P):
        o = tl.arange(0, BLOCK_SIZE)
        slot = page * SIZE + o
        in_range = (o < SIZE) & (slot < n_slots)
        ok = in_range & (tl.load(pos_ptr + b * sp_b + h * sp_h + slot * sp_s, mask=in_range, other=-1) >= 0)
        rows = tl.load(k_ptr + b * sk_b + h * sk_h + slot[:, None] * sk_s + d[None, :] * sk_d,
                       mask=ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        new_count = tl.sum(ok.to(tl.int32), 0)
        new_lo = tl.min(tl.where(ok[:, None], rows, float("inf")), 0)
        new_hi = tl.max(tl.where(ok[:, None], rows, float("-inf")), 0)
        new_lo = tl.where(new_count > 0, new_lo, 0.0).to(lo_ptr.dtype.element_ty)
        new_hi = tl.where(new_count > 0, new_hi, 0.0).to(hi_ptr.dtype.element_ty)
        tl.store(lo_ptr + b * sl_b + h * sl_h + page * sl_p + d * sl_d, new_lo, mask=d_ok)
        tl.store(hi_ptr + b * sh_b + h * sh_h + page * sh_p + d * sh_d, new_hi, mask=d_ok)
        tl.store(held_ptr + b * sc_b + h * sc_h + page * sc_p, new_count)
        mine = (p == page)[:, None]
        lo = tl.where(mine, new_lo.to(tl.float32)[None, :], lo)
        hi = tl.where(mine, new_hi.to(tl.float32)[None, :], hi)
        count = tl.where(p == page, new_count, count)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(q_ptr + b * sq_b + (h * GROUP + g) * sq_h + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(tl.maximum(q[None, :] * lo, q[None, :] * hi), axis=1))
    best = tl.where(count > 0, best, float("-inf"))
    tl.store(out_ptr + bh.to(tl.int64) * n_pages + p, best, mask=p < n_pages)


def quest_step_scores_triton(query, low, high, held, keys, slot_pos, write_slot, page_size: int) -> torch.Tensor:
    b, hq, d = query.shape
    hkv, pages = low.shape[1], low.shape[2]
    out = torch.empty(b, hkv, pages, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(d)
    block_p = max(16, min(128, 4096 // block_d))
    _step_scores_kernel[(b * hkv, triton.cdiv(pages, block_p))](
        query, low, high, held, keys, slot_pos, write_slot, out, hkv, pages, keys.shape[2], d,
        *query.stride(), *low.stride(), *high.stride(), *held.stride(), *keys.stride(), *slot_pos.stride(),
        *write_slot.stride(),
        GROUP=hq // hkv, SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size), BLOCK_P=block_p,
        BLOCK_D=block_d,
    )  # fmt: skip
    return out


def quest_pick(page_scores, valid, budget: int | float, context, n_pages: int, page_size: int):
    """Slot ids `[B, Hkv, n_pages * page_size]` (int32) of the `n_pages` best pages of `page_scores`
    `[B, Hkv, P]` (float32), newest first within a page, usable slots (in range, `valid` `[B, Hkv, S]`)
    first in that order and the others after them (clamped into range), and how many count per
    row `[B, Hkv]`: the row's budget (`budget` of `context` `[B]` tokens, `resolve_budget`'s rule), at
    most its usable slots. Pages of equal score rank lower page ids first."""
    if use_triton(page_scores):
        return quest_pick_triton(page_scores, valid, budget, context, n_pages, page_size)
    return quest_pick_reference(page_scores, valid, budget, context, n_pages, page_size)


def quest_pick_reference(page_scores, valid, budget: int | float, context, n_pages: int, page_size: int):
    slots = valid.shape[-1]
    # a stable descending sort ranks equal scores by page id, as the kernel's packed key does
    best = page_scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_pages]
    newest_first = torch.arange(page_size - 1, -1, -1, device=best.device)
    candidates = (best.unsqueeze(-1) * page_size + newest_first).flatten(-2)  # [B, Hkv, n * size]
    in_range = candidates < slots
    candidates = candidates.clamp(max=slots - 1)
    usable = in_range & valid.gather(-1, candidates)
    order = (~usable).to(torch.int8).argsort(dim=-1, stable=True)  # usable slots first, rank kept
    context = context.view(-1, 1)  # the budget in tokens: `resolve_budget`'s rule (kernels import no selectors)
    if isinstance(budget, float):
        limit = torch.clamp(torch.ceil(context * budget).long(), min=1).minimum(context)
    else:
        limit = context.clamp(max=budget)
    lengths = limit.minimum(usable.sum(-1))
    return candidates.gather(-1, order).int(), lengths.int()


@jit
def _pick_kernel(
    score_ptr, valid_ptr, ctx_ptr, scratch_ptr, idx_ptr, len_ptr,
    n_rows, n_kv_heads, n_pages, n_slots, n_best, budget,
    sv_b, sv_h, sv_s,
    FRACTION: tl.constexpr, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_BEST: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One (row, KV head). Scores become order-preserving 32-bit keys; the n_best-th largest is
    built bit by bit from the top (32 counting passes over the row in registers: a bitonic sort
    of thousands of pages took ~100 us); the pages above it, and the lowest-id ones at it, are
    ranked among themselves by pairwise comparison, a chunk of them against all at a time; their
    slots are then laid out. Scratch (`[3, rows, n_best]` int32: keys, ids, ranked ids) passes values
    between the program's threads, after a barrier."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_kv_heads
    h = bh % n_kv_heads
    keys_at = scratch_ptr + bh * n_best
    ids_at = keys_at + n_rows * n_best
    ranked_at = ids_at + n_rows * n_best
    p = tl.arange(0, BLOCK_P)
    score = tl.load(score_ptr + bh * n_pages + p, mask=p < n_pages, other=float("-inf")) + 0.0  # -0.0 -> 0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 in the scores' order
    key = tl.where(p < n_pages, key, -2147483648)  # padding below every page, -inf ones included
    unsigned = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # the same order, unsigned
    threshold = tl.full([], 0, tl.uint32)
    one = tl.full([], 1, tl.uint32)
    for bit in tl.static_range(32):  # the largest threshold at least n_best keys reach, bit by bit
        trial = threshold | (one << (31 - bit))
        threshold = tl.where(tl.sum((unsigned >= trial).to(tl.int32), 0) >= n_best, trial, threshold)
    above = unsigned > threshold
    tie = unsigned == threshold
    need = n_best - tl.sum(above.to(tl.int32), 0)
    chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
    at = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(keys_at + at, key, mask=chosen)
    tl.store(ids_at + at, p, mask=chosen)
    tl.debug_barrier()
    m = tl.arange(0, BLOCK_BEST)
    m_ok = m < n_best
    km = tl.load(keys_at + m, mask=m_ok, other=0)[None, :]  # every chosen page, read once
    im = tl.load(ids_at + m, mask=m_ok, other=0)[None, :]
    c = tl.arange(0, CHUNK)
    for js in range(0, n_best, CHUNK):  # rank a chunk: higher key first, lower page id among equals
        j_ok = js + c < n_best
        kj = tl.load(keys_at + js + c, mask=j_ok, other=0)[:, None]
        ij = tl.load(ids_at + js + c, mask=j_ok, other=0)[:, None]
        ahead = m_ok[None, :] & ((km > kj) | ((km == kj) & (im < ij)))
        tl.store(ranked_at + tl.sum(ahead.to(tl.int32), 1), tl.reshape(ij, [CHUNK]), mask=j_ok)
    tl.debug_barrier()
    j = tl.arange(0, BLOCK_BEST)
    page = tl.load(ranked_at + j, mask=j < n_best, other=0)
    o = tl.arange(0, BLOCK_SIZE)
    raw = page[:, None] * SIZE + (SIZE - 1 - o)[None, :]  # [BLOCK_BEST, BLOCK_SIZE], newest first
    present = (j < n_best)[:, None] & (o < SIZE)[None, :]
    in_range = present & (raw < n_slots)
    slot = tl.minimum(raw, n_slots - 1)
    usable = in_range & (tl.load(valid_ptr + b * sv_b + h * sv_h + slot * sv_s, mask=in_range, other=0) != 0)
    spare = present & ~usable
    u, x = usable.to(tl.int32), spare.to(tl.int32)
    u_page, x_page = tl.sum(u, 1), tl.sum(x, 1)
    total = tl.sum(u_page, 0)
    at_usable = (tl.cumsum(u_page, 0) - u_page)[:, None] + tl.cumsum(u, 1) - u
    at_spare = total + (tl.cumsum(x_page, 0) - x_page)[:, None] + tl.cumsum(x, 1) - x
    row = idx_ptr + bh * n_best * SIZE
    tl.store(row + tl.where(usable, at_usable, at_spare), slot, mask=present)
    context = tl.load(ctx_ptr + b)
    if FRACTION:
        limit = tl.maximum(tl.ceil(context.to(tl.float32) * budget), 1.0).to(tl.int64)
    else:
        limit = tl.full([], budget, tl.int64)
    tl.store(len_ptr + bh, tl.minimum(tl.minimum(limit, context), total).to(tl.int32))


def quest_pick_triton(page_scores, valid, budget: int | float, context, n_pages: int, page_size: int):
    b, hkv, pages = page_scores.shape
    scores, context = page_scores.contiguous(), context.reshape(-1).contiguous()
    scratch = torch.empty(3, b * hkv, n_pages, dtype=torch.int32, device=scores.device)
    indices = torch.empty(b, hkv, n_pages * page_size, dtype=torch.int32, device=scores.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=scores.device)
    block_p = triton.next_power_of_2(pages)
    _pick_kernel[(b * hkv,)](
        scores, valid.view(torch.uint8) if valid.dtype == torch.bool else valid, context, scratch, indices, lengths,
        b * hkv, hkv, pages, valid.shape[-1], n_pages, budget, *valid.stride(),
        FRACTION=isinstance(budget, float), SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size),
        BLOCK_P=block_p, BLOCK_BEST=triton.next_power_of_2(n_pages), CHUNK=64, num_warps=4 if block_p <= 2048 else 8,
    )  # fmt: skip
    return indices, lengths
