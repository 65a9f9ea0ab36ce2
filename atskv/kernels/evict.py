"""An evicting selector's decode eviction in one kernel, for the fast path's static cache.

Each (row, KV head) holds at most its budget + 1 tokens after the decode write. When it holds
more than its budget, its lowest-scoring held token goes (the oldest among equal scores, as the
reference's stable ranking does); a selector whose budget is a cap (`Selector.unwanted`, the
learned selector's threshold) also drops every held token it does not want, several at once
after a refresh of its scores. The reference's step keeps its top budget minus the unwanted, so
the one beyond the budget is ranked among every held token, wanted or not. The next token is
written into the slot beyond the budget, else into the first free one. In torch this was ~12
kernels per layer (a masked minimum, an argmin over positions, a count, the budget, a scatter,
`first_free`); here one program per (row, KV head) walks the slots once.
"""

from __future__ import annotations

import torch

from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.budget import budget_limit, kept_tokens


def evict_lowest(scores, slot_pos, context, budget: int | float, write_slot, unwanted=None,
                 recent: float = 0.0) -> torch.Tensor:  # fmt: skip
    """In place: frees (slot position -1) each over-budget row's lowest-scoring held slot of
    `slot_pos` `[B, Hkv, S]` (scores `[B, Hkv, S]`, any float dtype; ties to the oldest position)
    and every held slot of `unwanted` (`[B, Hkv, S]` bool, None: none), and sets `write_slot`
    `[B, Hkv]` to the slot the next token takes: the one freed beyond the budget, else the first
    free. `budget` of `context` `[B]` tokens by `resolve_budget`'s rule; the row's newest
    `int(budget tokens * recent)` held tokens by position score +inf whatever `scores` says (H2O's
    recent window, here rather than in ~8 torch kernels of its scores). Returns the position of
    the token freed beyond the budget `[B, Hkv]` (-1: none), what a host tier marks parked (the
    unwanted ones are the caller's `unwanted`)."""
    if use_triton(slot_pos):
        return evict_lowest_triton(scores, slot_pos, context, budget, write_slot, unwanted, recent)
    return evict_lowest_reference(scores, slot_pos, context, budget, write_slot, unwanted, recent)


def evict_lowest_reference(scores, slot_pos, context, budget: int | float, write_slot, unwanted=None,
                           recent: float = 0.0) -> torch.Tensor:  # fmt: skip
    held = slot_pos >= 0
    scores = scores.float().masked_fill(~held, torch.inf)
    if recent:
        scores = scores.masked_fill(newest_share(slot_pos, held, kept_tokens(budget, context.view(-1, 1, 1)), recent),
                                    torch.inf)  # fmt: skip
    lowest = scores.amin(-1, keepdim=True)
    oldest = slot_pos.masked_fill(~(held & (scores == lowest)), torch.iinfo(slot_pos.dtype).max)
    victim = oldest.argmin(-1, keepdim=True)  # [B, Hkv, 1]
    over = held.sum(-1, keepdim=True) > kept_tokens(budget, context.view(-1, 1, 1))
    victim_pos = slot_pos.gather(2, victim)
    drop = torch.zeros_like(held).scatter_(2, victim, over)
    slot_pos.masked_fill_(drop if unwanted is None else drop | unwanted, -1)
    write_slot.copy_(torch.where(over[..., 0], victim[..., 0], first_free(slot_pos)))
    return victim_pos.masked_fill(~over, -1)[..., 0]


def newest_share(slot_pos: torch.Tensor, usable: torch.Tensor, limit: torch.Tensor, share: float) -> torch.Tensor:
    """`[B, Hkv, S]` bool: each row's newest `int(limit * share)` usable slots by position (H2O's
    recent window; `limit` the row's budget in tokens, broadcast against `slot_pos`)."""
    newest = slot_pos.masked_fill(~usable, -1).amax(-1, keepdim=True)
    return usable & (slot_pos > newest - (limit * share).long())


def first_free(slot_pos: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv]`: the first free slot of every row (slot 0 where none is free): where the next
    token goes when nothing was evicted."""
    return (slot_pos < 0).to(torch.int8).argmax(-1)


@jit
def _evict_kernel(
    score_ptr, pos_ptr, ctx_ptr, write_ptr, freed_ptr, unwanted_ptr, n_kv_heads, n_slots, budget,
    ss_b, ss_h, ss_s, sp_b, sp_h, sp_s, sw_b, sw_h, su_b, su_h, su_s,
    recent,
    FRACTION: tl.constexpr, UNWANTED: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head): a running lexicographic minimum of (score, position) over held slots,
    the count of held slots and the first free one (an unwanted slot, freed on the way, is free),
    in one walk (after a first walk for the newest position, with `RECENT`)."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = bh % n_kv_heads
    row = pos_ptr + b * sp_b + h * sp_h
    limit = budget_limit(tl.load(ctx_ptr + b), budget, FRACTION)
    protect_above = tl.full([], 9223372036854775807, tl.int64)  # positions above it score +inf
    if RECENT:
        newest = tl.full([], -1, tl.int64)
        for start in range(0, n_slots, BLOCK):
            s = start + tl.arange(0, BLOCK)
            newest = tl.maximum(newest, tl.max(tl.load(row + s * sp_s, mask=s < n_slots, other=-1).to(tl.int64), 0))
        protect_above = newest - (limit.to(tl.float32) * recent).to(tl.int64)
    best_score = tl.full([], float("inf"), tl.float32)
    best_pos = tl.full([], 9223372036854775807, tl.int64)
    victim = tl.full([], 0, tl.int64)
    count = tl.full([], 0, tl.int64)
    free = tl.full([], n_slots, tl.int64)
    for start in range(0, n_slots, BLOCK):
        s = start + tl.arange(0, BLOCK)
        inside = s < n_slots
        pos = tl.load(row + s * sp_s, mask=inside, other=-1).to(tl.int64)
        held = pos >= 0
        score = tl.load(score_ptr + b * ss_b + h * ss_h + s * ss_s, mask=held, other=float("inf")).to(tl.float32)
        score = tl.where(held & (pos <= protect_above), score, float("inf"))
        low = tl.min(score, 0)
        tied = held & (score == low)
        low_pos = tl.min(tl.where(tied, pos, 9223372036854775807), 0)
        at = tl.min(tl.where(tied & (pos == low_pos), s, n_slots), 0).to(tl.int64)
        lower = (low < best_score) | ((low == best_score) & (low_pos < best_pos))
        better = (tl.sum(tied.to(tl.int32), 0) > 0) & lower
        best_score = tl.where(better, low, best_score)
        best_pos = tl.where(better, low_pos, best_pos)
        victim = tl.where(better, at, victim)
        count += tl.sum(held.to(tl.int64), 0)
        vacant = inside & ~held
        if UNWANTED:
            drop = held & (tl.load(unwanted_ptr + b * su_b + h * su_h + s * su_s, mask=held, other=0) != 0)
            tl.store(row + s * sp_s, -1, mask=drop)
            vacant = vacant | drop
        free = tl.minimum(free, tl.min(tl.where(vacant, s, n_slots), 0).to(tl.int64))
    over = count > limit
    tl.store(row + victim * sp_s, -1, mask=over)
    tl.store(freed_ptr + bh, tl.where(over, best_pos, -1))
    next_slot = tl.where(over, victim, tl.where(free < n_slots, free, 0))
    tl.store(write_ptr + b * sw_b + h * sw_h, next_slot)


def evict_lowest_triton(scores, slot_pos, context, budget: int | float, write_slot, unwanted=None,
                        recent: float = 0.0) -> torch.Tensor:  # fmt: skip
    b, h, s = slot_pos.shape
    context = context.reshape(-1)
    freed = torch.empty(b, h, dtype=slot_pos.dtype, device=slot_pos.device)
    mask = slot_pos if unwanted is None else unwanted.view(torch.uint8)  # not read without UNWANTED
    grid = (b * h,)
    _evict_kernel[grid](
        scores, slot_pos, context, write_slot, freed, mask, h, s, budget,
        *scores.stride(), *slot_pos.stride(), *write_slot.stride(), *mask.stride(), float(recent),
        FRACTION=isinstance(budget, float), UNWANTED=unwanted is not None, RECENT=bool(recent),
        BLOCK=min(1024, triton.next_power_of_2(s)),
        num_warps=4, **dependent_launch(slot_pos, grid),
    )  # fmt: skip
    return freed
