"""Masked page copy: the host tier's fetch of only the pages a GPU page cache misses.

`source` `[N, P, W]` pages (W = page size x head dim; on CUDA a device alias of pinned host memory,
so every byte loaded crosses PCIe), `target` `[N, C, W]` cache slots, `pages`/`slots` `[N, R]` long:
for every (n, r) with `need[n, r]`, `target[n, slots[n, r]] = source[n, pages[n, r]]`. torch's
gather would read every listed page, hits included; the kernel loads nothing for an unneeded one,
so the traffic is the misses only, with static shapes (one launch inside a CUDA graph).
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
