"""The read set of a kept list whose eviction order is fixed when it is ranked: the learned
selector's inside vLLM without a refresh (`atskv.runtime.vllm.learned.QueuedLists`), one kernel a
layer with no list state written, where the list step (`atskv.kernels.kept_lists`) scans every
list for its lowest entry and writes the new token's in two.

Such a list evicts by (score, position) with scores that never change after the ranking, every
new token entering at +inf and no recent window: its entries leave in one order, known when it is
ranked. A request ranked at length L0 into n0 entries stored in that order at its first n0 logical
slots (lowest first) holds, at length s, the queue of those entries followed by positions
L0 .. s - 1, and reads its newest `count(s)` (the budget's rule, `budget_limit`): entries from
e(s) = n0 + (s - L0) - count(s) on. (L0, n0) lie at the request's first physical slot (`ranked`
`[num_slots + 1, 2]` int32); `kept` `[num_slots + 1, Hkv]` int32 holds the entries.

A step's every layer ranks its requests at the same length into the same count, so one `ranked`
serves them all, and one kernel reads every layer's queue at once (`kept` a list of the layers'
lists, found through a table of their addresses): what a plan step of FlashInfer's does once per
step, where one kernel a layer would pay its launch on each.

STALE: as for the list step, an entry outside the request's positions (a request no prompt chunk
ranked, whose first slot and entries are an earlier tenant's) is read as its newest token, so a
request never reads past its own length.
"""

from __future__ import annotations

import functools

import torch

from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.kept_lists import by_head
from atskv.kernels.paged import physical_slots


def queue_read(kept, ranked, block_table, seq_lens, block_size: int, budget: int | float,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each request's read set at its length: positions `[B, Hkv, width]` (int32, 0 past the count)
    and counts `[B, Hkv]` (int32); nothing is written to `kept` or `ranked`. `kept` may be a list of
    several layers' lists (the same shape, ranked alike): then positions are `[layers, B, Hkv,
    width]`, read in one kernel."""
    first = kept[0] if isinstance(kept, list) else kept
    if use_triton(first):
        return queue_read_triton(kept, ranked, block_table, seq_lens, block_size, budget, width)
    if isinstance(kept, list):
        reads = [queue_read_reference(k, ranked, block_table, seq_lens, block_size, budget, width) for k in kept]
        return torch.stack([positions for positions, _ in reads]), reads[0][1]
    return queue_read_reference(kept, ranked, block_table, seq_lens, block_size, budget, width)


def queue_read_reference(kept, ranked, block_table, seq_lens, block_size: int, budget: int | float,
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, heads = block_table.shape[0], kept.shape[1]
    context = seq_lens.long().view(b, 1)
    newest = context - 1
    first = block_table[:, :1].long() * block_size
    length, n0 = ranked[first.view(-1)].long().unbind(-1)  # [B] each
    length, n0 = length.view(b, 1).clamp(min=0).minimum(context), n0.view(b, 1).clamp(min=0)
    count = kept_tokens(budget, context)
    queue = torch.arange(width, device=kept.device).view(1, -1) + (n0 + context - length - count).clamp(min=0)
    listed = queue < n0
    stored = queue.clamp(max=block_table.shape[1] * block_size - 1).unsqueeze(1)
    at = torch.where(listed & (queue < context), physical_slots(stored, block_table, block_size).view(b, -1).long(),
                     kept.shape[0] - 1)  # fmt: skip
    entries = kept.view(-1)[by_head(at.unsqueeze(1).expand(-1, heads, -1))].view(b, heads, width).long()
    positions = torch.where(listed.unsqueeze(1), entries, (length + queue - n0).unsqueeze(1))
    positions = torch.where((positions >= 0) & (positions <= newest.unsqueeze(1)), positions, newest.unsqueeze(1))
    j = torch.arange(width, device=kept.device).view(1, 1, -1)
    counts = count.view(b, 1).expand(b, heads)
    return torch.where(j < counts.unsqueeze(-1), positions, 0).int(), counts.int()


def queue_read_triton(kept, ranked, block_table, seq_lens, block_size: int, budget: int | float,
                      width: int, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One program per tile of each (layer, request, KV head)'s read set."""
    layers = kept if isinstance(kept, list) else [kept]
    b, heads = block_table.shape[0], layers[0].shape[1]
    block = min(block, triton.next_power_of_2(width))
    positions = torch.empty(len(layers), b, heads, width, dtype=torch.int32, device=layers[0].device)
    counts = torch.empty(b, heads, dtype=torch.int32, device=layers[0].device)
    table = layer_table(tuple(k.data_ptr() for k in layers), layers[0].device) if len(layers) > 1 else layers[0]
    grid = (b * heads, triton.cdiv(width, block), len(layers))
    _queue_read_kernel[grid](
        layers[0], table, ranked, block_table, seq_lens, positions, counts, heads, width, layers[0].shape[0] - 1,
        budget, block_table.stride(0), block_table.shape[1] * block_size, PAGE=block_size,
        FRACTION=isinstance(budget, float), LAYERED=len(layers) > 1, BLOCK=block, num_warps=4,
        **dependent_launch(layers[0], grid),
    )  # fmt: skip
    return (positions if isinstance(kept, list) else positions[0]), counts


@functools.cache
def layer_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The layers' list addresses as a device tensor, made once (at the first call, before a CUDA
    graph is captured: a copy from the host cannot be) and kept: a captured kernel reads it."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)


@jit
def _queue_read_kernel(kept_ptr, layers_ptr, ranked_ptr, table_ptr, len_ptr, pos_ptr, count_ptr, n_heads, width,
                       spare, budget, s_table, slots, PAGE: tl.constexpr, FRACTION: tl.constexpr,
                       LAYERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    row, layer = tl.program_id(0), tl.program_id(2)
    if LAYERED:
        kept_ptr = tl.load(layers_ptr + layer).to(tl.pointer_type(tl.int32))
    pos_ptr += layer.to(tl.int64) * tl.num_programs(0) * width
    b, h = row // n_heads, row % n_heads
    context = tl.load(len_ptr + b).to(tl.int64)
    newest = context - 1
    table_row = table_ptr + b.to(tl.int64) * s_table
    first = tl.load(table_row).to(tl.int64) * PAGE
    length = tl.minimum(tl.maximum(tl.load(ranked_ptr + first * 2).to(tl.int64), 0), context)
    n0 = tl.maximum(tl.load(ranked_ptr + first * 2 + 1).to(tl.int64), 0)
    count = budget_limit(context, budget, FRACTION)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    queue = j + tl.maximum(n0 + context - length - count, 0)
    listed = (queue < n0) & (j < count)
    stored = tl.minimum(queue, slots - 1)
    page = tl.load(table_row + stored // PAGE, mask=listed & (queue < context), other=0).to(tl.int64)
    at = tl.where(queue < context, page * PAGE + stored % PAGE, spare)
    entry = tl.load(kept_ptr + at * n_heads + h, mask=listed, other=0).to(tl.int64)
    pos = tl.where(queue < n0, entry, length + queue - n0)
    pos = tl.where((pos >= 0) & (pos <= newest), pos, newest)  # `STALE`
    tl.store(pos_ptr + row.to(tl.int64) * width + j, tl.where(j < count, pos, 0).to(tl.int32), mask=j < width)
    if (tl.program_id(1) == 0) & (layer == 0):
        tl.store(count_ptr + row, count.to(tl.int32))
