"""Quest's decode step in three kernels, for the fast path's static cache (`atskv.generate`).

The unfused step ran ~40 small torch kernels per layer (a page recompute by gather/scatter, the
page scores, a mask of empty pages, `topk`, candidate slots, a stable `argsort`), slower than SDPA
over the whole context: a selection that costs more than dense attention saves nothing. Here:

- `quest_step_scores`: the page the new token went to gets its bounds and held count recomputed
  from its slots, in place, by the program that scores it; every page is scored against the
  query (max over the GQA group of `sum_d max(q_d lo_d, q_d hi_d)`, float32); a page holding no
  token scores -inf.
- `quest_pick`: per (row, KV head), the `n_pages` best pages in rank order, then their slots,
  newest first within a page, usable ones (in range and held) first in that order, the rest
  after them; and how many count: the row's budget, at most its usable slots. This is the index
  list the sparse decode kernel reads. The best pages are found by a search for the n-th largest
  score, not by sorting the row (Triton's bitonic sort of a row of pages cost more than the
  whole step), a few bits per pass, by one program per row; a second kernel's many programs per
  row rank their share of the chosen pages among them and lay out their slots. A search of one bit
  per pass paid a pass's reduction latency per bit; one kernel whose every program repeated the
  search paid for the search once per program, which grows with the pages and the batch (the
  timings of each version: docs/results/kernel-notes.md).

Each has a plain-torch reference with the same contract; tests compare them on random inputs.
"""

from __future__ import annotations

import math

import torch

from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.quest import masked_page_bounds, quest_page_scores_reference

PICK_WARPS, PICK_RADIX = 8, 2  # the search's defaults (tuned on an H200: docs/results/kernel-notes.md)


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
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and BLOCK_P pages, or, for the last program of the row, the written
    page alone: it recomputes that page's bounds and count and scores it, while the others score
    the rest (skipping it), so its chain of dependent reads runs beside them, not before them
    (one program doing both finished after the others)."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = bh % n_kv_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    page = tl.load(w_ptr + b * sw_b + h * sw_h) // SIZE
    if tl.program_id(1) == tl.num_programs(1) - 1:  # (names apart from the other branch's: other shapes)
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
        one = tl.arange(0, 1)
        score = _bound_scores(q_ptr + b * sq_b + h * GROUP * sq_h, sq_h, d * sq_d, d_ok,
                              new_lo.to(tl.float32)[None, :], new_hi.to(tl.float32)[None, :], GROUP)  # fmt: skip
        tl.store(out_ptr + bh.to(tl.int64) * n_pages + page + one, tl.where(new_count > 0, score, float("-inf")))
    else:
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        tile = (p < n_pages)[:, None] & d_ok[None, :]
        lo = tl.load(lo_ptr + b * sl_b + h * sl_h + p[:, None] * sl_p + d[None, :] * sl_d, mask=tile, other=0.0)
        hi = tl.load(hi_ptr + b * sh_b + h * sh_h + p[:, None] * sh_p + d[None, :] * sh_d, mask=tile, other=0.0)
        count = tl.load(held_ptr + b * sc_b + h * sc_h + p * sc_p, mask=p < n_pages, other=0)
        best = _bound_scores(q_ptr + b * sq_b + h * GROUP * sq_h, sq_h, d * sq_d, d_ok, lo.to(tl.float32),
                             hi.to(tl.float32), GROUP)  # fmt: skip
        best = tl.where(count > 0, best, float("-inf"))
        tl.store(out_ptr + bh.to(tl.int64) * n_pages + p, best, mask=(p < n_pages) & (p != page))


@jit
def _bound_scores(q_at, sq_h, d_offsets, d_ok, lo, hi, GROUP: tl.constexpr):
    """Quest's score of pages `lo`/`hi` `[N, BLOCK_D]` (float32) for the GQA group whose first query
    head is at `q_at`: the max over its heads of `sum_d max(q_d lo_d, q_d hi_d)`, `[N]`."""
    q = tl.load(q_at + d_offsets, mask=d_ok, other=0.0).to(tl.float32)
    best = tl.sum(tl.maximum(q[None, :] * lo, q[None, :] * hi), axis=1)
    for g in tl.static_range(1, GROUP):
        q = tl.load(q_at + g * sq_h + d_offsets, mask=d_ok, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(tl.maximum(q[None, :] * lo, q[None, :] * hi), axis=1))
    return best


def quest_step_scores_triton(query, low, high, held, keys, slot_pos, write_slot, page_size: int) -> torch.Tensor:
    b, hq, d = query.shape
    hkv, pages = low.shape[1], low.shape[2]
    out = torch.empty(b, hkv, pages, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(d)
    block_p = max(16, min(128, 4096 // block_d))
    grid = (b * hkv, triton.cdiv(pages, block_p) + 1)  # the last program of a row: the written page
    _step_scores_kernel[grid](
        query, low, high, held, keys, slot_pos, write_slot, out, hkv, pages, keys.shape[2], d,
        *query.stride(), *low.stride(), *high.stride(), *held.stride(), *keys.stride(), *slot_pos.stride(),
        *write_slot.stride(),
        GROUP=hq // hkv, SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size), BLOCK_P=block_p,
        BLOCK_D=block_d, num_warps=2, **dependent_launch(query, grid),
    )  # fmt: skip
    return out


def quest_pick(page_scores, valid, budget: int | float, context, n_pages: int, page_size: int):
    """Slot ids `[B, Hkv, n_pages * page_size]` (int32) of the `n_pages` best pages of `page_scores`
    `[B, Hkv, P]` (float32), newest first within a page, usable slots (in range, `valid` `[B, Hkv, S]`:
    bools, or the slot positions, usable where >= 0, which spares the fast path a `slot_pos >= 0`
    kernel) first in that order and the others after them (clamped into range), and how many count per
    row `[B, Hkv]`: the row's budget (`budget` of `context` `[B]` tokens, `resolve_budget`'s rule), at
    most its usable slots. Pages of equal score rank lower page ids first."""
    if use_triton(page_scores):
        return quest_pick_triton(page_scores, valid, budget, context, n_pages, page_size)
    return quest_pick_reference(page_scores, valid, budget, context, n_pages, page_size)


def best_pages(page_scores, n_pages: int) -> torch.Tensor:
    """The `n_pages` best pages of each row of `page_scores` `[B, Hkv, P]` (float32) as ids
    `[B, Hkv, n_pages]` (long) in page order, equal scores to the lower id (-inf: pages that hold
    nothing, taken last): `quest_pick`'s search, for a caller that lays out its own reads (the
    plugin's host tier). One kernel on CUDA."""
    if use_triton(page_scores):
        b, hkv, _ = page_scores.shape
        return pick_best(page_scores.float(), n_pages, PICK_WARPS, PICK_RADIX)[1].view(b, hkv, n_pages).long()
    best = page_scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_pages]
    return best.sort(dim=-1).values


def quest_pick_reference(page_scores, valid, budget: int | float, context, n_pages: int, page_size: int):
    valid = valid if valid.dtype == torch.bool else valid >= 0
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
def _held_stats(n_a, high_a, low_a, n_b, high_b, low_b):
    return n_a + n_b, tl.maximum(high_a, high_b), tl.minimum(low_a, low_b)


@jit
def _digit_pick(j_a, least_a, fail_a, j_b, least_b, fail_b):
    return tl.maximum(j_a, j_b), tl.minimum(least_a, least_b), tl.maximum(fail_a, fail_b)


@jit
def _pick_best_kernel(
    score_ptr, out_ptr, n_rows, n_pages, n_best,
    BLOCK_P: tl.constexpr, RADIX: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head): the part that needs the whole row, once per row (repeated by every
    layout program, its cost grew with their number, most at many pages and large batches). Scores become
    order-preserving 32-bit keys, offset from the lowest held key; the n_best-th largest is
    narrowed RADIX bits per pass (one count of the row at 2**RADIX - 1 thresholds: a pass costs
    mostly its reduction's latency, which a bit-by-bit search paid per bit, ~26 passes)
    and stops as soon as the keys at or above the interval's floor are exactly n_best. The chosen
    pages go to `out` (`[2, rows, n_best]` int32: keys, ids) in page order."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0).to(tl.int64)
    keys_at = out_ptr + bh * n_best
    p = tl.arange(0, BLOCK_P)
    real = p < n_pages
    score = tl.load(score_ptr + bh * n_pages + p, mask=real, other=float("-inf")) + 0.0  # -0.0 -> 0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 in the scores' order
    held = real & (key > -2139095041)  # above -inf's key: pages holding tokens
    n_held, high, low = tl.reduce(
        (held.to(tl.int32), tl.where(held, key, -2147483648), tl.where(held, key, 2147483647)), 0, _held_stats
    )  # fmt: skip
    rel = tl.where(held, key - low, 0).to(tl.uint32, bitcast=True)  # from the lowest held key; 0 off the row
    span = (high - low).to(tl.uint32, bitcast=True)
    s = tl.full([], 0, tl.int32)  # bits that held keys span: the search's interval is [lo, lo + 2**s)
    for width in tl.static_range(5):
        half = 16 >> width
        s = tl.where((span >> (s + half).to(tl.uint32)) != 0, s + half, s)
    s = tl.where(span != 0, s + 1, 0)
    jj = tl.arange(0, 2**RADIX)
    lo = tl.full([], 0, tl.uint32)
    at_least = n_held  # keys at or above lo (only held ones count)
    above = tl.full([], 0, tl.int32)  # keys at or above lo + 2**s
    while (s > 0) & (at_least > n_best):  # n_held <= n_best: no search
        shift = tl.maximum(s - RADIX, 0)
        trial = lo + (jj.to(tl.uint32) << shift.to(tl.uint32))
        count = tl.sum((rel[:, None] >= trial[None, :]).to(tl.int32), 0)
        digit = (jj > 0) & (jj < (1 << (s - shift)))  # trials inside the interval (0: lo itself, known)
        take = digit & (count >= n_best)
        best, least, fail = tl.reduce(
            (tl.where(take, jj, 0), tl.where(take, count, at_least), tl.where(digit & ~take, count, above)), 0,
            _digit_pick,
        )  # fmt: skip
        lo = lo + (best.to(tl.uint32) << shift.to(tl.uint32))
        at_least, above, s = least, fail, shift
    fallback = n_held < n_best  # every held page, then the lowest-id empty ones
    if fallback | (at_least > n_best):  # more keys tie at the n_best-th than places are left: lowest ids
        tie = tl.where(fallback, real & ~held, held & (rel == lo))
        over = tl.where(fallback, held, held & (rel > lo))
        need = tl.where(fallback, n_best - n_held, n_best - above)
        chosen = over | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
    else:
        chosen = held & (rel >= lo)
    at = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(keys_at + at, key, mask=chosen)
    tl.store(keys_at + n_rows * n_best + at, p, mask=chosen)


@jit
def _usable(value, POSITIONS: tl.constexpr):
    return value >= 0 if POSITIONS else value != 0


@jit
def _pick_layout_kernel(
    chosen_ptr, valid_ptr, ctx_ptr, idx_ptr, len_ptr,
    n_rows, n_kv_heads, n_slots, n_best, budget,
    sv_b, sv_h, sv_s,
    FRACTION: tl.constexpr, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr,
    CHUNK: tl.constexpr, POSITIONS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and CHUNK of its chosen pages, in parallel: a page's rank is how many
    chosen pages go ahead of it (higher key, or equal key and lower id), and its usable slots go
    after those of the pages ahead, its other slots after every usable slot and after the other
    slots of the pages ahead. The chosen pages are read BLOCK_J at a time, their usable slots
    counted here, each page's slots in one contiguous read (counting them in `_pick_best_kernel`,
    a masked gather per slot over the whole row, serialised that work in its one program a row). POSITIONS:
    `valid` holds slot positions (usable where >= 0), else bools as bytes."""
    wait_for_inputs(PDL)
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
    usable = in_range & _usable(tl.load(valid_at + slot * sv_s, mask=in_range, other=-1), POSITIONS)
    rank = tl.zeros([CHUNK, BLOCK_J], tl.int32)
    usable_ahead = tl.zeros([CHUNK, BLOCK_J], tl.int32)
    total = tl.zeros([BLOCK_J], tl.int32)
    for js in range(0, n_best, BLOCK_J):
        j = js + tl.arange(0, BLOCK_J)
        kj = tl.load(keys_at + j, mask=j < n_best, other=0)[None, :]
        pj = tl.load(ids_at + j, mask=j < n_best, other=0)
        at = pj[:, None] * SIZE + o  # oldest first: contiguous
        ok = (j < n_best)[:, None] & (o < SIZE) & (at < n_slots)
        uj = tl.sum((ok & _usable(tl.load(valid_at + at * sv_s, mask=ok, other=-1), POSITIONS)).to(tl.int32), 1)
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
    *, num_warps: int = PICK_WARPS, radix: int = PICK_RADIX, chunk: int = 16, block_j: int = 64,
):  # fmt: skip
    """Two kernels: per row, the search for the chosen pages (one program each, `num_warps` of
    them, `radix` bits per pass); then their ranks and slots, `chunk` pages per program reading
    `block_j` at a time. Defaults tuned on an H200 (the sweeps: docs/results/kernel-notes.md): 8
    warps and 2 bits a pass for the search; chunk 16 and block_j 64 for the layout (one search per
    row makes many small layout programs cheap, where a pick repeating the search in every program
    needed far larger chunks)."""
    chosen = pick_best(page_scores, n_pages, num_warps, radix)
    return pick_layout(chosen, valid, budget, context, page_size, chunk, block_j)


def pick_best(page_scores, n_pages: int, num_warps: int, radix: int) -> torch.Tensor:
    """`quest_pick_triton`'s first kernel: the chosen pages' keys and ids `[2, B * Hkv, n_pages]`."""
    b, hkv, pages = page_scores.shape
    out = torch.empty(2, b * hkv, n_pages, dtype=torch.int32, device=page_scores.device)
    grid = (b * hkv,)
    _pick_best_kernel[grid](page_scores.contiguous(), out, b * hkv, pages, n_pages,
                                  BLOCK_P=triton.next_power_of_2(pages), RADIX=radix, num_warps=num_warps,
                                  **dependent_launch(page_scores, grid))  # fmt: skip
    return out


def pick_layout(chosen, valid, budget: int | float, context, page_size: int, chunk: int, block_j: int):
    """`quest_pick_triton`'s second kernel: slot ids and lengths from `pick_best`'s chosen pages."""
    b, hkv = valid.shape[:2]
    n_pages = chosen.shape[-1]
    indices = torch.empty(b, hkv, n_pages * page_size, dtype=torch.int32, device=chosen.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=chosen.device)
    grid = (b * hkv, triton.cdiv(n_pages, chunk))
    _pick_layout_kernel[grid](
        chosen, valid.view(torch.uint8) if valid.dtype == torch.bool else valid, context.reshape(-1).contiguous(),
        indices, lengths, b * hkv, hkv, valid.shape[-1], n_pages, budget, *valid.stride(),
        FRACTION=isinstance(budget, float), SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size),
        BLOCK_J=min(block_j, triton.next_power_of_2(n_pages)), CHUNK=chunk, POSITIONS=valid.dtype != torch.bool,
        **dependent_launch(chosen, grid),
    )  # fmt: skip
    return indices, lengths
