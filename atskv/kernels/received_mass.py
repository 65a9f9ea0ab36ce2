"""Attention mass every key slot receives from a causal prompt chunk, without the `[Tq, S]`
probabilities: what H2O-style selectors (H2O, the learned selector) accumulate during the
chunked prefill of `atskv.generate`.

A chunk of `Tq` queries `[B, Hq, Tq, D]` at absolute positions `offset .. offset + Tq - 1` over a
slot buffer `keys` `[B, Hkv, S, D]` that holds the prompt so far in slots `0 .. offset + Tq - 1`
in position order: query `i` sees slots `0 .. offset + i`. Given each query's natural-log
log-sum-exp over what it saw (`lse` `[B, Hq, Tq]` float32, as `prefix_causal_attention` returns
it), the mass of slot `j` is `sum over the group's G = Hq / Hkv heads and the queries that see j
of exp(q . k_j * scaling - lse)`, `[B, Hkv, S]` float32. Slots past `offset + Tq` (the static
buffer's free ones) get 0, and a query whose `lse` is -inf (it saw nothing) gives nothing, as in
`atskv.attention.received_mass`. The GQA group shares its KV head's keys, which are never expanded.
With `query_stride` s > 1 the queries are a sample of the chunk's, every s-th: query `i` sits at
position `offset + i * s` and sees slots `0 .. offset + i * s` (the buffer still holds the whole
chunk), which estimates the chunk's mass at 1/s of the cost when scaled by s.

Why a kernel: the torch path (`received_mass`, a block of queries at a time) writes and reads a
`[B, Hkv, G, block, S]` float32 logits buffer, then its exp, mask and sum. At long contexts
that made the prefill of H2O / learned many times longer than the other selectors', whose prefill
is flash attention alone.

The kernel is flash attention's backward dK loop without the gradients: each program holds one
(batch row, KV head) and a block of `BLOCK_N` keys (loaded once), and walks the blocks of
`BLOCK_M` queries of every head of the group that can see those keys, `HEADS` heads' blocks side
by side in a step's tile (causal skip: the queries before the block's first slot never load). Per
step one `tl.dot` gives the `[BLOCK_N, HEADS * BLOCK_M]` logits, `exp2` (log2(e) folded into the
scale and the lse) their probabilities, summed over the queries into the block's running mass.
Only the few query blocks that cross the diagonal apply the causal mask; queries past `Tq` load an
lse of +inf and contribute 0. Programs of one KV head run side by side (the key block is the
grid's fastest axis), so the group's queries are read from L2.

The torch reference is `received_mass` with a causal `allowed`, exactly what the chunked prefill
computed before. Its logits are the matmul's output in the input dtype (bf16 rounds them), the
kernel's the float32 accumulator: in bf16 the two differ by that rounding, and the kernel is the
one consistent with the float32 log-sum-exp of the flash kernels.
"""

from __future__ import annotations

import torch

from atskv.attention import received_mass
from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.paged import request_slots

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # larger head dims take the reference (no model the package supports has one)
# The kernels' arguments that change with every chunk a server schedules (its token count, its
# offset, the request's length so far, strides of buffers sized by them). Triton compiles a
# variant per combination of which of them are 1 or multiples of 16; during serving that means
# compiles in the middle of prefills (a second or more each), so they stay unspecialised.
_LSE_PER_CHUNK = ["num_queries", "offset", "stride_kb", "stride_lb", "stride_lh"]
# The mass kernel also reads the log-sum-exps where FlashAttention left them: a view at the
# request's first sampled query, whose address is 16-byte aligned or not by the chunk (with
# `prompt_sample` 8 at 32K x 8 on the H100, an unaligned one compiled inside a timed prefill).
_MASS_PER_CHUNK = [*_LSE_PER_CHUNK, "num_slots", "stride_ob", "stride_oh", "lse_ptr", "table_ptr"]


def prefix_received_mass(
    query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, offset: int, scaling: float, query_stride: int = 1
) -> torch.Tensor:
    """Mass `[B, Hkv, S]` (float32) each slot receives from a causal prompt chunk at `offset`, or
    from every `query_stride`-th of its queries (see the module docstring): the Triton kernel on
    CUDA, the torch reference elsewhere (see `kernels.backend`) and for head dims over `MAX_HEAD_DIM`."""
    if use_triton(query) and query.shape[-1] <= MAX_HEAD_DIM:
        return prefix_received_mass_triton(query, keys, lse, offset, scaling, query_stride=query_stride)
    return prefix_received_mass_reference(query, keys, lse, offset, scaling, query_stride=query_stride)


def paged_received_mass(
    query: torch.Tensor, key_slots: torch.Tensor, table_row: torch.Tensor, block_size: int, length: int,
    lse: torch.Tensor, offset: int, scaling: float, query_stride: int = 1,
) -> torch.Tensor:  # fmt: skip
    """`prefix_received_mass` `[1, Hkv, length]` of one request whose keys lie in a paged cache:
    `key_slots` `[Hkv, num_slots, D]` by physical slot, position `p < length` at slot
    `table_row[p // block_size] * block_size + p % block_size`. The kernel reads the keys through
    the table, where a gathered copy of them took as long as the mass itself (vLLM's prefill at 32K
    batch 8, H100); the reference gathers them."""
    if use_triton(query) and query.shape[-1] <= MAX_HEAD_DIM:
        table = (table_row, block_size, length)
        return prefix_received_mass_triton(query, key_slots.unsqueeze(0), lse, offset, scaling,
                                           query_stride=query_stride, table=table)  # fmt: skip
    keys = key_slots[:, request_slots(table_row, block_size, length)].unsqueeze(0)
    return prefix_received_mass_reference(query, keys, lse, offset, scaling, query_stride=query_stride)


def prefix_received_mass_reference(
    query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, offset: int, scaling: float,
    max_elements: int = 1 << 27, query_stride: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Plain torch: `received_mass` over the chunk's visible slots `0 .. offset + (Tq - 1) * stride`
    with a causal `allowed`, padded with zeros to the buffer's `S` slots (what
    `StaticSession.prompt_chunk` did before the kernel). The CPU path and the kernel's ground truth."""
    _check(query, keys, lse, offset, query_stride)
    tq, slots = query.shape[2], keys.shape[2]
    stop = offset + (tq - 1) * query_stride + 1
    slot = torch.arange(stop, device=keys.device)

    def allowed(start: int, end: int) -> torch.Tensor:  # [1, 1, end - start, stop]
        position = offset + torch.arange(start, end, device=keys.device) * query_stride
        return (slot <= position[:, None]).view(1, 1, end - start, stop)

    mass = received_mass(query, keys[:, :, :stop], lse, allowed, scaling, max_elements)
    return torch.nn.functional.pad(mass, (0, slots - stop))


def prefix_received_mass_triton(
    query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, offset: int, scaling: float, *,
    query_stride: int = 1, table: tuple[torch.Tensor, int, int] | None = None, block_n: int | None = None,
    block_m: int | None = None, heads_per_step: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernel. `table` (a block table row, its block size, the request's length): the
    keys `[1, Hkv, num_slots, D]` are a paged cache's physical slots, read through the row
    (`paged_received_mass`). `block_n` (keys per program), `block_m` (queries per step),
    `heads_per_step` (the group's heads whose `block_m` queries share a step: a power of two that
    divides the group), `num_warps` and `num_stages` override `choose_config`, to cover several
    blocks in tests or to tune on a GPU."""
    if triton is None:
        raise RuntimeError("the received-mass kernel needs Triton (pip install 'atskv[gpu]' or 'atskv[test]')")
    table_row, page, slots = (keys, 0, keys.shape[2]) if table is None else table
    _check(query, keys, lse, offset, query_stride, slots)
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"the kernel takes head dims up to {MAX_HEAD_DIM}, got {d}")
    config = choose_config(d, query.dtype)
    overrides = {"block_n": block_n, "block_m": block_m, "heads_per_step": heads_per_step, "num_warps": num_warps,
                 "num_stages": num_stages}  # fmt: skip
    config.update({key: value for key, value in overrides.items() if value is not None})
    heads = config["heads_per_step"]
    if heads < 1 or heads & (heads - 1) or (hq // hkv) % heads:
        raise ValueError(f"heads_per_step must be a power of two dividing the group of {hq // hkv}, got {heads}")
    lse = lse.float()
    mass = torch.empty(b, hkv, slots, dtype=torch.float32, device=keys.device)
    if slots == 0:
        return mass
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(slots, config["block_n"]), b * hkv)  # key blocks fastest: a KV head's programs run together
    _mass_kernel[grid](
        query, keys, lse, mass, table_row,
        *query.stride(), *keys.stride(), *lse.stride(), *mass.stride(),
        hkv, tq, slots, int(offset), int(query_stride), float(scaling) * _LOG2E,
        GROUP=hq // hkv, HEADS=heads, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=config["block_n"],
        BLOCK_M=config["block_m"],
        PAGE=int(page), DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # fp32 stays fp32, not TF32
        # Triton's interpreter (the only way to run on CPU tensors) multiplies bf16 as raw integers
        UPCAST_DOT=query.dtype == torch.bfloat16 and not query.is_cuda,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return mass


def choose_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Block sizes and launch options. 16-bit inputs: 128 keys per program (their tile, 32 KB at
    D = 128, stays on chip for the whole walk) against 64 queries per step, 4 warps (the best of a
    sweep of 36 settings at the 8B shape, tuned on an H200, see docs/results/kernel-notes.md); half
    the keys and 8 warps at D > 128 (not swept). One head's queries a step (`heads_per_step`
    above 1, untimed, is swept by `benchmarks/vllm_prompt_profile.py --sweep`).
    float32 (tests, not a GPU target) uses smaller tiles."""
    if dtype == torch.float32:
        return {"block_n": 64 if head_dim <= 128 else 32, "block_m": 32, "heads_per_step": 1, "num_warps": 4,
                "num_stages": 2}  # fmt: skip
    if head_dim > 128:
        return {"block_n": 64, "block_m": 64, "heads_per_step": 1, "num_warps": 8, "num_stages": 3}
    return {"block_n": 128, "block_m": 64, "heads_per_step": 1, "num_warps": 4, "num_stages": 3}


def _check(query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor | None, offset: int, stride: int = 1,
           slots: int | None = None) -> None:  # fmt: skip
    """Validates shapes and dtypes (`lse` None: the log-sum-exps are what is being computed;
    `slots`: the positions the keys hold where they are a paged cache's, else its length)."""
    if query.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"expected query [B, Hq, Tq, D] and keys [B, Hkv, S, D], got {tuple(query.shape)}, "
                         f"{tuple(keys.shape)}")  # fmt: skip
    b, hq, tq, d = query.shape
    hkv, slots = keys.shape[1], keys.shape[2] if slots is None else slots
    if keys.shape[0] != b or keys.shape[3] != d or hq % hkv:
        raise ValueError(f"query {tuple(query.shape)} does not fit keys {tuple(keys.shape)} (GQA needs Hq % Hkv == 0)")
    if keys.dtype != query.dtype:
        raise TypeError(f"query and keys must share a dtype, got {query.dtype}, {keys.dtype}")
    if lse is not None and (lse.shape != (b, hq, tq) or not lse.is_floating_point()):
        raise ValueError(f"lse must be a float [B, Hq, Tq] = [{b}, {hq}, {tq}], got {lse.dtype} {tuple(lse.shape)}")
    if stride < 1 or not 0 <= offset <= slots - (tq - 1) * stride - 1:
        raise ValueError(f"the chunk's {tq} queries at offset {offset}, {stride} apart, need offset + (Tq - 1) * "
                         f"stride < S = {slots} slots")  # fmt: skip


@jit(do_not_specialize=_MASS_PER_CHUNK)
def _mass_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr, table_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_lt,
    stride_ob, stride_oh, stride_os,
    num_kv_heads, num_queries, num_slots, offset, query_stride, qk_scale,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One block of keys of one (batch row, KV head): the mass its slots receive from the group's
    queries, a step's tile holding `BLOCK_M` queries of each of `HEADS` heads of the group. Query
    `i` sees slot `j` iff `j <= offset + i * query_stride`; query blocks wholly before the key
    block are skipped, those crossing the diagonal masked, the rest summed without a mask.
    `PAGE` > 0: position `j`'s key is at physical slot `table[j // PAGE] * PAGE + j % PAGE`."""
    bh = tl.program_id(1).to(tl.int64)  # 64-bit: batch/head offsets into a large cache overflow int32
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    start = tl.program_id(0) * BLOCK_N
    j = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k_mask = (j < num_slots)[:, None]
    if BLOCK_D != HEAD_DIM:
        k_mask = k_mask & (d < HEAD_DIM)[None, :]
    if PAGE > 0:  # 64-bit: a physical slot times its stride overflows int32 in a large cache
        row = tl.load(table_ptr + j // PAGE, mask=j < num_slots, other=0).to(tl.int64) * PAGE + j % PAGE
    else:
        row = j
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + row[:, None] * stride_ks + d[None, :] * stride_kd,
                mask=k_mask, other=0.0)  # fmt: skip
    if UPCAST_DOT:
        k = k.to(tl.float32)
    q_row = q_ptr + b * stride_qb + h * GROUP * stride_qh
    lse_row = lse_ptr + b * stride_lb + h * GROUP * stride_lh

    # query blocks: [first, full) cross the diagonal (some query misses some slot), [full, blocks) see it all
    blocks = tl.cdiv(num_queries, BLOCK_M)
    first = tl.minimum(tl.maximum(start - offset, 0) // query_stride // BLOCK_M, blocks)
    full = tl.cdiv(tl.maximum(start + BLOCK_N - 1 - offset, 0), query_stride * BLOCK_M)
    full = tl.minimum(tl.maximum(full, first), blocks)
    tile = tl.arange(0, HEADS * BLOCK_M)  # a step's columns: (head of the step, query of the block)
    mass = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, GROUP, HEADS):
        heads = g + tile // BLOCK_M
        q_heads, lse_heads = q_row + heads * stride_qh, lse_row + heads * stride_lh
        for m in range(first, full):
            i = m * BLOCK_M + tile % BLOCK_M
            p = _probs(q_heads, lse_heads, k, i, d, stride_qt, stride_qd, stride_lt, num_queries, qk_scale, HEAD_DIM,
                       BLOCK_D, DOT_PRECISION, UPCAST_DOT)  # fmt: skip
            mass += tl.sum(tl.where(j[:, None] <= offset + i[None, :] * query_stride, p, 0.0), 1)
        for m in range(full, blocks):
            i = m * BLOCK_M + tile % BLOCK_M
            p = _probs(q_heads, lse_heads, k, i, d, stride_qt, stride_qd, stride_lt, num_queries, qk_scale, HEAD_DIM,
                       BLOCK_D, DOT_PRECISION, UPCAST_DOT)  # fmt: skip
            mass += tl.sum(p, 1)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + j * stride_os, mass, mask=j < num_slots)


@jit
def _probs(
    q_heads, lse_heads, k, i, d, stride_qt, stride_qd, stride_lt, num_queries, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """`[BLOCK_N, columns]` probabilities `exp(q . k * scale - lse)` of the queries `i` of the heads
    whose rows start at `q_heads` and `lse_heads` (a column each, by base 2); queries past the chunk
    and those with lse -inf give 0."""
    rows = i < num_queries
    q_mask = rows[None, :]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (d < HEAD_DIM)[:, None]
    q_t = tl.load(q_heads[None, :] + d[:, None] * stride_qd + i[None, :] * stride_qt, mask=q_mask, other=0.0)
    lse = tl.load(lse_heads + i * stride_lt, mask=rows, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # saw nothing: gives nothing
    if UPCAST_DOT:
        q_t = q_t.to(tl.float32)
    logits = tl.dot(k, q_t, input_precision=DOT_PRECISION)
    return tl.exp2(logits * qk_scale - lse[None, :])


def prefix_lse(query: torch.Tensor, keys: torch.Tensor, offset: int, scaling: float) -> torch.Tensor:
    """Each query's natural-log log-sum-exp `[B, Hq, Tq]` (float32) over what it sees of `keys`
    (slots `0 .. offset + i`, the layout of `prefix_received_mass`): the `lse` that kernel takes,
    where nothing else computed it. The Triton kernel (the logits alone: no values read or
    multiplied) on CUDA; elsewhere `prefix_causal_attention` with the keys standing in for the values."""
    if use_triton(query) and query.shape[-1] <= MAX_HEAD_DIM:
        return prefix_lse_triton(query, keys, offset, scaling)
    return prefix_lse_reference(query, keys, offset, scaling)


def prefix_lse_reference(query: torch.Tensor, keys: torch.Tensor, offset: int, scaling: float) -> torch.Tensor:
    from atskv.attention import prefix_causal_attention

    visible = keys[:, :, : offset + query.shape[2]]
    return prefix_causal_attention(query, visible, visible, offset, scaling)[1].float()


def prefix_lse_triton(query: torch.Tensor, keys: torch.Tensor, offset: int, scaling: float, *,
                      block_m: int = 64, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """The kernel: one program per (block of `block_m` queries, query head), walking the keys it
    sees `block_n` at a time with a running max and sum of exps (flash attention's forward
    without its values)."""
    _check(query, keys, None, offset)
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=query.device)
    grid = (triton.cdiv(tq, block_m), b * hq)
    _lse_kernel[grid](
        query, keys, lse, *query.stride(), *keys.stride(), *lse.stride(), hq, hq // hkv, tq, int(offset),
        float(scaling) * _LOG2E, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        UPCAST_DOT=query.dtype == torch.bfloat16 and not query.is_cuda, num_warps=num_warps,
    )  # fmt: skip
    return lse


@jit(do_not_specialize=_LSE_PER_CHUNK)
def _lse_kernel(
    q_ptr, k_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_lt,
    num_heads, group, num_queries, offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One block of queries of one head: query `i` sees slot `j` iff `j <= offset + i`; key blocks
    wholly before the block's first query's last slot go unmasked, the few after it masked."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rows = i < num_queries
    q_mask = rows[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # fmt: skip
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_row = k_ptr + b * stride_kb + (h // group) * stride_kh
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    last = offset + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, num_queries)  # slots the block sees: < last
    unmasked = offset + tl.program_id(0) * BLOCK_M + 1  # every query of the block sees slots below this
    for start in range(0, last, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_row + j[:, None] * stride_ks + d[None, :] * stride_kd,
                    mask=(j < last)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
        if UPCAST_DOT:
            k = k.to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], base 2
        if start + BLOCK_N > unmasked:
            logits = tl.where(j[None, :] <= offset + i[:, None], logits, float("-inf"))
        step_top = tl.maximum(top, tl.max(logits, 1))
        safe = tl.where(step_top == float("-inf"), 0.0, step_top)
        total = total * tl.exp2(top - safe) + tl.sum(tl.exp2(logits - safe[:, None]), 1)
        top = step_top
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + i * stride_lt, (top + tl.log2(total)) / 1.4426950408889634,
             mask=rows)  # fmt: skip
