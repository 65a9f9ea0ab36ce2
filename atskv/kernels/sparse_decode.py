"""Sparse decode attention: one query per row attends only to the slots a selector picked, per KV
head, gathered by index straight out of the slot cache (flash-decoding over index lists).

`query` `[B, Hq, D]`, `keys`/`values` `[B, Hkv, S, D]` (any strides: a view of a larger slot
buffer is read in place), `indices` `[B, Hkv, K]` slot ids, `lengths` `[B, Hkv]` (only the first
`lengths[b, h]` indices count; a row with none returns zeros). The G = Hq // Hkv query heads of a
KV group share its indices, and K/V are never expanded to the query heads. Indices must be
distinct within a row: a duplicate is attended twice (both here and in the reference), which is
not attention over a set.

`held` (a slot's position `[B, Hkv, S]`, -1 for a free slot) skips indices whose slot holds no
token, so an evicting layer attends its whole buffer by an identity list without first building
one of its held slots. `want_mass` also returns the probability each index received, summed over
the group's query heads (`[B, Hkv, K]`, float32): what H2O-style selectors accumulate; `add_mass_to`
(such a selector's per-slot accumulator `[B, Hkv, S]`) adds it there in place instead, at each
counted index's slot, which saves the add kernel of every step. The kernel then keeps each logit
(float32, `[B * Hq, K]`) and a third small kernel turns them into probabilities once the splits'
log-sum-exp is known.

The Triton kernel gives each program one (batch row, KV head) and one share ("split") of its
index list: every `splits`-th tile from the split's own, so the tiles that count (the first
`lengths[b, h]` indices) spread over all splits even when the list is much longer than what
counts (vLLM's fractional budgets are sized for the longest context the engine takes). The G
queries are loaded once, padded to at least 16 rows so both products run through `tl.dot` on
tensor cores. The padding wastes MMA work when G is small (4 on Llama-3-8B),
but a decode step is bound by the random-access gathers of K/V rows, not by arithmetic; the
alternative, a broadcast product `q[:, None, :] * k[None, :, :]` on CUDA cores, holds a
`G x BLOCK_N x D` float32 tile in registers (forcing small tiles, so fewer gathers in flight) and
needs a separate path per G. Splits keep a running max / sum / accumulator (base-2 exponent, with
the log2(e) folded into the scale) and a second small kernel merges them by log-sum-exp; a
single split writes the output directly.
"""

from __future__ import annotations

import math

import torch

from atskv.attention import grouped_probs
from atskv.kernels.backend import dependent_launch, jit, sm_count, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.paged import physical_slots

# Split heuristic (see `choose_split_size`): a split walks at least MIN_SPLIT_TILES tiles, aims at
# WAVES programs per SM over the whole grid (PAGED_WAVES for a paged read, whose tiles each wait on
# one more dependent load, the block table's), and never exceeds MAX_SPLITS.
MIN_SPLIT_TILES = 1
WAVES = 2
PAGED_WAVES = 4
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


def sparse_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None = None,
    scaling: float | None = None,
    **options,
):
    """Attention of each decode query over its KV group's indexed slots, `[B, Hq, D]` in the query
    dtype (with `want_mass`, and the mass `[B, Hkv, K]`; with `add_mass_to`, the mass added there
    by slot): the Triton kernel on CUDA, the torch reference elsewhere (see `kernels.backend`).

    Paged caches (vLLM's): with `block_table` `[B, W]` the indices are each row's logical token
    positions, read at physical slot `block_table[b, i // block_size] * block_size + i % block_size`
    of `keys`/`values` (all slots of the cache, `[B, Hkv, num_slots, D]` views), and `want_mass` is
    by index, as unpaged (`add_mass_to`, by slot, is refused there). `out` `[B, Hq, D]`:
    written in place (an engine's output buffer) and returned. `options` (`held`, `want_mass`,
    `add_mass_to`, `block_table`, `block_size`, `out`) are the two implementations' keywords."""
    if use_triton(query):
        return sparse_decode_attention_triton(query, keys, values, indices, lengths, scaling, **options)
    return sparse_decode_attention_reference(query, keys, values, indices, lengths, scaling, **options)


def sparse_decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    held: torch.Tensor | None = None,
    want_mass: bool = False,
    add_mass_to: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    out: torch.Tensor | None = None,
):
    """Plain torch: gather the indexed K/V rows (`[B, Hkv, K, D]`, the budget, not the cache), then
    float32 logits, softmax and weighted sum. The CPU path and the kernel's ground truth."""
    scaling = _check(query, keys, values, indices, lengths, scaling, held, want_mass, add_mass_to)
    _check_paged(block_table, block_size, add_mass_to, held)
    b, hq, d = query.shape
    slots = indices if block_table is None else physical_slots(indices, block_table, block_size)
    rows = slots.long().unsqueeze(-1)
    picked_keys = keys.gather(2, rows.expand(-1, -1, -1, d)).float()
    picked_values = values.gather(2, rows.expand(-1, -1, -1, values.shape[-1])).float()
    valid = _valid_indices(indices, lengths)  # [B, Hkv, K]
    if held is not None:
        valid = valid & (held.gather(2, indices.long()) >= 0)
    probs = grouped_probs(query.unsqueeze(2).float(), picked_keys, valid.unsqueeze(2), scaling)
    probs = probs * valid.any(-1)[..., None, None, None]  # empty rows: zeros, not a uniform average
    result = torch.matmul(probs, picked_values.unsqueeze(2)).reshape(b, hq, -1).to(query.dtype)  # [B, Hkv, G, 1, D]
    out = result if out is None else out.copy_(result)
    if want_mass:
        return out, probs.sum(dim=(2, 3))
    if add_mass_to is not None:  # uncounted positions add zeros
        add_mass_to.scatter_add_(2, indices.long(), probs.sum(dim=(2, 3)))
    return out


def sparse_decode_attention_triton(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    held: torch.Tensor | None = None,
    want_mass: bool = False,
    add_mass_to: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    out: torch.Tensor | None = None,
    split_size: int | None = None,
    num_stages: int | None = None,
):
    """The Triton kernel. `split_size` (the list's indices per split: `ceil(K / split_size)` splits,
    which take its tiles in turn) overrides `choose_split_size`, to cover the split merge in tests or
    to tune on a GPU; `num_stages` > 1 has Triton's pipeliner issue the next tile's gathers while
    one tile is computed (a paged tile is otherwise three dependent round trips: index, block
    table, K/V); by default a paged read whose splits walk two tiles or more pipelines two deep."""
    if triton is None:
        raise RuntimeError("the sparse decode kernel needs Triton (pip install 'atskv[gpu]' or 'atskv[test]')")
    scaling = _check(query, keys, values, indices, lengths, scaling, held, want_mass, add_mass_to)
    _check_paged(block_table, block_size, add_mass_to, held)
    b, hq, d = query.shape
    hkv, num_indices = keys.shape[1], indices.shape[-1]
    group = hq // hkv
    paged = block_table is not None
    if split_size is None:
        split_size = choose_split_size(num_indices, b * hkv, d, query.device, PAGED_WAVES if paged else WAVES)
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    if num_stages is None:
        num_stages = 2 if paged and split_size >= 2 * _block_n(d) else 1
    splits = max(1, math.ceil(num_indices / split_size))
    if out is None:
        out = torch.empty(b, hq, d, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.stride(-1) != 1 or out.stride(1) != d or out.dtype != query.dtype:
        raise ValueError(f"out must be [B, Hq, D] = {tuple(query.shape)} rows of {d}, got {tuple(out.shape)}")
    table = block_table if paged else indices  # an unused pointer without a table
    if splits == 1:
        partial = max_logit = total = out  # the split kernel writes the output itself
    else:
        partial = torch.empty(b * hkv, splits, group, d, dtype=torch.float32, device=query.device)
        max_logit = torch.empty(b * hkv, splits, group, dtype=torch.float32, device=query.device)
        total = torch.empty_like(max_logit)
    has_lengths, has_held = lengths is not None, held is not None
    lengths = lengths if has_lengths else indices  # unused pointers when absent
    held = held if has_held else indices
    logits = lse = out  # unused pointers without the mass
    with_mass = want_mass or add_mass_to is not None
    if with_mass:
        logits = torch.empty(b * hq, num_indices, dtype=torch.float32, device=query.device)
        lse = torch.empty(b * hq, dtype=torch.float32, device=query.device)
    grid = (b * hkv, splits)
    _split_kernel[grid](
        query, keys, values, indices, lengths, held, table, partial, max_logit, total, logits, lse, out,
        *query.stride(), *keys.stride(), *values.stride(), *indices.stride(), lengths.stride(0), lengths.stride(1),
        *held.stride()[:3], table.stride(0), table.stride(-1), out.stride(0), hkv, num_indices, splits,
        max(block_size, 1), scaling * _LOG2E,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_N=_block_n(d),
        HAS_LENGTHS=has_lengths, HAS_HELD=has_held, PAGED=paged, WANT_MASS=with_mass, SINGLE_SPLIT=splits == 1,
        NUM_STAGES=num_stages, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # not TF32
        # Triton's interpreter (the only way to run on CPU tensors) multiplies bf16 as raw integers
        UPCAST_DOT=query.dtype == torch.bfloat16 and not query.is_cuda,
        num_warps=4, **dependent_launch(query, grid),
    )  # fmt: skip
    if splits > 1:
        grid = (b * hq,)
        _merge_kernel[grid](
            partial, max_logit, total, out, lse, group, splits, out.stride(0), hq,
            HEAD_DIM=d, BLOCK_S=triton.next_power_of_2(splits), WANT_LSE=with_mass, num_warps=4,
            **dependent_launch(query, grid),
        )  # fmt: skip
    if not with_mass:
        return out
    at_slots = add_mass_to is not None
    mass = add_mass_to if at_slots else torch.empty(b, hkv, num_indices, dtype=torch.float32, device=query.device)
    block_k = 256
    grid = (b * hkv, triton.cdiv(num_indices, block_k))
    _mass_kernel[grid](
        logits, lse, lengths, indices, mass, hkv, num_indices, lengths.stride(0), lengths.stride(1),
        *indices.stride(), *mass.stride(),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_K=block_k, HAS_LENGTHS=has_lengths,
        AT_SLOTS=at_slots, num_warps=4, **dependent_launch(query, grid),
    )  # fmt: skip
    return out if at_slots else (out, mass)


def choose_split_size(num_indices: int, programs: int, head_dim: int, device: torch.device, waves: int = WAVES) -> int:
    """Indices per split. `programs` (B * Hkv) already give that many programs; a long index list is
    split further until the grid holds about `waves` programs per SM, but never into shares under
    MIN_SPLIT_TILES tiles, so short lists and large batches run one split. (At the 8B shape, 5% of
    32K, B=1, more splits of fewer tiles won, merge included: docs/results/kernel-notes.md.) Off CUDA
    (the interpreter) one split."""
    block_n = _block_n(head_dim)
    tiles = max(1, math.ceil(num_indices / block_n))
    if device.type != "cuda":
        return tiles * block_n
    splits = max(1, min(math.ceil(waves * sm_count(device) / programs), tiles // MIN_SPLIT_TILES, MAX_SPLITS))
    return math.ceil(tiles / splits) * block_n


def _block_n(head_dim: int) -> int:
    """Indices per tile: 4096 / D (64 at D <= 64, 32 at 128, 16 at 256), so a tile's K and V, both
    gathered before the products, stay 16 KB in bf16. Compiled for sm_90 with 4 warps this takes
    183-194 registers and no spills (two programs per SM); 8 KB more per tile spills."""
    return min(64, 4096 // head_dim)


def _check_paged(block_table, block_size: int, add_mass_to, held) -> None:
    if block_table is None:
        return
    if block_size < 1 or block_table.dim() != 2 or block_table.is_floating_point():
        raise ValueError(f"a paged read needs an integer block_table [B, W] and block_size >= 1, got {block_size}")
    if add_mass_to is not None or held is not None:  # slots are physical there: `want_mass` is by index
        raise ValueError("a paged read takes no held slots and adds no mass in place (use want_mass)")


def _valid_indices(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """`[B, Hkv, K]` bool: which index positions count."""
    if lengths is None:
        return torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    return torch.arange(indices.shape[-1], device=indices.device) < lengths.unsqueeze(-1)


def _check(query, keys, values, indices, lengths, scaling, held=None, want_mass=False, add_mass_to=None) -> float:
    """Validates shapes and dtypes (not index ranges: that would need a device sync); returns the scale."""
    if query.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"expected query [B, Hq, D], keys = values [B, Hkv, S, D]; got {query.shape}, "
                         f"{keys.shape}, {values.shape}")  # fmt: skip
    b, hq, d = query.shape
    hkv = keys.shape[1]
    if keys.shape[0] != b or keys.shape[3] != d or hq % hkv:
        raise ValueError(f"query {tuple(query.shape)} does not fit keys {tuple(keys.shape)} (GQA needs Hq % Hkv == 0)")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head dim must be a power of two in [16, 256], got {d}")
    if keys.dtype != query.dtype or values.dtype != query.dtype:
        raise TypeError(f"query, keys and values must share a dtype, got {query.dtype}, {keys.dtype}, {values.dtype}")
    if indices.dim() != 3 or indices.shape[:2] != (b, hkv) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32/int64 [B, Hkv, K] = [{b}, {hkv}, K], got {indices.dtype} "
                         f"{tuple(indices.shape)}")  # fmt: skip
    if lengths is not None and (lengths.shape != (b, hkv) or lengths.is_floating_point()):
        raise ValueError(f"lengths must be an integer [B, Hkv] = [{b}, {hkv}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")  # fmt: skip
    if held is not None and held.shape != keys.shape[:3]:
        raise ValueError(f"held must be the slot positions [B, Hkv, S] = {list(keys.shape[:3])}, "
                         f"got {tuple(held.shape)}")  # fmt: skip
    if add_mass_to is not None and (want_mass or add_mass_to.shape != keys.shape[:3]
                                    or add_mass_to.dtype != torch.float32):  # fmt: skip
        raise ValueError(f"add_mass_to must be float32 [B, Hkv, S] = {list(keys.shape[:3])}, without want_mass; "
                         f"got {add_mass_to.dtype} {tuple(add_mass_to.shape)}")  # fmt: skip
    return d**-0.5 if scaling is None else float(scaling)


@jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, held_ptr, table_ptr, out_ptr, max_ptr, sum_ptr, logit_ptr, lse_ptr, res_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ib, stride_ih, stride_ik,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps, stride_tb, stride_tw, stride_rb,
    num_kv_heads, num_indices, num_splits, block_size, qk_scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, HAS_HELD: tl.constexpr, PAGED: tl.constexpr, WANT_MASS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (batch row, KV head) and one split: online softmax over the split's share of the index
    list, for the group's G query heads at once (rows past G are zero queries, never stored).
    With `WANT_MASS` every logit (base 2, -inf where skipped) and each row's log-sum-exp are kept."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: batch/head offsets into a large cache overflow int32
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    in_group = g < GROUP
    q = tl.load(
        q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=in_group[:, None],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K, V and probabilities follow q's dtype into the products
    length = num_indices
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b * stride_lb + h * stride_lh).to(tl.int32), num_indices)
    tiles = tl.cdiv(length, BLOCK_N)
    idx_row = idx_ptr + b * stride_ib + h * stride_ih
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    row = bh * GROUP + g  # = b * Hq + query head

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in tl.range(split, tiles, num_splits, num_stages=NUM_STAGES):
        offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs < length
        slot = tl.load(idx_row + offs * stride_ik, mask=valid, other=0).to(tl.int64)
        if PAGED:  # a logical position: through the row's block table to its physical slot
            block = tl.load(table_ptr + b * stride_tb + (slot // block_size) * stride_tw, mask=valid, other=0)
            slot = block.to(tl.int64) * block_size + slot % block_size
        if HAS_HELD:  # a free slot is skipped: a tile may then have no finite logit
            valid &= tl.load(held_ptr + b * stride_pb + h * stride_ph + slot * stride_ps, mask=valid, other=-1) >= 0
        k = tl.load(k_row + slot[:, None] * stride_ks + d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        v = tl.load(v_row + slot[:, None] * stride_vs + d[None, :] * stride_vd, mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        if WANT_MASS:
            tl.store(logit_ptr + row[:, None] * num_indices + offs[None, :], qk,
                     mask=in_group[:, None] & (offs < length)[None, :])  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # no NaN from (-inf) - (-inf)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        if WANT_MASS:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
            tl.store(lse_ptr + row, lse, mask=in_group)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty row has acc = 0: zeros
        out_rows = res_ptr + b * stride_rb + (h * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_rows, out.to(res_ptr.dtype.element_ty), mask=in_group[:, None])
    else:
        part = (bh * num_splits + split) * GROUP + g
        tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=in_group[:, None])
        tl.store(max_ptr + part, m_i, mask=in_group)
        tl.store(sum_ptr + part, l_i, mask=in_group)


@jit
def _merge_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, lse_ptr, group, num_splits, stride_ob, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, WANT_LSE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One query head: merges its splits' (max, sum, accumulator) by log-sum-exp. Splits that saw
    no index have max -inf and weigh 0; if all did, the output is zeros."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # = b * Hq + query head
    bh = row // group
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    part = (bh * num_splits + s) * group + row % group
    # every load first, in one round trip to memory (a reduction between them would wait for it)
    m = tl.load(max_ptr + part, mask=s < num_splits, other=float("-inf"))
    partial_sum = tl.load(sum_ptr + part, mask=s < num_splits, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0))
    total = tl.sum(weight * partial_sum, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    at = out_ptr + (row // num_heads) * stride_ob + (row % num_heads) * HEAD_DIM + d
    tl.store(at, out.to(out_ptr.dtype.element_ty))
    if WANT_LSE:
        tl.store(lse_ptr + row, tl.where(total > 0, m_all + tl.log2(tl.maximum(total, 1e-30)), float("-inf")))


@jit
def _mass_kernel(
    logit_ptr, lse_ptr, len_ptr, idx_ptr, mass_ptr, num_kv_heads, num_indices, stride_lb, stride_lh,
    stride_ib, stride_ih, stride_ik, stride_mb, stride_mh, stride_mk,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    AT_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (batch row, KV head) and a block of index positions: each position's probability,
    summed over the group's query heads; positions past the row's length get 0. `AT_SLOTS`: added
    to the mass at each counted position's slot instead (slots are distinct within a row, so no
    two programs read and write the same one)."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // num_kv_heads, bh % num_kv_heads
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    g = tl.arange(0, BLOCK_G)
    length = num_indices
    if HAS_LENGTHS:
        length = tl.minimum(tl.load(len_ptr + b * stride_lb + h * stride_lh).to(tl.int32), num_indices)
    counted = k < length
    row = bh * GROUP + g
    lse = tl.load(lse_ptr + row, mask=g < GROUP, other=float("-inf"))
    logit = tl.load(logit_ptr + row[:, None] * num_indices + k[None, :],
                    mask=(g < GROUP)[:, None] & counted[None, :], other=float("-inf"))  # fmt: skip
    finite = (logit > float("-inf")) & (lse > float("-inf"))[:, None]
    p = tl.where(finite, tl.exp2(logit - tl.where(finite, lse[:, None], 0.0)), 0.0)
    mass = tl.sum(p, 0)
    sink = mass_ptr + b * stride_mb + h * stride_mh
    if AT_SLOTS:
        slot = tl.load(idx_ptr + b * stride_ib + h * stride_ih + k * stride_ik, mask=counted, other=0).to(tl.int64)
        tl.store(sink + slot * stride_mk, tl.load(sink + slot * stride_mk, mask=counted) + mass, mask=counted)
    else:
        tl.store(sink + k * stride_mk, mass, mask=k < num_indices)
