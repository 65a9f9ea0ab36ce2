"""Masked page copy: a host tier's fetch of only the pages a GPU page cache misses.

`source` `[N, P, W]` pages (W = page size x head dim; on CUDA a device alias of pinned host memory,
so every byte loaded crosses PCIe), `target` `[N, C, W]` cache slots, `pages`/`slots` `[N, R]` long:
for every (n, r) with `need[n, r]`, `target[n, slots[n, r]] = source[n, pages[n, r]]`. torch's
gather would read every listed page, hits included; the kernel loads nothing for an unneeded one,
so the traffic is the misses only, with static shapes (one launch inside a CUDA graph).

`paged_page_copy` is the same fetch into vLLM's paged cache (the plugin's host tier,
`atskv.runtime.vllm.host_tier`): a page lands in one KV head of one cache block.
"""

from __future__ import annotations

import torch

from atskv.kernels.backend import jit, tl, triton, use_triton

BLOCK = 1024


def page_copy(source: torch.Tensor, target: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
              need: torch.Tensor) -> None:  # fmt: skip
    """In place on `target`; see the module docstring."""
    if use_triton(target):
        page_copy_triton(source, target, pages, slots, need)
    else:
        page_copy_reference(source, target, pages, slots, need)


def page_copy_reference(source, target, pages, slots, need) -> None:
    """Plain torch: gather every listed page, write the needed ones (others write their slot's own
    content back, so they change nothing)."""
    width = source.shape[-1]
    fetched = source.gather(1, pages.unsqueeze(-1).expand(-1, -1, width))
    current = target.gather(1, slots.unsqueeze(-1).expand(-1, -1, width))
    target.scatter_(1, slots.unsqueeze(-1).expand(-1, -1, width), torch.where(need.unsqueeze(-1), fetched, current))


@jit
def _page_copy_kernel(src_ptr, dst_ptr, page_ptr, slot_ptr, need_ptr, P, C, R, W, BLOCK: tl.constexpr):
    item = tl.program_id(0)  # one (n, r)
    n = (item // R).to(tl.int64)  # offsets past 2**31 elements at long contexts and batches
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = tl.load(need_ptr + item).to(tl.int32) * W  # 0 for a page the cache holds: nothing moves
    page = tl.load(page_ptr + item)
    slot = tl.load(slot_ptr + item)
    inside = offsets < width
    values = tl.load(src_ptr + (n * P + page) * W + offsets, mask=inside)
    tl.store(dst_ptr + (n * C + slot) * W + offsets, values, mask=inside)


def page_copy_triton(source, target, pages, slots, need) -> None:
    n, p, w = source.shape
    if not (source.is_contiguous() and target.is_contiguous()):
        raise ValueError("page_copy needs contiguous source and target")
    r = pages.shape[1]
    grid = (n * r, triton.cdiv(w, BLOCK))
    _page_copy_kernel[grid](
        source, target, pages.contiguous(), slots.contiguous(), need.to(torch.int8).contiguous(), p, target.shape[1],
        r, w, BLOCK=BLOCK,
    )  # fmt: skip


def paged_page_copy(keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    rows: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor, need: torch.Tensor) -> None:
    """In place on `key_cache` and `value_cache` `[num_blocks, block_size, Hkv, D]` (vLLM's views of
    one cache: the same strides): for every (b, h, k) with `need[b, h, k]`, the `block_size` tokens
    of page `pages[b, h, k]` of head h of `keys` and `values` `[R, Hkv, tokens, D]` row `rows[b]`
    (contiguous; on CUDA device aliases of pinned host memory) go to head h of block
    `blocks[b, h, k]`. `rows` `[B]`, the rest `[B, Hkv, K]`; rows past the source only where
    nothing is needed. Keys and values in one launch: a page's two reads from the host in flight
    at once."""
    if use_triton(key_cache):
        paged_page_copy_triton(keys, values, key_cache, value_cache, rows, pages, blocks, need)
    else:
        for source, cache in ((keys, key_cache), (values, value_cache)):
            paged_page_copy_reference(source, cache, rows, pages, blocks, need)


def paged_page_copy_reference(source, cache, rows, pages, blocks, need) -> None:
    """Plain torch, one source into its cache: every listed page gathered, the needed ones written
    (the others write their block's own content back)."""
    b, h, k = pages.shape
    size = cache.shape[1]
    heads = torch.arange(h, device=cache.device).view(1, h, 1, 1)
    tokens = pages.long().unsqueeze(-1) * size + torch.arange(size, device=cache.device)  # [B, Hkv, K, size]
    fetched = source[rows.long().clamp(max=source.shape[0] - 1).view(b, 1, 1, 1), heads, tokens]
    at = (blocks.long().unsqueeze(-1), torch.arange(size, device=cache.device), heads)
    cache[at] = torch.where(need.view(b, h, k, 1, 1), fetched.to(cache.dtype), cache[at])


@jit
def _paged_page_copy_kernel(key_src_ptr, value_src_ptr, key_dst_ptr, value_dst_ptr, row_ptr, page_ptr, block_ptr,
                            need_ptr, H, K, TOKENS, D, stride_n, stride_t, stride_h, BLOCK_T: tl.constexpr,
                            BLOCK_D: tl.constexpr):  # fmt: skip
    item = tl.program_id(0)  # one (b, h, k)
    if tl.load(need_ptr + item) == 0:  # a page the cache holds: nothing moves
        return
    h = (item // K) % H
    row = tl.load(row_ptr + item // (H * K)).to(tl.int64)
    page = tl.load(page_ptr + item).to(tl.int64)
    block = tl.load(block_ptr + item).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (t[:, None] < BLOCK_T) & (d[None, :] < D)
    source = ((row * H + h) * TOKENS + page * BLOCK_T + t[:, None]) * D + d[None, :]
    target = block * stride_n + t[:, None] * stride_t + h * stride_h + d[None, :]
    keys = tl.load(key_src_ptr + source, mask=inside)  # both loads issued before either store
    values = tl.load(value_src_ptr + source, mask=inside)
    tl.store(key_dst_ptr + target, keys, mask=inside)
    tl.store(value_dst_ptr + target, values, mask=inside)


def paged_page_copy_triton(keys, values, key_cache, value_cache, rows, pages, blocks, need) -> None:
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.shape != values.shape:
        raise ValueError("paged_page_copy needs contiguous keys and values of one shape")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("paged_page_copy needs key and value caches of the same strides, contiguous in their last dim")
    size = key_cache.shape[1]
    if size & (size - 1):
        raise ValueError(f"paged_page_copy needs a power-of-two block size, got {size}")
    b, h, k = pages.shape
    _paged_page_copy_kernel[(b * h * k,)](
        keys, values, key_cache, value_cache, rows.contiguous(), pages.contiguous(), blocks.contiguous(),
        need.to(torch.int8).contiguous(), h, k, keys.shape[2], keys.shape[3], *key_cache.stride()[:3],
        BLOCK_T=size, BLOCK_D=triton.next_power_of_2(keys.shape[3]),
    )  # fmt: skip
