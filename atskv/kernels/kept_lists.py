"""The decode step of kept lists beside a paged cache (`atskv.runtime.vllm.heavy_hitters.KeptLists`,
the lists H2O and the learned selector keep inside vLLM) in two kernels a layer, where the torch
reference runs ~20 small kernels (gathers through the block table, masks, a min and an argmin,
two scatters): inside a CUDA graph each costs a launch, and together they were most of a layer's
decode step.

A request's list lives at its own logical slots: its j-th kept position in `kept` and that token's
value in `values`, both `[num_slots + 1, Hkv]` at the physical slot of logical slot j (the last
row a spare, written for slots past a request's length). A step is two kernels: one program per
tile of each (request, KV head)'s list writes the positions to read (zeros past the count, with
no loads there) and its candidate to replace, the lowest (value, position) outside the newest
`recent_fraction` of the budget (the new token never); then one program per list picks among
its tiles' candidates and writes the new token's entry. A list is thus read in one round of
dependent loads (block table, position, value) however long it is, where one program walking it
tile by tile waited on each tile in turn.
`add_list_values` adds what a read returned to the listed values.

MOVED: a list compacted where its prompt ended (`free_blocks`) keeps its first `split` entries at
its first logical slots and the rest `shift` slots further on (its recent window's own slots, then
those of the tokens after it), so that its storage never lies in the blocks handed back to vLLM's
pool; `moved` `[num_slots + 1, 2]` int32 holds (split, shift) at each request's first slot
(`atskv.runtime.vllm.heavy_hitters.KeptLists.compact`).

STALE: an entry outside the request's positions (a list no prompt chunk ranked, whose slots hold
an earlier tenant's entries: vLLM may hand a prompt's last tokens over as one-token rows, which
run as decodes) is read as the newest token, so a request never reads past its own length, where
its block table may name another request's blocks.
"""

from __future__ import annotations

import torch

from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.paged import physical_slots

_INT_MAX = 2147483647
NOT_MOVED = _INT_MAX  # a list's split where none of its entries moved (`MOVED`)


def kept_list_step(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                   recent_fraction: float, new_value: float, width: int,
                   moved: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step of every request's list: the new token (position `seq_len - 1`, value
    `new_value`) enters, and when the budget did not grow the listed entry of lowest (value,
    position) outside the newest `recent_fraction` of the budget leaves (the new token's entry
    takes its slot). Returns the positions to read `[B, Hkv, width]` (int32, 0 past the count) and
    the counts `[B, Hkv]` (int32); `kept` and `values` are updated in place; `moved`: where the
    lists' entries are stored (`MOVED`; None: entry j at logical slot j)."""
    args = (kept, values, block_table, seq_lens, block_size, budget, recent_fraction, new_value, width, moved)
    if use_triton(kept):
        return kept_list_step_triton(*args)
    return kept_list_step_reference(*args)


def list_slots(block_table, seq_lens, block_size: int, width: int, spare: int,
               moved: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Physical slots `[B, width]` of each request's first `width` list entries: logical slot j, or
    as `moved` says (`MOVED`); `spare` past its length."""
    b = block_table.shape[0]
    j = torch.arange(width, device=block_table.device).view(1, -1).expand(b, -1)
    if moved is not None:
        split, shift = moved[block_table[:, 0].long() * block_size].long().unbind(-1)  # at each first slot
        j = j + torch.where(j >= split.view(-1, 1), shift.view(-1, 1), 0)
    inside = j < seq_lens.long().view(b, 1)
    at = physical_slots(j.clamp(max=block_table.shape[1] * block_size - 1).unsqueeze(1), block_table, block_size)
    return torch.where(inside, at.view(b, width).long(), spare)


def by_head(slots: torch.Tensor) -> torch.Tensor:
    """Flat indices into a `[num_slots + 1, Hkv]` tensor of `slots` `[B, Hkv, K]` (each KV head's own
    column), in `slots`' order."""
    heads = slots.shape[1]
    return (slots * heads + torch.arange(heads, device=slots.device).view(1, -1, 1)).reshape(-1)


def kept_list_step_reference(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                             recent_fraction: float, new_value: float, width: int,
                             moved: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, heads = block_table.shape[0], kept.shape[1]
    at = list_slots(block_table, seq_lens, block_size, width, kept.shape[0] - 1, moved)
    j = torch.arange(width, device=block_table.device).view(1, 1, -1)
    context = seq_lens.long().view(b, 1, 1)
    held, count = kept_tokens(budget, (context - 1).clamp(min=0)), kept_tokens(budget, context)
    positions, value = kept[at].transpose(1, 2), values[at].transpose(1, 2)  # [B, Hkv, width]
    newest = context - 1
    positions = torch.where((positions >= 0) & (positions <= newest), positions, newest)  # `STALE`
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
def list_layout(moved_ptr, table_row, PAGE: tl.constexpr, MOVED: tl.constexpr, INT_MAX: tl.constexpr):
    """One request's (split, shift) (`MOVED`), at its first slot; without, entry j at slot j."""
    split, shift = INT_MAX, 0
    if MOVED:
        first = tl.load(table_row).to(tl.int64) * PAGE
        split = tl.load(moved_ptr + first * 2).to(tl.int64)
        shift = tl.load(moved_ptr + first * 2 + 1).to(tl.int64)
    return split, shift


@jit
def list_slot(table_row, j, seq_len, spare, PAGE: tl.constexpr, split, shift):
    """Physical slots of list entries `j` of one request: logical slot j, or `shift` on from entry
    `split` (`MOVED`); `spare` past its length."""
    j = j + tl.where(j >= split, shift, 0)
    inside = j < seq_len
    page = tl.load(table_row + j // PAGE, mask=inside, other=0).to(tl.int64)
    return tl.where(inside, page * PAGE + j % PAGE, spare)


@jit
def list_sizes(seq_len, budget, FRACTION: tl.constexpr):
    """A list's entries before its new token (`held`) and after it (`count`)."""
    return budget_limit(tl.maximum(seq_len - 1, 0), budget, FRACTION), budget_limit(seq_len, budget, FRACTION)


@jit
def _lowest(score, pos, j, valid, INT_MAX: tl.constexpr):
    """The lowest (score, position, entry) among the `valid` ones: (inf, INT_MAX, INT_MAX) if none."""
    low = tl.min(tl.where(valid, score, float("inf")), 0)
    at_low = valid & (score == low)
    low_pos = tl.min(tl.where(at_low, pos, INT_MAX), 0)
    return low, low_pos, tl.min(tl.where(at_low & (pos == low_pos), j, INT_MAX), 0)


@jit
def _step_tile_kernel(
    kept_ptr, val_ptr, table_ptr, len_ptr, pos_ptr, low_ptr, low_pos_ptr, low_j_ptr, moved_ptr, n_heads, width, spare,
    budget, recent_fraction, new_value, s_table,
    PAGE: tl.constexpr, FRACTION: tl.constexpr, BLOCK: tl.constexpr, INT_MAX: tl.constexpr, MOVED: tl.constexpr,
):  # fmt: skip
    """One tile of one (request, KV head)'s list: the positions to read (the new token's entry
    after the held ones, zeros past the count, no loads there) and the tile's candidate to
    replace, its lowest (value, position, entry) (`INT_MAX` an argument: compiled Triton reads no
    plain module globals, its interpreter does)."""
    row, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    tile = tl.program_id(1)
    held, count = list_sizes(seq_len, budget, FRACTION)
    newest = seq_len - 1
    window = (count.to(tl.float32) * recent_fraction).to(tl.int64)
    j = tile * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = j < width
    listed = (j <= held) & inside
    split, shift = list_layout(moved_ptr, table_row, PAGE, MOVED, INT_MAX)
    at = list_slot(table_row, j, seq_len, spare, PAGE, split, shift)
    pos = tl.load(kept_ptr + at * n_heads + h, mask=listed, other=0).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos <= newest), pos, newest)  # `STALE`
    val = tl.load(val_ptr + at * n_heads + h, mask=listed, other=0.0)
    pos = tl.where(j == held, newest, pos)
    val = tl.where(j == held, new_value, val)
    score = tl.where(pos <= newest - window, val, float("inf"))
    low, low_pos, low_j = _lowest(score, pos, j, listed, INT_MAX)
    tiles = tl.num_programs(1)
    tl.store(low_ptr + row * tiles + tile, low)
    tl.store(low_pos_ptr + row * tiles + tile, low_pos)
    tl.store(low_j_ptr + row * tiles + tile, low_j)
    tl.store(pos_ptr + row.to(tl.int64) * width + j, tl.where(j < count, pos, 0).to(tl.int32), mask=inside)


@jit
def _step_entry_kernel(
    kept_ptr, val_ptr, table_ptr, len_ptr, pos_ptr, count_ptr, low_ptr, low_pos_ptr, low_j_ptr, moved_ptr, n_heads,
    width, tiles, spare, budget, new_value, s_table,
    PAGE: tl.constexpr, FRACTION: tl.constexpr, BLOCK_T: tl.constexpr, INT_MAX: tl.constexpr, MOVED: tl.constexpr,
):  # fmt: skip
    """One (request, KV head): the entry to replace from its tiles' candidates (when the budget did
    not grow; else the entry after the held ones), the new token written there, and the count."""
    row, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    held, count = list_sizes(seq_len, budget, FRACTION)
    t = tl.arange(0, BLOCK_T)
    mine = t < tiles
    low = tl.load(low_ptr + row * tiles + t, mask=mine, other=float("inf"))
    low_pos = tl.load(low_pos_ptr + row * tiles + t, mask=mine, other=INT_MAX)
    low_j = tl.load(low_j_ptr + row * tiles + t, mask=mine, other=INT_MAX)
    _, _, best_j = _lowest(low, low_pos, low_j, mine, INT_MAX)
    target = tl.where(count > held, held, best_j)
    newest = seq_len - 1
    tl.store(pos_ptr + row.to(tl.int64) * width + target, newest.to(tl.int32), mask=target < count)
    split, shift = list_layout(moved_ptr, table_row, PAGE, MOVED, INT_MAX)
    at_target = list_slot(table_row, target, seq_len, spare, PAGE, split, shift)
    tl.store(kept_ptr + at_target * n_heads + h, newest.to(tl.int32))
    tl.store(val_ptr + at_target * n_heads + h, new_value)
    tl.store(count_ptr + row, count.to(tl.int32))


def kept_list_step_triton(kept, values, block_table, seq_lens, block_size: int, budget: int | float,
                          recent_fraction: float, new_value: float, width: int, moved: torch.Tensor | None = None,
                          block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two kernels: every tile of every list at once (`block` entries a program: a list's walk
    is one round of dependent loads, not one per tile), then one program a list for the entry
    to replace and the new token's write."""
    b, heads = block_table.shape[0], kept.shape[1]
    block = min(block, triton.next_power_of_2(width))
    tiles = triton.cdiv(width, block)
    positions = torch.empty(b, heads, width, dtype=torch.int32, device=kept.device)
    counts = torch.empty(b, heads, dtype=torch.int32, device=kept.device)
    low = torch.empty(b * heads, tiles, dtype=torch.float32, device=kept.device)
    low_pos = torch.empty(b * heads, tiles, dtype=torch.int64, device=kept.device)
    low_j = torch.empty_like(low_pos)
    common = dict(PAGE=block_size, FRACTION=isinstance(budget, float), INT_MAX=_INT_MAX, MOVED=moved is not None)
    moved = counts if moved is None else moved  # (never read without MOVED)
    _step_tile_kernel[(b * heads, tiles)](
        kept, values, block_table, seq_lens, positions, low, low_pos, low_j, moved, heads, width, kept.shape[0] - 1,
        budget, recent_fraction, new_value, block_table.stride(0), BLOCK=block, num_warps=4, **common,
    )  # fmt: skip
    _step_entry_kernel[(b * heads,)](
        kept, values, block_table, seq_lens, positions, counts, low, low_pos, low_j, moved, heads, width, tiles,
        kept.shape[0] - 1, budget, new_value, block_table.stride(0), BLOCK_T=triton.next_power_of_2(tiles),
        num_warps=1, **common,
    )  # fmt: skip
    return positions, counts


def add_list_values(values, mass, block_table, seq_lens, block_size: int, moved: torch.Tensor | None = None,
                    block: int = 1024) -> None:  # fmt: skip
    """After a read: the mass `[B, Hkv, width]` each listed entry received, added to its value in
    `values` `[num_slots + 1, Hkv]` (entries past a request's length add to the spare row);
    `moved` as `kept_list_step`'s; `block`: the kernel's entries a program."""
    if use_triton(values):
        b, heads, width = mass.shape
        block = min(block, triton.next_power_of_2(width))
        _add_kernel[(b * heads, triton.cdiv(width, block))](
            values, mass.contiguous(), block_table, seq_lens, values if moved is None else moved, heads, width,
            values.shape[0] - 1, block_table.stride(0), PAGE=block_size, BLOCK=block, MOVED=moved is not None,
            INT_MAX=_INT_MAX, num_warps=4,
        )  # fmt: skip
        return
    at = list_slots(block_table, seq_lens, block_size, mass.shape[-1], values.shape[0] - 1, moved)
    flat = by_head(at.unsqueeze(1).expand(-1, mass.shape[1], -1))
    values.view(-1).index_put_((flat,), mass.reshape(-1), accumulate=True)


@jit
def _add_kernel(val_ptr, mass_ptr, table_ptr, len_ptr, moved_ptr, n_heads, width, spare, s_table, PAGE: tl.constexpr,
                BLOCK: tl.constexpr, MOVED: tl.constexpr, INT_MAX: tl.constexpr):  # fmt: skip
    """One tile of one (request, KV head)'s entries: their values plus the mass; the spare row, which
    every row past its length shares, is left alone (what it holds counts for nothing)."""
    row, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    split, shift = list_layout(moved_ptr, table_row, PAGE, MOVED, INT_MAX)
    at = list_slot(table_row, j, seq_len, spare, PAGE, split, shift)
    mine = (j < width) & (at != spare)
    mass = tl.load(mass_ptr + row.to(tl.int64) * width + j, mask=mine, other=0.0)
    old = tl.load(val_ptr + at * n_heads + h, mask=mine, other=0.0)
    tl.store(val_ptr + at * n_heads + h, old + mass, mask=mine)
