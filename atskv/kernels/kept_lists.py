"""The decode step of kept lists beside a paged cache (`atskv.runtime.vllm.heavy_hitters.KeptLists`,
the lists H2O and the learned selector keep inside vLLM) in one kernel a layer, where the torch
reference runs ~20 small kernels (gathers through the block table, masks, a min and an argmin,
two scatters): inside a CUDA graph each costs a launch, and together they were most of a layer's
decode step.

A request's list lives at its own logical slots: its j-th kept position in `kept` and that token's
value in `values`, both `[num_slots + 1, Hkv]` at the physical slot of logical slot j (the last
row a spare, written for slots past a request's length). Each (request, KV head) program walks
the list twice: first its held entries for the one to replace (the lowest (value, position), the
newest `recent_fraction` of the budget and the new token never), then the output row, loading
the positions to read (zeros past the count, with no loads: a short request in an engine sized
for long ones walks its own list, not the table's width) and writing the new token's entry.
`add_list_values` adds what a read returned to the listed values.
"""

from __future__ import annotations

import torch

from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.paged import physical_slots

_INT_MAX = 2147483647


def kept_list_step(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                   recent_fraction: float, new_value: float,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step of every request's list: the new token (position `seq_len - 1`, value
    `new_value`) enters, and when the budget did not grow the listed entry of lowest (value,
    position) outside the newest `recent_fraction` of the budget leaves (the new token's entry
    takes its slot). Returns the positions to read `[B, Hkv, width]` (int32, 0 past the count) and
    the counts `[B, Hkv]` (int32); `kept` and `values` are updated in place."""
    args = (kept, values, block_table, seq_lens, block_size, budget, recent_fraction, new_value, width)
    if use_triton(kept):
        return kept_list_step_triton(*args)
    return kept_list_step_reference(*args)


def list_slots(block_table, seq_lens, block_size: int, width: int, spare: int) -> torch.Tensor:
    """Physical slots `[B, width]` of each request's first `width` logical slots (`spare` past its length)."""
    b = block_table.shape[0]
    j = torch.arange(width, device=block_table.device)
    at = physical_slots(j.view(1, 1, -1).expand(b, 1, -1), block_table, block_size).view(b, width).long()
    return torch.where(j.view(1, -1) < seq_lens.long().view(b, 1), at, spare)


def by_head(slots: torch.Tensor) -> torch.Tensor:
    """Flat indices into a `[num_slots + 1, Hkv]` tensor of `slots` `[B, Hkv, K]` (each KV head's own
    column), in `slots`' order."""
    heads = slots.shape[1]
    return (slots * heads + torch.arange(heads, device=slots.device).view(1, -1, 1)).reshape(-1)


def kept_list_step_reference(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                             recent_fraction: float, new_value: float,
                             width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, heads = block_table.shape[0], kept.shape[1]
    at = list_slots(block_table, seq_lens, block_size, width, kept.shape[0] - 1)
    j = torch.arange(width, device=block_table.device).view(1, 1, -1)
    context = seq_lens.long().view(b, 1, 1)
    held, count = kept_tokens(budget, (context - 1).clamp(min=0)), kept_tokens(budget, context)
    positions, value = kept[at].transpose(1, 2), values[at].transpose(1, 2)  # [B, Hkv, width]
    newest = context - 1
    positions = torch.where(j == held, newest, positions)  # the new token's entry, after the held ones
    value = torch.where(j == held, new_value, value)
    listed = j <= held
    recent = positions > newest - (count * recent_fraction).long()
    score = torch.where(listed, torch.where(recent, torch.inf, value), torch.inf)
    lowest = listed & (score == score.amin(-1, keepdim=True))
    victim = torch.where(lowest, positions, _INT_MAX).argmin(-1, keepdim=True)
    target = torch.where(count > held, held, victim)  # [B, Hkv, 1]: where the new token goes
    positions = torch.where(j == target, newest, positions)
    flat = by_head(at.unsqueeze(1).expand(-1, heads, -1).gather(2, target))  # a row's own slot, or the spare
    kept.view(-1).index_put_((flat,), newest.expand(-1, heads, -1).reshape(-1).int())
    values.view(-1).index_put_((flat,), torch.full_like(flat, new_value, dtype=torch.float32))
    return torch.where(j < count, positions, 0).int(), count.view(b, 1).expand(b, heads).int()


@jit
def list_row(len_ptr, table_ptr, n_heads, s_table):
    """A (request, KV head) program's row of the grid, its KV head, its request's length and
    block-table row."""
    row = tl.program_id(0)
    b = row // n_heads
    return row, row % n_heads, tl.load(len_ptr + b).to(tl.int64), table_ptr + b.to(tl.int64) * s_table


@jit
def list_slot(table_row, j, seq_len, spare, PAGE: tl.constexpr):
    """Physical slots of logical slots `j` of one request (`spare` past its length)."""
    inside = j < seq_len
    page = tl.load(table_row + j // PAGE, mask=inside, other=0).to(tl.int64)
    return tl.where(inside, page * PAGE + j % PAGE, spare)


@jit
def _step_kernel(
    kept_ptr, val_ptr, table_ptr, len_ptr, pos_ptr, count_ptr, n_heads, width, spare, budget, recent_fraction,
    new_value, s_table,
    PAGE: tl.constexpr, FRACTION: tl.constexpr, BLOCK: tl.constexpr, INT_MAX: tl.constexpr,
):  # fmt: skip
    """One (request, KV head): the entry to replace, then the positions to read and the new entry
    (`INT_MAX` an argument: compiled Triton reads no plain module globals, its interpreter does)."""
    row, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    held = budget_limit(tl.maximum(seq_len - 1, 0), budget, FRACTION)
    count = budget_limit(seq_len, budget, FRACTION)
    newest = seq_len - 1
    window = (count.to(tl.float32) * recent_fraction).to(tl.int64)
    best_score = tl.full([], float("inf"), tl.float32)
    best_pos = tl.full([], INT_MAX, tl.int64)
    best_j = tl.full([], INT_MAX, tl.int64)
    for start in range(0, tl.minimum(held + 1, width), BLOCK):  # the request's own list, not the table's width
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        listed = (j <= held) & (j < width)
        at = list_slot(table_row, j, tl.minimum(held + 1, seq_len), spare, PAGE)
        pos = tl.load(kept_ptr + at * n_heads + h, mask=listed, other=0).to(tl.int64)
        val = tl.load(val_ptr + at * n_heads + h, mask=listed, other=0.0)
        pos = tl.where(j == held, newest, pos)
        val = tl.where(j == held, new_value, val)
        score = tl.where(listed & (pos <= newest - window), val, float("inf"))
        low = tl.min(tl.where(listed, score, float("inf")), 0)
        at_low = listed & (score == low)
        low_pos = tl.min(tl.where(at_low, pos, INT_MAX), 0)
        low_j = tl.min(tl.where(at_low & (pos == low_pos), j, INT_MAX), 0)
        better = (low < best_score) | ((low == best_score) & ((low_pos < best_pos) |
                                                              ((low_pos == best_pos) & (low_j < best_j))))  # fmt: skip
        has = tl.sum(listed.to(tl.int32), 0) > 0
        take = has & better
        best_score = tl.where(take, low, best_score)
        best_pos = tl.where(take, low_pos, best_pos)
        best_j = tl.where(take, low_j, best_j)
    target = tl.where(count > held, held, best_j)
    out_row = pos_ptr + row.to(tl.int64) * width
    for start in range(0, width, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = j < width
        at = list_slot(table_row, j, count, spare, PAGE)  # past the count: no load, zeros stored
        pos = tl.load(kept_ptr + at * n_heads + h, mask=inside & (j < count), other=0)
        pos = tl.where((j == held) | (j == target), newest, pos)
        tl.store(out_row + j, tl.where(j < count, pos, 0).to(tl.int32), mask=inside)
    at_target = list_slot(table_row, target, seq_len, spare, PAGE)
    tl.store(kept_ptr + at_target * n_heads + h, newest.to(tl.int32))
    tl.store(val_ptr + at_target * n_heads + h, new_value)
    tl.store(count_ptr + row, count.to(tl.int32))


def kept_list_step_triton(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                          recent_fraction: float, new_value: float, width: int,
                          block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`block`: list entries per step of a program's walk."""
    b, heads = block_table.shape[0], kept.shape[1]
    positions = torch.empty(b, heads, width, dtype=torch.int32, device=kept.device)
    counts = torch.empty(b, heads, dtype=torch.int32, device=kept.device)
    _step_kernel[(b * heads,)](
        kept, values, block_table, seq_lens, positions, counts, heads, width, kept.shape[0] - 1, budget,
        recent_fraction, new_value, block_table.stride(0), PAGE=block_size, FRACTION=isinstance(budget, float),
        BLOCK=min(block, triton.next_power_of_2(width)), INT_MAX=_INT_MAX, num_warps=4,
    )  # fmt: skip
    return positions, counts


def add_list_values(values, mass, block_table, seq_lens, block_size: int) -> None:
    """After a read: the mass `[B, Hkv, width]` each listed entry received, added to its value in
    `values` `[num_slots + 1, Hkv]` (entries past a request's length add to the spare row)."""
    if use_triton(values):
        b, heads, width = mass.shape
        _add_kernel[(b * heads,)](values, mass.contiguous(), block_table, seq_lens, heads, width, values.shape[0] - 1,
                                  block_table.stride(0), PAGE=block_size,
                                  BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4)  # fmt: skip
        return
    at = list_slots(block_table, seq_lens, block_size, mass.shape[-1], values.shape[0] - 1)
    flat = by_head(at.unsqueeze(1).expand(-1, mass.shape[1], -1))
    values.view(-1).index_put_((flat,), mass.reshape(-1), accumulate=True)


@jit
def _add_kernel(val_ptr, mass_ptr, table_ptr, len_ptr, n_heads, width, spare, s_table, PAGE: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """One (request, KV head): its entries' values plus the mass; the spare row, which every row past
    its length shares, is left alone (what it holds counts for nothing)."""
    row, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    for start in range(0, width, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        mine = (j < width) & (j < seq_len)
        at = list_slot(table_row, j, seq_len, spare, PAGE)
        mass = tl.load(mass_ptr + row.to(tl.int64) * width + j, mask=mine, other=0.0)
        old = tl.load(val_ptr + at * n_heads + h, mask=mine, other=0.0)
        tl.store(val_ptr + at * n_heads + h, old + mass, mask=mine)
