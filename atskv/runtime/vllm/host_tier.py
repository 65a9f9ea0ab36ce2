"""The plugin's host tier (`PluginConfig.host_tier`): what a compacting selector frees is parked in
pinned host memory first, and each decode query reads back the pages it rates highest.

With `free_blocks`, SnapKV, H2O and the learned selector move their kept prompt tokens into a
request's first blocks where its prompt ends, and the blocks after them go back to vLLM's pool
(`atskv.runtime.vllm.freeing`): the tokens there are gone. With a host tier the request's prompt up
to the freed blocks' end is first copied to a region of pinned host memory, and the split of
ShadowKV (arXiv:2410.21465) and Quest (arXiv:2406.10774) follows: the GPU keeps a summary of the
parked keys (`summary`: Quest's bounds a page, a page being a vLLM block, or every key in int4 as
the fast path's tier keeps them) and which tokens are parked (not among the kept ones), and a
decode query scores the pages, takes its best `pages` and reads their parked
tokens beside its kept ones, in the same sparse read (`atskv.runtime.vllm.selection`). The pages
read back live in `cache_pages` blocks of the request's own, the first of those its selector
would free (no kept token lies there), least recently used out; only misses cross PCIe, read
through a device alias of the pinned memory inside the step's CUDA graph
(`atskv.runtime.fast.host_pages`'s pieces, as on the fast path).

The host holds `regions` requests' prompts at once: pinned regions x sparse layers x 2 x Hkv x
max_model_len x head_size x dtype bytes (15 GiB a region at the Llama-3.1-8B shape and 128K), or
as many as `gib` holds.
A request gets a region at the chunk that ranks its prompt if one is free (a region frees once
its request has left vLLM's runner: finished, aborted or preempted), else it reads its kept
tokens alone. A decode step finds a request's region by its first block (a kept one), so no
request identity reaches the CUDA graph. Not parked: the few tokens between the freed blocks and
the recent window (up to a block plus the prompt's tail, `atskv.runtime.vllm.batch.PROMPT_TAIL`),
and decode tokens a list evicts later.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, fields

import torch

from atskv.errors import InputError, is_int
from atskv.kernels.int4_page_scores import int4_page_scores, quantize_int4
from atskv.kernels.page_cache import parked_read
from atskv.kernels.page_copy import paged_page_copy
from atskv.kernels.paged import region_page_scores
from atskv.kernels.quest import page_bounds
from atskv.kernels.quest_decode import best_pages
from atskv.runtime.fast.host_pages import device_alias, host_keys_and_values
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.protocol import once_a_forward

SUMMARIES = ("bounds", "int4")


@dataclass(frozen=True)
class HostTier:
    """`regions`: requests whose prompts the host holds at once (2 unless `gib` is given);
    `gib`: or the pinned host memory they may take, in GiB a GPU, as many regions as fit;
    `pages`: pages (vLLM blocks) a decode query reads back per layer and KV head; `cache_pages`:
    blocks a request keeps on the GPU for pages read back (>= `pages`), so a page asked for again
    is not fetched again;
    `summary`: what ranks the parked pages on the GPU, "bounds" (Quest's key min and max a page:
    1/16 of the parked KV's bytes) or "int4" (every key in 4 bits, a page scored by its best
    parked token: 1/8; on the fast path it found the needles 16-token bounds lose)."""

    regions: int | None = None
    gib: float | None = None
    pages: int = 16
    cache_pages: int = 32
    summary: str = "bounds"

    def __post_init__(self):
        if self.summary not in SUMMARIES:
            raise InputError(f"atskv: host_tier's summary is one of {', '.join(SUMMARIES)}, got {self.summary!r}")
        if self.regions is not None and self.gib is not None:
            raise InputError(f"atskv: host_tier takes regions or gib, not both (got {self.regions!r} and {self.gib!r})")
        if self.gib is not None and (isinstance(self.gib, bool) or not isinstance(self.gib, int | float)
                                     or not 0 < self.gib < math.inf):  # fmt: skip
            raise InputError(f"atskv: host_tier's gib must be a number > 0, got {self.gib!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("summary", "gib") or (f.name == "regions" and value is None):
                continue
            if not is_int(value) or value < 1:
                raise InputError(f"atskv: host_tier's {f.name} must be an int >= 1, got {value!r}")
        if self.cache_pages < self.pages:
            raise InputError(f"atskv: host_tier's cache_pages ({self.cache_pages}) must hold the pages a query "
                             f"reads ({self.pages})")  # fmt: skip

    def region_count(self, region_nbytes: int | None = None) -> int:
        """The regions to make; with `gib`, as many as it holds of `region_nbytes` (one region over
        all of this GPU's sparse layers: a prompt of max_model_len parked in each), a `gib` too
        small for one a one-line error."""
        if self.gib is None:
            return 2 if self.regions is None else self.regions
        count = int(self.gib * 2**30 // region_nbytes)
        if count < 1:
            raise InputError(f"atskv: host_tier's gib ({self.gib}) holds no region: one request's prompt of "
                             f"max_model_len parked in every sparse layer takes {region_nbytes / 2**30:.2f} GiB")
        return count


def region_nbytes(tokens: int, kv_heads: int, head_size: int, block_size: int, dtype) -> int:
    """Pinned bytes one region takes in one layer: keys and values of a prompt of `tokens`, in whole pages."""
    return 2 * kv_heads * math.ceil(tokens / block_size) * block_size * head_size * dtype.itemsize


def split_unread(unread: range, cache_blocks: int) -> tuple[range, range]:
    """Of the logical blocks a compacting selector frees for a request (`unread`), the first
    `cache_blocks` stay its own to hold pages read back from the host, the rest go to vLLM's pool:
    (cache, freed). No cache where fewer would be freed (a prompt too short to park)."""
    if cache_blocks == 0 or len(unread) < cache_blocks:
        return range(0), unread
    return range(unread.start, unread.start + cache_blocks), range(unread.start + cache_blocks, unread.stop)


class Regions:
    """Which host region holds which request's prompt: claimed by request id at the chunk that ranks
    it, looked up by the request's first block (`of_block`, `[num_blocks]` int32, -1: none) at
    decode. One for the engine's sparse layers (their metadata builder claims, each layer reads),
    with the one clock their page caches' reads are stamped by (`clock` `[1]`, a tick a forward)."""

    def __init__(self, count: int, num_blocks: int, device):
        self.count = count
        self.of_block = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.owners: list[str | None] = [None] * count
        self.clock = torch.zeros(1, dtype=torch.long, device=device)

    def claim(self, request: str, live: Collection[str]) -> int | None:
        """The request's region (the one it holds, or one whose request has left `live`), or None."""
        if request in self.owners:
            return self.owners.index(request)
        for region, owner in enumerate(self.owners):
            if owner is None or owner not in live:
                self.owners[region] = request
                return region
        return None

    def assign(self, first_block: torch.Tensor, region: int | None) -> None:
        """The request whose first block is `first_block` (`[1]`, on the GPU: no sync) reads `region`."""
        self.of_block.index_fill_(0, first_block.long().view(-1), -1 if region is None else region)

    def rows(self, block_table: torch.Tensor) -> torch.Tensor:
        """Each batch row's region, `[B]` long; `count` (a spare) where it has none (padded rows read
        vLLM's null block, never a request's first)."""
        region = self.of_block[block_table[:, 0].long()]
        return torch.where(region < 0, self.count, region).long()

    def plan(self, block_table: torch.Tensor, step: dict, reader) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode forward's `rows(block_table)` and its tick of `clock` (moved on), once a forward
        (`once_a_forward`: made by its first sparse layer, `reader`), not once a layer."""

        def make():
            self.clock += 1
            return self.rows(block_table), self.clock

        return once_a_forward(step, "regions", reader, make)


@dataclass(frozen=True)
class Parking:
    """One request's parking at the chunk that ranks its prompt: its `region`, the tokens parked
    (`0 .. stop - 1`, whole blocks) and the first logical position of its cache blocks."""

    region: int
    stop: int
    cache_start: int


class ParkedPrompts:
    """One sparse layer's side of the tier: the parked prompts' KV on the host by region
    (`[regions, Hkv, tokens, D]`), and on the GPU their summary (page bounds `[regions * pages + 1,
    Hkv, D]`, a paged Quest state whose block table is a region's pages; or int4 keys `[regions,
    Hkv, tokens, D / 2]` and scales), which tokens are parked and not kept, how many are parked,
    where each request's cache blocks start, and the cache's bookkeeping (`parked_read`); the GPU
    rows have a spare last region for rows without one."""

    def __init__(self, tier: HostTier, regions: int, tokens: int, kv_heads: int, head_size: int, block_size: int,
                 dtype, device):  # fmt: skip
        self.tier, self.regions, self.block_size = tier, regions, block_size
        self.pages = math.ceil(tokens / block_size)
        shape = (regions, kv_heads, self.pages * block_size, head_size)
        self.host_keys, self.host_values = host_keys_and_values(shape, dtype, device)
        self.keys, self.values = device_alias(self.host_keys, device), device_alias(self.host_values, device)
        if tier.summary == "int4":
            self.codes = torch.zeros(*shape[:3], head_size // 2, dtype=torch.uint8, device=device)
            self.scale = torch.zeros(shape[:3], dtype=dtype, device=device)
            self.summary_parts = (self.codes, self.scale)
        else:
            self.low = torch.zeros(regions * self.pages + 1, kv_heads, head_size, dtype=dtype, device=device)
            self.high = torch.zeros_like(self.low)
            self.summary_parts = (self.low, self.high)
        spare = regions + 1
        self.parked = torch.zeros(spare, kv_heads, self.pages * block_size, dtype=torch.bool, device=device)
        # parked tokens a page: a decode step asks which pages hold any, not the flags of every token
        self.parked_in_page = torch.zeros(spare, kv_heads, self.pages, dtype=torch.int32, device=device)
        self.held = torch.zeros(spare, dtype=torch.int32, device=device)
        self.cache_start = torch.zeros(spare, dtype=torch.int32, device=device)
        self.slot_of = torch.full((spare, kv_heads, self.pages + 1), -1, dtype=torch.long, device=device)
        self.page_in = torch.full((spare, kv_heads, tier.cache_pages + 1), self.pages, dtype=torch.long, device=device)
        self.used = torch.zeros(spare, kv_heads, tier.cache_pages, dtype=torch.long, device=device)
        self.fetched = torch.zeros(1, dtype=torch.long, device=device)  # pages copied from the host, ever

    @property
    def page_nbytes(self) -> int:
        """One page of one KV head, keys and values: what a fetch moves."""
        return 2 * self.block_size * self.host_keys.shape[-1] * self.host_keys.element_size()

    @property
    def host_nbytes(self) -> int:
        return self.host_keys.nbytes + self.host_values.nbytes

    @property
    def gpu_nbytes(self) -> int:
        parts = (*self.summary_parts, self.parked, self.parked_in_page, self.slot_of, self.page_in, self.used)
        return sum(t.numel() * t.element_size() for t in parts)

    def park(self, parking: Parking, chunk: PromptChunk) -> None:
        """A request's prompt `0 .. parking.stop - 1` copied to its region (before its selector
        moves its kept tokens to the front: `mark_kept` then), with its page bounds; its cache empty."""
        region, stop = parking.region, parking.stop
        slots = chunk.slots(0, stop)
        keys, values = chunk.key_slots[:, slots], chunk.value_slots[:, slots]  # [Hkv, stop, D]
        self.keys[region, :, :stop] = keys
        self.values[region, :, :stop] = values
        if self.tier.summary == "int4":
            self.codes[region, :, :stop], self.scale[region, :, :stop] = quantize_int4(keys)
        else:
            low, high = page_bounds(keys.unsqueeze(0), self.block_size)  # [1, Hkv, stop / size, D]
            first = region * self.pages
            self.low[first : first + low.shape[2]] = low[0].transpose(0, 1)
            self.high[first : first + low.shape[2]] = high[0].transpose(0, 1)
        self.parked[region].zero_()
        self.parked[region, :, :stop] = True
        self.parked_in_page[region].zero_()
        self.parked_in_page[region, :, : stop // self.block_size] = self.block_size
        self.held[region : region + 1].fill_(stop)
        self.cache_start[region : region + 1].fill_(parking.cache_start)
        self.slot_of[region].fill_(-1)
        self.page_in[region].fill_(self.pages)
        self.used[region].zero_()

    def page_scores(self, query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each row's parked pages scored against its query `[B, Hq, D]`: `[B, Hkv, pages]`, -inf
        where a page holds no parked token (a row without a region has none)."""
        if self.tier.summary == "bounds":  # one kernel: the region's pages, their bounds, the mask
            return region_page_scores(query, self.low, self.high, rows, self.held, self.parked_in_page, self.pages,
                                      self.block_size)  # fmt: skip
        # int4: every region scored against the query of the row that holds it (the queries gathered,
        # not the codes), then each row takes its own region's
        regions = self.regions
        by_region = query.new_zeros(regions + 1, *query.shape[1:]).index_copy_(0, rows, query)
        scores = int4_page_scores(by_region[:regions], self.codes, self.scale, self.block_size, self.parked[:regions])
        return scores[rows.clamp(max=regions - 1)].masked_fill(self.parked_in_page[rows] == 0, -torch.inf)

    def mark_kept(self, region: int, positions: torch.Tensor) -> None:
        """KV head h's kept tokens `positions[h]` (moved to the front: read there) are not parked."""
        positions = positions.long()
        was_parked = self.parked[region].gather(1, positions).int()  # a kept token past the parked ones was not
        self.parked_in_page[region].scatter_add_(1, positions // self.block_size, -was_parked)
        self.parked[region].scatter_(1, positions, False)

    def extend(self, query, positions, lengths, rows, clock, block_table, key_cache, value_cache):
        """A decode step's read list (`positions` `[B, Hkv, K]`, the first `lengths` `[B, Hkv]`
        counting) with each request's best parked pages for `query` `[B, Hq, D]` added: the pages
        fetched into its cache blocks (misses only) and their parked tokens listed after its own.
        `rows`, `clock`: each row's region and the step's tick (`Regions.plan`). Returns the list
        `[B, Hkv, K + pages x block_size + 1]` and its counts."""
        size, count = self.block_size, min(self.tier.pages, self.pages)
        best = best_pages(self.page_scores(query, rows), count)  # [B, Hkv, pages]
        listed, counts, blocks, missing = parked_read(best, self.parked_in_page, rows, self.slot_of, self.page_in,
                                                      self.used, clock, self.fetched, self.cache_start,
                                                      block_table, self.parked, positions, lengths, size)  # fmt: skip
        paged_page_copy(self.keys, self.values, key_cache, value_cache, rows, best, blocks, missing)
        return listed, counts


def host_tier_bytes(model: torch.nn.Module) -> int:
    """Bytes read back from the host by every layer's tier of `model` so far (vLLM's
    `LLM.apply_model` runs this in its workers)."""
    tiers = [m.impl.parked for m in model.modules() if getattr(getattr(m, "impl", None), "parked", None) is not None]
    return sum(int(t.fetched) * t.page_nbytes for t in tiers)
