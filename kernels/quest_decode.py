"""Quest's decode step in three kernels, for the fast path's static cache (`atskv.hook.decode`).

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
  score, not by sorting the row (Triton's bitonic sort of 2K pages took 100 us): one program per
  row, since the search is a chain of reductions over the whole row; then many programs per row
  rank the chosen pages among themselves and lay out their slots (H200, 8 KV heads, 5%: 10.6 us
  at 2K pages and B=1, 22.7 us at 8K, against 15.4 and 61 us with one program doing all).

Each has a plain-torch reference with the same contract; tests compare them on random inputs.
"""

from __future__ import annotations

import math

import torch
from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.budget import budget_limit, kept_tokens

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
    lengths = kept_tokens(budget, context.view(-1, 1)).minimum(usable.sum(-1))
    return candidates.gather(-1, order).int(), lengths.int()


@jit
def _pick_best_kernel(
    score_ptr, out_ptr, n_rows, n_pages, n_best,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """One (row, KV head): the part that needs the whole row. Scores become order-preserving 32-bit
    keys; the n_best-th largest is built bit by bit from the top, each bit one count over the row
    (~150 ns of reduction latency at 2K pages, the search's whole cost), starting below the bits
    that the lowest and highest non-empty page share (0.8 us less at 2K random pages; with fewer
    non-empty pages than n_best, the answer is the empty pages' key). The pages above it, and the
    lowest-id ones at it, go to `out` (`[2, rows, n_best]` int32: keys, ids) in page order."""
    bh = tl.program_id(0).to(tl.int64)
    keys_at = out_ptr + bh * n_best
    p = tl.arange(0, BLOCK_P)
    score = tl.load(score_ptr + bh * n_pages + p, mask=p < n_pages, other=float("-inf")) + 0.0  # -0.0 -> 0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 in the scores' order
    key = tl.where(p < n_pages, key, -2147483648)  # padding below every page, -inf ones included
    unsigned = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # the same order, unsigned
    held = key > -2139095041  # above -inf's key: pages holding tokens
    n_held = tl.sum(held.to(tl.int32), 0)
    high = tl.max(key, 0)
    differ = (tl.min(tl.where(held, key, high), 0) ^ high).to(tl.uint32, bitcast=True)
    top = tl.full([], 0, tl.int32)  # the highest bit where the lowest and highest held keys differ
    for width in tl.static_range(5):
        shift = 16 >> width
        top = tl.where((differ >> (top + shift).to(tl.uint32)) != 0, top + shift, top)
    top = tl.where(differ != 0, top, -1)
    one = tl.full([], 1, tl.uint32)
    below = tl.where(top < 0, 0, (one << tl.maximum(top, 0).to(tl.uint32)) * 2 - 1)  # bits up to `top`
    threshold = (high ^ -2147483648).to(tl.uint32, bitcast=True) & ~below
    threshold = tl.where(n_held < n_best, tl.full([], 0x007FFFFF, tl.uint32), threshold)  # -inf's, unsigned
    passes = tl.where(n_held < n_best, 0, top + 1)
    at_least = tl.full([], BLOCK_P + 1, tl.int32)  # keys at or above the threshold (BLOCK_P + 1: unknown)
    above = tl.where(n_held < n_best, n_held, 0)  # keys above it: at or above the last trial that failed
    for i in range(0, passes):  # the largest threshold at least n_best keys reach
        unit = one << (passes - 1 - i).to(tl.uint32)
        count = tl.sum((unsigned >= threshold + unit).to(tl.int32), 0)
        take = count >= n_best
        threshold = tl.where(take, threshold + unit, threshold)
        at_least = tl.where(take, count, at_least)
        above = tl.where(take, above, count)
    tie = unsigned == threshold
    need = n_best - above
    if at_least - above > need:  # more pages tie at the threshold than are needed: the lowest ids
        chosen = (unsigned > threshold) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
    else:
        chosen = unsigned >= threshold
    at = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(keys_at + at, key, mask=chosen)
    tl.store(keys_at + n_rows * n_best + at, p, mask=chosen)


@jit
def _pick_layout_kernel(
    chosen_ptr, valid_ptr, ctx_ptr, idx_ptr, len_ptr,
    n_rows, n_kv_heads, n_slots, n_best, budget,
    sv_b, sv_h, sv_s,
    FRACTION: tl.constexpr, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and CHUNK of its chosen pages, in parallel: a page's rank is how many
    chosen pages go ahead of it (higher key, or equal key and lower id), and its usable slots go
    after those of the pages ahead, its other slots after every usable slot and after the other
    slots of the pages ahead. The chosen pages are read BLOCK_J at a time, their usable slots
    counted here, each page's slots in one contiguous read (counting them in `_pick_best_kernel`,
    a masked gather per slot over the whole row, cost it 4 us at 2K pages, 13 at 8K)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_kv_heads
    h = bh % n_kv_heads
    keys_at = chosen_ptr + bh * n_best
    ids_at = keys_at + n_rows * n_best
    valid_at = valid_ptr + b * sv_b + h * sv_h
    i = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mine = i < n_best
    ki = tl.load(keys_at + i, mask=mine, other=0)[:, None]
    page = tl.load(ids_at + i, mask=mine, other=0)[:, None]
    o = tl.arange(0, BLOCK_SIZE)[None, :]
    raw = page * SIZE + (SIZE - 1 - o)  # [CHUNK, BLOCK_SIZE], newest first
    present = mine[:, None] & (o < SIZE)
    in_range = present & (raw < n_slots)
    slot = tl.minimum(raw, n_slots - 1)
    usable = in_range & (tl.load(valid_at + slot * sv_s, mask=in_range, other=0) != 0)
    rank = tl.zeros([CHUNK, BLOCK_J], tl.int32)
    usable_ahead = tl.zeros([CHUNK, BLOCK_J], tl.int32)
    total = tl.zeros([BLOCK_J], tl.int32)
    for js in range(0, n_best, BLOCK_J):
        j = js + tl.arange(0, BLOCK_J)
        kj = tl.load(keys_at + j, mask=j < n_best, other=0)[None, :]
        pj = tl.load(ids_at + j, mask=j < n_best, other=0)
        at = pj[:, None] * SIZE + o  # oldest first: contiguous
        ok = (j < n_best)[:, None] & (o < SIZE) & (at < n_slots)
        uj = tl.sum((tl.load(valid_at + at * sv_s, mask=ok, other=0) != 0).to(tl.int32), 1)
        ahead = (j < n_best)[None, :] & ((kj > ki) | ((kj == ki) & (pj[None, :] < page)))
        rank += ahead.to(tl.int32)
        usable_ahead += tl.where(ahead, uj[None, :], 0)
        total += uj
    rank = tl.sum(rank, 1)[:, None]
    usable_ahead = tl.sum(usable_ahead, 1)[:, None]
    total = tl.sum(total, 0)
    spare = present & ~usable
    u, x = usable.to(tl.int32), spare.to(tl.int32)
    at_usable = usable_ahead + tl.cumsum(u, 1) - u
    at_spare = total + rank * SIZE - usable_ahead + tl.cumsum(x, 1) - x
    tl.store(idx_ptr + bh * n_best * SIZE + tl.where(usable, at_usable, at_spare), slot, mask=present)
    if tl.program_id(1) == 0:
        limit = budget_limit(tl.load(ctx_ptr + b), budget, FRACTION)
        tl.store(len_ptr + bh, tl.minimum(limit, total).to(tl.int32))


def quest_pick_triton(
    page_scores, valid, budget: int | float, context, n_pages: int, page_size: int,
    num_warps: int | None = None, chunk: int = 16, block_j: int = 64,
):  # fmt: skip
    """Two kernels: per row, the search for the chosen pages (sequential over the row: one program
    each, `num_warps` of them, by row length if None); then their ranks and slots, `chunk` pages
    per program reading `block_j` at a time (one program per row did it in 7 us at 2K pages, 45
    at 8K). `benchmarks/quest_pick_timing.py` times the kernels and sweeps these knobs."""
    chosen = pick_best(page_scores, n_pages, num_warps)
    return pick_layout(chosen, valid, budget, context, page_size, chunk, block_j)


def pick_best(page_scores, n_pages: int, num_warps: int | None = None) -> torch.Tensor:
    """`quest_pick_triton`'s first kernel: the chosen pages' keys and ids `[2, B * Hkv, n_pages]`."""
    b, hkv, pages = page_scores.shape
    out = torch.empty(2, b * hkv, n_pages, dtype=torch.int32, device=page_scores.device)
    block_p = triton.next_power_of_2(pages)
    _pick_best_kernel[(b * hkv,)](page_scores.contiguous(), out, b * hkv, pages, n_pages, BLOCK_P=block_p,
                                  num_warps=num_warps or (4 if block_p <= 2048 else 8))  # fmt: skip
    return out


def pick_layout(chosen, valid, budget: int | float, context, page_size: int, chunk: int = 16, block_j: int = 64):
    """`quest_pick_triton`'s second kernel: slot ids and lengths from `pick_best`'s chosen pages."""
    b, hkv = valid.shape[:2]
    n_pages = chosen.shape[-1]
    indices = torch.empty(b, hkv, n_pages * page_size, dtype=torch.int32, device=chosen.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=chosen.device)
    _pick_layout_kernel[(b * hkv, triton.cdiv(n_pages, chunk))](
        chosen, valid.view(torch.uint8) if valid.dtype == torch.bool else valid, context.reshape(-1).contiguous(),
        indices, lengths, b * hkv, hkv, valid.shape[-1], n_pages, budget, *valid.stride(),
        FRACTION=isinstance(budget, float), SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size),
        BLOCK_J=min(block_j, triton.next_power_of_2(n_pages)), CHUNK=chunk,
    )  # fmt: skip
    return indices, lengths
