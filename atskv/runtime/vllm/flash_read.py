"""vLLM's own FlashAttention 3 as the sparse decode read (`decode_kernel: "flash"`).

Each (request, KV head) becomes one sequence of its picked tokens, and each picked token one page
of one slot of one KV head: the cache `[num_blocks, block_size, Hkv, D]` seen as
`[num_slots * Hkv, 1, 1, D]` pages (page `slot * Hkv + h`, in place: vLLM's NHD layout puts a
slot's heads side by side), the page table `[B * Hkv, K]` and the lengths built by one kernel
(`atskv.kernels.paged.head_pages`), the GQA group's G query heads as that sequence's heads. vLLM's
paged FlashAttention kernel (split-KV, warp-specialised, the one vanilla vLLM decodes with) then
reads exactly the picked slots; it gives no per-token attention, so selectors that read the mass
(`reads_mass`) keep atskv's kernel. FlashAttention 3 only: FA2 needs pages of 256 tokens.
"""

from __future__ import annotations

import torch

from atskv.kernels.paged import head_pages


def head_page_view(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache `[num_blocks, block_size, Hkv, D]` as one-token, one-head pages
    `[num_slots * Hkv, 1, 1, D]` (page `slot * Hkv + h`), in place."""
    blocks, size, heads, dim = cache.shape
    if cache.stride(0) != size * cache.stride(1) or cache.stride(1) != heads * cache.stride(2) or cache.stride(3) != 1:
        raise ValueError(f"decode_kernel 'flash' needs vLLM's NHD cache layout; got strides {cache.stride()}")
    step = cache.stride(2)
    return cache.as_strided((blocks * size * heads, 1, 1, dim), (step, step, step, 1))


def flash_sparse_decode(query, key_cache, value_cache, positions, lengths, block_table, scale: float, out,
                        step: dict, num_splits: int = 0, fa_version: int = 3):  # fmt: skip
    """Each decode query `[B, Hq, D]` over its picked logical `positions` `[B, Hkv, K]` (the first
    `lengths` `[B, Hkv]` count), written into `out` `[B, Hq, D]` (contiguous) and returned.
    `step`: one forward's dict, for the sequence offsets its layers share."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    b, hq, d = query.shape
    heads = key_cache.shape[2]
    sequences = b * heads
    starts = step.get("flash_read_starts")
    if starts is None or starts.shape[0] != sequences + 1:
        starts = step["flash_read_starts"] = torch.arange(sequences + 1, dtype=torch.int32, device=query.device)
    pages, counts = head_pages(positions, lengths, block_table, key_cache.shape[1])
    flash_attn_varlen_func(
        q=query.reshape(sequences, hq // heads, d), k=head_page_view(key_cache), v=head_page_view(value_cache),
        out=out.view(sequences, hq // heads, d), cu_seqlens_q=starts, max_seqlen_q=1,
        seqused_k=counts, max_seqlen_k=positions.shape[-1], softmax_scale=scale,
        causal=False, block_table=pages,
        num_splits=num_splits, fa_version=fa_version,
    )  # fmt: skip
    return out
