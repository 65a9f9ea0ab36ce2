"""The host tier of the fast path (`atskv.generate(..., tier=HostRetrieval(...))`): every token of a
managed layer also lives in pinned host memory, in arrival order and in pages, and each decode
step reads back the pages its query needs, with no host work and inside the step's CUDA graph.

Why this shape (ShadowKV, arXiv:2410.21465, and Quest, arXiv:2406.10774, decide on the GPU from a
compact summary of what is off it): the GPU keeps, per row and KV head, a summary of every page's
keys that scores it against a query (`atskv.runtime.fast.key_summary`: int4 keys, by default, or Quest's
key min/max, 1/8 of the keys at 16 tokens a page) and a flag per token saying whether it is
resident in the GPU slots; the evicting selector decides residency as on the fast path without a
tier. A step scores the pages that hold a non-resident token, takes the best `pages`, and gathers
them (one gather per tensor and layer) straight out of pinned memory: on CUDA the pinned buffers
are read through a device alias of the same memory (unified virtual addressing), so the copy is an
ordinary kernel that reads over PCIe, graph-capturable and without a copy engine round trip. Off
CUDA the host tensors are read directly. Consecutive queries pick mostly the same pages, so fetched
pages stay in GPU slots (`PageCache`, least recently used out) and only the misses cross PCIe
(`kernels.page_copy` loads nothing for a hit).

The host copy is written once per token: the prompt when a row's prefill ends, each decode token
as it arrives (a scatter through the alias). A token the selector evicts from the GPU is only
flagged non-resident; nothing moves at eviction time, so nothing can be lost in a transfer.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from atskv.budget import check_budget
from atskv.kernels.page_cache import assign_slots
from atskv.kernels.page_copy import page_copy
from atskv.runtime.fast.key_summary import KEY_SUMMARIES


@dataclass(frozen=True)
class HostRetrieval:
    """Tiered decode on the fast path: `tokens` parked tokens read back per decode step, layer and
    KV head (an int, or a fraction of the prompt as budgets are), in whole pages of `page_size`;
    the GPU keeps `cache` times as many pages as a step reads (>= 1: the pages read last step are
    always kept), so a page asked for again is not fetched again. `summary`: what ranks the pages on
    the GPU, a key of `KEY_SUMMARIES` (see `atskv.runtime.fast.key_summary`): int4 keys by default, which
    find needles that 16-token page bounds lose, for a little more time a step (docs/results.md,
    "The host tier on the fast path")."""

    tokens: int | float = 1024
    page_size: int = 16
    cache: float = 2.0
    summary: str = "int4"

    def __post_init__(self):
        check_budget(self.tokens)
        if self.page_size < 1 or self.cache < 1:
            raise ValueError(f"need page_size >= 1 and cache >= 1, got {self.page_size}, {self.cache}")
        if self.summary not in KEY_SUMMARIES:
            raise ValueError(f"summary must be one of {', '.join(KEY_SUMMARIES)}, got {self.summary!r}")

    def pages(self, prompt_tokens: int) -> int:
        tokens = self.tokens if isinstance(self.tokens, int) else math.ceil(self.tokens * prompt_tokens)
        return max(1, math.ceil(tokens / self.page_size))


# page-locked bytes held by host tiers now, and the most since `reset_peak_pinned` (the speed bench reads it)
_PINNED = {"now": 0, "peak": 0}


def pinned_zeros(shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in page-locked host memory of exactly this size: host memory registered with CUDA, not
    taken from torch's pinned allocator, which rounds every block up to a power of two (a tier
    would hold nearly twice its size). Unregistered when the tensor is collected."""
    host = torch.zeros(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), host.nbytes, 0))
    _PINNED["now"] += host.nbytes
    _PINNED["peak"] = max(_PINNED["peak"], _PINNED["now"])
    weakref.finalize(host, _unregister, host.untyped_storage(), host.nbytes)
    return host


def _unregister(storage, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())  # before the storage can be freed
    _PINNED["now"] -= nbytes


def host_keys_and_values(shape: tuple[int, ...], dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host tier's keys and values, zeros of `shape` each: pinned where `device` is CUDA (read
    through `device_alias`), plain elsewhere; a one-line error naming the size where the host
    cannot pin them."""
    make = pinned_zeros if device.type == "cuda" else torch.zeros
    try:
        return make(shape, dtype=dtype), make(shape, dtype=dtype)
    except RuntimeError as error:
        gib = 2 * math.prod(shape) * dtype.itemsize / 2**30
        raise RuntimeError(f"cannot allocate {gib:.1f} GiB of pinned host memory for the KV tier: {error}") from error


def pinned_peak() -> int:
    """The most page-locked bytes host tiers held at once since `reset_peak_pinned`."""
    return _PINNED["peak"]


def reset_peak_pinned() -> None:
    _PINNED["peak"] = _PINNED["now"]


class _HostArray:
    """`__cuda_array_interface__` over a pinned host buffer: torch then makes a CUDA tensor of the
    same memory (pinned memory is mapped into the device's address space)."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # kept alive by the alias
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": f"<i{host.element_size()}", "data": (host.data_ptr(), False),
            "version": 2, "strides": None,
        }  # fmt: skip


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A `device` tensor reading and writing the pinned `host` buffer in place (CUDA), or `host`
    itself off CUDA. The interface carries an integer type of the same width (it has no bfloat16)."""
    if device.type != "cuda":
        return host
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("a device alias needs a contiguous pinned host buffer")
    with torch.cuda.device(device):
        same_width = host.view(_SAME_SIZE_INT[host.element_size()])
        return torch.as_tensor(_HostArray(same_width), device=device).view(host.dtype)


class HostPages:
    """One managed layer's KV on the host in pages, with the GPU-side key summary (a `KEY_SUMMARIES`
    name) and residency flags; see the module docstring. `tokens`: the most a row holds (prompt + new
    tokens)."""

    def __init__(self, batch: int, kv_heads: int, tokens: int, head_dim: int, dtype, device, page_size: int,
                 read_pages: int, cache_slots: int, summary: str):  # fmt: skip
        self.page_size = page_size
        self.pages = math.ceil(tokens / page_size)
        self.read_pages = min(read_pages, self.pages)
        self.cache = PageCache(batch, kv_heads, self.pages, max(cache_slots, self.read_pages), page_size * head_dim,
                               dtype, device)  # fmt: skip
        shape = (batch, kv_heads, self.pages * page_size, head_dim)
        self.host_keys, self.host_values = host_keys_and_values(shape, dtype, device)
        self.keys, self.values = device_alias(self.host_keys, device), device_alias(self.host_values, device)
        self.summary = KEY_SUMMARIES[summary](batch, kv_heads, self.pages, page_size, head_dim, dtype, device)
        self.resident = torch.zeros(batch, kv_heads, shape[2] + 1, dtype=torch.bool, device=device)  # last: a sink
        self.count = torch.zeros(batch, 1, 1, dtype=torch.long, device=device)  # tokens held per row
        self.offset = torch.zeros(batch, 1, 1, dtype=torch.long, device=device)  # slot_pos - host index

    @property
    def nbytes(self) -> int:
        """Host bytes (the preallocated store)."""
        return self.host_keys.nbytes + self.host_values.nbytes

    @property
    def gpu_nbytes(self) -> int:
        """GPU bytes: key summary, residency flags and the page cache."""
        return self.summary.nbytes + self.resident.nbytes + self.cache.nbytes

    def park(self, row: int, keys: torch.Tensor, values: torch.Tensor, first_position: int, count: int) -> None:
        """A row's prompt after its prefill: `keys`/`values` `[1, Hkv, >= count, D]` hold its `count`
        real tokens in order at the front; `first_position`: the first one's slot position."""
        self.host_keys[row, :, :count].copy_(keys[0, :, :count])
        self.host_values[row, :, :count].copy_(values[0, :, :count])
        held = torch.arange(keys.shape[2], device=keys.device) < count
        self.summary.park(row, keys, held.expand(1, keys.shape[1], -1), count)
        self.count[row], self.offset[row] = count, first_position

    def mark_resident(self, row: int, slot_pos: torch.Tensor) -> None:
        """A row's residency from its GPU slots' positions `[Hkv, S]` (-1 free)."""
        index = self._host_index(slot_pos.unsqueeze(0), self.offset[row : row + 1])[0]
        self.resident[row].zero_()
        self.resident[row].scatter_(1, index, True)
        self.resident[row, :, -1] = False

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One decode token per row `[B, Hkv, 1, D]`, resident: written to the host at the row's
        next index, and to the key summary."""
        index = self.count.expand(-1, keys.shape[1], 1)  # [B, Hkv, 1]
        self.keys.scatter_(2, _rows(index, keys), keys)
        self.values.scatter_(2, _rows(index, values), values)
        self.summary.append(index, keys)
        self.resident.scatter_(2, index, True)
        self.cache.forget(index // self.page_size)  # a cached copy of that page lacks the new token
        self.count += 1

    def release(self, slot_pos: torch.Tensor, evicted: torch.Tensor) -> None:
        """Tokens at `slot_pos` `[B, Hkv, n]` left the GPU where `evicted`: flag them parked."""
        self.resident.scatter_(2, self._host_index(slot_pos.masked_fill(~evicted, -1), self.offset), False)
        self.resident[..., -1] = False

    def fetch(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `read_pages` best pages for `query` `[B, Hq, D]` among those holding a parked token:
        keys, values `[B, Hkv, read_pages * page_size, D]` and which of their tokens to attend
        (parked ones, not resident duplicates or empty slots) `[B, Hkv, read_pages * page_size]`."""
        b, h, n, d = self.keys.shape
        size = self.page_size
        parked = ~self.resident[..., :-1] & (torch.arange(n, device=query.device) < self.count)
        scores = self.summary.page_scores(query, parked)  # [B, Hkv, P]
        scores = scores.masked_fill(~parked.view(b, h, self.pages, size).any(-1), -torch.inf)
        best = scores.topk(self.read_pages, dim=-1).indices  # [B, Hkv, r]
        tokens = (best.unsqueeze(-1) * size + torch.arange(size, device=best.device)).flatten(-2)
        keys, values = self.cache.read(best, self.keys, self.values)
        return keys.view(b, h, -1, d), values.view(b, h, -1, d), parked.gather(2, tokens)

    def _host_index(self, slot_pos: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Host index of each slot position (free slots: the sink at the end)."""
        sink = self.resident.shape[-1] - 1
        return torch.where(slot_pos >= 0, slot_pos - offset, sink).clamp(0, sink)


def _rows(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index.unsqueeze(-1).expand(*index.shape, like.shape[-1])


class PageCache:
    """GPU slots for pages read back from the host, per row and KV head, least recently used out;
    `slot_of[b, h, page]` (-1: not cached) and `page_in[b, h, slot]`, each with a last sink entry
    that absorbs writes for "none"."""

    def __init__(self, batch: int, kv_heads: int, pages: int, slots: int, width: int, dtype, device):
        self.shape, self.slots, self.width = (batch, kv_heads), slots, width
        self.keys = torch.zeros(batch * kv_heads, slots, width, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.slot_of = torch.full((batch, kv_heads, pages + 1), -1, dtype=torch.long, device=device)
        self.page_in = torch.full((batch, kv_heads, slots + 1), pages, dtype=torch.long, device=device)
        self.used = torch.zeros(batch, kv_heads, slots, dtype=torch.long, device=device)  # the step of last use
        self.clock = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read(self, pages: torch.Tensor, host_keys: torch.Tensor, host_values: torch.Tensor):
        """Keys and values `[B, Hkv, R, width]` of `pages` `[B, Hkv, R]` (distinct per row), the
        missing ones copied from `host_keys`/`host_values` `[B, Hkv, N, D]` into the least recently
        used slots that no page of this step holds."""
        b, h, r = pages.shape
        self.clock += 1
        slot, hit = assign_slots(self.slot_of, self.page_in, self.used, self.clock, pages)
        flat = (b * h, r)
        for host, cached in ((host_keys, self.keys), (host_values, self.values)):
            page_copy(host.view(b * h, -1, self.width), cached, pages.view(flat), slot.view(flat), (~hit).view(flat))
        rows = slot.view(*flat, 1).expand(-1, -1, self.width)
        return self.keys.gather(1, rows).view(b, h, r, -1), self.values.gather(1, rows).view(b, h, r, -1)

    def forget(self, pages: torch.Tensor) -> None:
        """Pages `[B, Hkv, n]` whose host copy changed: their slots become free."""
        slot = self.slot_of.gather(2, pages)
        self.page_in.scatter_(2, torch.where(slot >= 0, slot, self.slots), self.slot_of.shape[-1] - 1)
        self.slot_of.scatter_(2, pages, -1)
