"""The learned selector's prompt ranking inside vLLM: every token of a request's prompt scored by
the predictor at the prompt's end, in one kernel a layer. The torch form (feature columns, then the
MLP's batch norm, concatenated embeddings, two matmuls and a ReLU, in passes that bound its
hidden units' memory) took ~100 kernels and ~8 ms a layer at 128K on an H100, beside the prompt
mass it scores.

A program takes one KV head and a block of positions: the features by `feature_columns`'
definitions (attention received, position and age against the newest token, the key's norm from
the keys themselves, the previous managed layer's attention; the hidden-state norm 0), then the
folded MLP (`atskv.kernels.listed_refresh.FoldedMLP`, whose `folded_logit` the refresh kernel
shares)."""

from __future__ import annotations

import torch

from atskv.features import SCALAR_FEATURES, feature_columns
from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.listed_refresh import KERNEL_FEATURES, FoldedMLP, folded_logit, folded_logit_mma
from atskv.kernels.paged import request_slots


def prompt_scores(attention: torch.Tensor | None, previous: torch.Tensor | None, keys: torch.Tensor,
                  mlp: FoldedMLP, layer: int) -> torch.Tensor:  # fmt: skip
    """Logits `[Hkv, L]` of a prompt's `L` tokens for managed layer `layer` from their `keys`
    `[Hkv, L, D]` (any strides), the attention each received `[Hkv, L]` (None: the predictor reads
    none) and the previous managed layer's `[L]` (None: the first, or none read)."""
    if use_triton(keys):
        return prompt_scores_triton(attention, previous, keys, mlp, layer)
    return prompt_scores_reference(attention, previous, keys, mlp, layer)


def paged_prompt_scores(attention: torch.Tensor | None, previous: torch.Tensor | None, key_slots: torch.Tensor,
                        table_row: torch.Tensor, block_size: int, length: int, mlp: FoldedMLP,
                        layer: int) -> torch.Tensor:  # fmt: skip
    """`prompt_scores` of one request's `length` tokens whose keys lie in a paged cache:
    `key_slots` `[Hkv, num_slots, D]` by physical slot, position `p` at slot
    `table_row[p // block_size] * block_size + p % block_size`. The kernel reads the keys through
    the table (a gathered copy took half the ranking's time at 32K); the reference gathers them."""
    if use_triton(key_slots):
        return prompt_scores_triton(attention, previous, key_slots, mlp, layer, table=(table_row, block_size, length))
    return prompt_scores_reference(attention, previous, key_slots[:, request_slots(table_row, block_size, length)],
                                   mlp, layer)  # fmt: skip


def prompt_scores_reference(attention, previous, keys, mlp: FoldedMLP, layer: int) -> torch.Tensor:
    heads, length, _ = keys.shape
    position = torch.arange(length, device=keys.device, dtype=torch.float32)
    newest = torch.full((), length - 1.0, device=keys.device)  # a fill: a host scalar's copy would sync
    zeros = torch.zeros(length, device=keys.device)
    logits = []
    for h in range(heads):  # a head at a time: the hidden units of every (head, token) at 128K are gigabytes
        columns = feature_columns(zeros if attention is None else attention[h], position, newest, zeros,
                                  keys[h].float().norm(dim=-1), zeros if previous is None else previous)  # fmt: skip
        logits.append(mlp.logits(columns, mlp.bias[layer, h]))
    return torch.stack(logits)


def prompt_scores_triton(
    attention, previous, keys, mlp: FoldedMLP, layer: int, block_j: int = 32, block_h: int = 32,
    table: tuple[torch.Tensor, int, int] | None = None, num_warps: int = 4, mma: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One program per (KV head, `block_j` positions), `block_h` hidden units at a time, the MLP
    by fused multiply-adds or, with `mma`, on tensor cores (`folded_logit_mma`; the tile, `mma` and
    `num_warps` untuned: `benchmarks/vllm_prompt_profile.py --sweep` times the others).
    `table` (a block table row, its block size, the request's length): `keys` are a paged cache's
    physical slots, read through the row (`paged_prompt_scores`)."""
    if SCALAR_FEATURES != KERNEL_FEATURES:
        raise RuntimeError(f"the prompt kernel computes {KERNEL_FEATURES}, atskv's features are {SCALAR_FEATURES}")
    heads, length, dim = keys.shape
    table_row, page, length = (keys, 0, length) if table is None else table
    out = torch.empty(heads, length, device=keys.device, dtype=torch.float32)
    hidden = mlp.w.shape[1]
    _prompt_scores_kernel[(heads, triton.cdiv(length, block_j))](
        out, keys, table_row, out if attention is None else attention.float().contiguous(),
        out if previous is None else previous.float().contiguous(), mlp.w, mlp.bias[layer], mlp.w2, mlp.b2,
        float(length - 1), length, hidden, keys.stride(0), keys.stride(1), keys.stride(2),
        ATTENTION=attention is not None, PREVIOUS=previous is not None, D=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_J=block_j, BLOCK_H=block_h, PAGE=int(page), MMA=mma, num_warps=num_warps,
    )  # fmt: skip
    return out


@jit(do_not_specialize=["table_ptr"])  # a block table row's address: aligned or not by the row
def _prompt_scores_kernel(
    out_ptr, key_ptr, table_ptr, att_ptr, prev_ptr, w_ptr, bias_ptr, w2_ptr, b2, newest, length, hidden, stride_h,
    stride_t, stride_d,
    ATTENTION: tl.constexpr, PREVIOUS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE: tl.constexpr, MMA: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1).to(tl.int64) * BLOCK_J + tl.arange(0, BLOCK_J).to(tl.int64)
    valid = pos < length
    d = tl.arange(0, BLOCK_D)
    row = pos
    if PAGE > 0:  # position `pos`'s key at physical slot `table[pos // PAGE] * PAGE + pos % PAGE`
        row = tl.load(table_ptr + pos // PAGE, mask=valid, other=0).to(tl.int64) * PAGE + pos % PAGE
    key = tl.load(key_ptr + h * stride_h + row[:, None] * stride_t + d[None, :] * stride_d,
                  mask=valid[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)  # fmt: skip
    key_norm = tl.sqrt(tl.sum(key * key, 1))
    attention = tl.zeros([BLOCK_J], tl.float32)
    if ATTENTION:
        attention = tl.load(att_ptr + h * length + pos, mask=valid, other=0.0)
    prev = tl.zeros([BLOCK_J], tl.float32)
    if PREVIOUS:
        prev = tl.load(prev_ptr + pos, mask=valid, other=0.0)
    if MMA:
        logit = folded_logit_mma(attention, pos, newest, key_norm, prev, w_ptr, bias_ptr + h * hidden, w2_ptr, b2,
                                 hidden, BLOCK_J, BLOCK_H, "tf32x3")  # fmt: skip
    else:
        logit = folded_logit(attention, pos, newest, key_norm, prev, w_ptr, bias_ptr + h * hidden, w2_ptr, b2,
                             hidden, BLOCK_J, BLOCK_H)  # fmt: skip
    tl.store(out_ptr + h * length + pos, logit, mask=valid)
