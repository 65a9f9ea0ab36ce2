"""Page scores from int4 keys: the largest logit any query head of a GQA group reaches in a page.

Quest's page bounds (`kernels.quest`) are loose at 16 tokens a page and lose needle tokens whose
exact scores stand out; keys quantised to 4 bits with one scale per token and KV head keep each
token's logit nearly exact (docs/results.md, "The host tier on the fast path") at D / 2 + 2 bytes a token. A page scores
the max over its tokens and over the group's query heads of q . k, k dequantised: pooled with max,
as Quest's bounds are, so one head's sharp need of a page is not outvoted.

Storage, symmetric per token: `scale = max|k| / 7`, codes `round(k / scale)` in [-7, 7], stored + 8,
two per byte (channel 2i in the low nibble, 2i + 1 in the high one). Only candidate tokens score (the
host tier's parked ones: a page is read back for what it holds that the GPU lacks, not for a token
already resident, nor for slots never written).
"""

from __future__ import annotations

import torch

from atskv.attention import grouped_queries
from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs

LEVELS = 7  # codes in [-7, 7]; -8 stays unused so the range is symmetric


def quantize_int4(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[..., D]` (D even) -> codes `[..., D // 2]` uint8 and scale `[...]` in the keys' dtype.
    The scale is rounded to its dtype before the codes are taken, so each dequantised element is
    within scale / 2 of the key."""
    if keys.shape[-1] % 2:
        raise ValueError(f"int4 keys pack two channels a byte: need an even head dim, got {keys.shape[-1]}")
    floor = torch.finfo(keys.dtype).tiny  # an all-zero key: a representable scale, codes 0
    scale = (keys.float().abs().amax(-1) / LEVELS).clamp(min=floor).to(keys.dtype)
    codes = ((keys.float() / scale.float().unsqueeze(-1)).round().clamp(-LEVELS, LEVELS) + 8).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_int4`, in float32: `[..., D]`."""
    low, high = (codes & 15).float() - 8, (codes >> 4).float() - 8
    return torch.stack((low, high), -1).flatten(-2) * scale.float().unsqueeze(-1)


def int4_page_scores_reference(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, page_size: int,
                               candidates: torch.Tensor):  # fmt: skip
    """Plain-torch `int4_page_scores`: dequantise, every candidate token's logit, max over the group and the page."""
    keys = dequantize_int4(codes, scale)  # [B, Hkv, N, D]
    q = grouped_queries(query.unsqueeze(2).float(), keys.shape[1])  # [B, Hkv, G, 1, D]
    logits = (q @ keys.unsqueeze(2).transpose(-1, -2)).amax(2).squeeze(2)  # [B, Hkv, N]
    logits = logits.masked_fill(~candidates, -torch.inf)
    pad = -logits.shape[-1] % page_size
    return torch.nn.functional.pad(logits, (0, pad), value=-torch.inf).unflatten(-1, (-1, page_size)).amax(-1)


@jit
def _int4_kernel(
    q_ptr, c_ptr, s_ptr, m_ptr, out_ptr,
    n_kv_heads, n_tokens, n_pages, page_size, half_dim,
    sq_b, sq_h, sq_d,
    sc_b, sc_h, sc_n, sc_d,
    ss_b, ss_h, ss_n,
    sm_b, sm_h, sm_n,
    so_b, so_h, so_p,
    GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program: one (row, KV head) and BLOCK_P pages, their tokens the rows of two matrix
    products on the tensor cores: the unpacked codes (exact in the query's dtype) times the group's
    query heads (even channels with the low nibbles, odd with the high ones; the group padded to
    BLOCK_G >= 16 columns). The loads do not wait on the candidate mask: it applies after. The
    scale, positive, applies after the max over heads. A 16-bit query's codes unpack without a
    conversion: the nibble n's bits OR'd into MAGIC are the float OFFSET + n (the exponent where
    the ulp is 1), and one subtraction in that dtype, exact, leaves n - 8 (faster than through
    float32: docs/results.md, "The host tier on the fast path")."""
    wait_for_inputs(PDL)
    h = tl.program_id(0) % n_kv_heads
    b = (tl.program_id(0) // n_kv_heads).to(tl.int64)
    r = tl.arange(0, BLOCK_P * BLOCK_T)
    t = r % BLOCK_T
    first = tl.program_id(1) * BLOCK_P
    token = (first + r // BLOCK_T) * page_size + t
    inside = (t < page_size) & (token < n_tokens)
    token = token.to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    tile = inside[:, None] & (j < half_dim)[None, :]
    codes = tl.load(c_ptr + b * sc_b + h * sc_h + token[:, None] * sc_n + j[None, :] * sc_d, mask=tile, other=0x88)
    kind = q_ptr.dtype.element_ty
    if MAGIC:
        offset = tl.full([1, 1], OFFSET + 8.0, kind)
        low = ((codes & 15).to(tl.uint16) | MAGIC).to(kind, bitcast=True) - offset
        high = ((codes >> 4).to(tl.uint16) | MAGIC).to(kind, bitcast=True) - offset
    else:  # float32 (the CPU tests' dtype; a served model's query is 16-bit): through float32
        low = ((codes & 15).to(tl.float32) - 8.0).to(kind)
        high = ((codes >> 4).to(tl.float32) - 8.0).to(kind)
    g = tl.arange(0, BLOCK_G)
    heads = q_ptr + b * sq_b + (h * GROUP + g[None, :]) * sq_h
    q_ok = (j < half_dim)[:, None] & (g < GROUP)[None, :]
    even = tl.load(heads + 2 * j[:, None] * sq_d, mask=q_ok, other=0.0)
    odd = tl.load(heads + (2 * j[:, None] + 1) * sq_d, mask=q_ok, other=0.0)
    logits = tl.dot(low, even, input_precision=PRECISION)
    logits = tl.dot(high, odd, logits, input_precision=PRECISION)  # [tokens, BLOCK_G]
    best = tl.max(tl.where((g < GROUP)[None, :], logits, float("-inf")), axis=1)
    scale = tl.load(s_ptr + b * ss_b + h * ss_h + token * ss_n, mask=inside, other=0.0).to(tl.float32)
    candidate = tl.load(m_ptr + b * sm_b + h * sm_h + token * sm_n, mask=inside, other=0) != 0
    scores = tl.reshape(tl.where(candidate, best * scale, float("-inf")), (BLOCK_P, BLOCK_T))
    p = first + tl.arange(0, BLOCK_P)
    tl.store(out_ptr + b * so_b + h * so_h + p * so_p, tl.max(scores, axis=1), mask=p < n_pages)


_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}  # the bits of 128.0 and 1024.0


def int4_page_scores_triton(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, page_size: int,
                            candidates: torch.Tensor):  # fmt: skip
    """Triton `int4_page_scores` (any strides; no copy of the codes). A program takes the pages of at
    most 128 tokens (8K codes: 128 at D = 128, 64 at Gemma's 256); programs looping over several such
    blocks were slower (measured on an H200, see docs/results/kernel-notes.md)."""
    b, hq, d = query.shape
    hkv, tokens = codes.shape[1], codes.shape[2]
    pages = triton.cdiv(tokens, page_size)
    out = torch.empty(b, hkv, pages, dtype=torch.float32, device=query.device)
    block_t, block_h = triton.next_power_of_2(page_size), max(16, triton.next_power_of_2(d // 2))
    block_p = max(1, 16 // block_t, min(128, 8192 // block_h) // block_t)
    grid = (b * hkv, triton.cdiv(pages, block_p))
    mask = candidates.view(torch.uint8)  # bool, read as bytes
    magic, offset = _MAGIC.get(query.dtype, (0, 0.0))
    _int4_kernel[grid](
        query, codes, scale, mask, out, hkv, tokens, pages, page_size, d // 2,
        *query.stride(), *codes.stride(), *scale.stride(), *mask.stride(), *out.stride(),
        GROUP=hq // hkv, BLOCK_P=block_p, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", MAGIC=magic, OFFSET=offset,
        **dependent_launch(query, grid),
    )  # fmt: skip
    return out


def int4_page_scores(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, page_size: int,
                     candidates: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Each page's best logit among its `candidates` (`[B, Hkv, N]` bool), max-pooled over each GQA group,
    float32, -inf for a page without one: `query` `[B, Hq, D]`, `codes` `[B, Hkv, N, D // 2]` and `scale`
    `[B, Hkv, N]` from `quantize_int4` -> `[B, Hkv, ceil(N / page_size)]`."""
    if use_triton(query):
        return int4_page_scores_triton(query, codes, scale, page_size, candidates)
    return int4_page_scores_reference(query, codes, scale, page_size, candidates)
