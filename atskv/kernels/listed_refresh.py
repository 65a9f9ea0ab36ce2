"""The learned selector's refresh inside vLLM: every `refresh_every` decode steps of a request, the
score of each token on its kept list is recomputed from its current features, in one kernel a
layer that a CUDA graph holds (a row not due this step exits at once; the torch reference computes
every row and keeps the due ones).

Features by physical slot of the listed position (`atskv.features.feature_columns`, the
collection's definitions): the attention it received (`received`: the prompt's mass plus each
decode read's, over the group's heads and the queries that saw it), position and age against the
newest token, its key's norm, and the previous managed layer's attention at the same position
(its `received` averaged over the KV heads; none in the first). The predictor's MLP
(`RelevanceMLP`, no hidden-state inputs) is folded on the host once (`fold_mlp`): its batch norm
and first layer's scalar columns into one `[F, H]` matrix, the layer and head embeddings into a
bias `[layers, Hkv, H]`, so a program evaluates `w2 . relu(features @ w + bias) + b2` for a block
of entries, a block of hidden units at a time. Pinned entries (`window_share`) stay +inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.features import SCALAR_FEATURES, feature_columns
from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.budget import kept_tokens
from atskv.kernels.kept_lists import list_row, list_sizes, list_slot, list_slots
from atskv.kernels.paged import physical_slots

KERNEL_FEATURES = ("attention", "position", "log_age", "hidden_norm", "key_norm", "prev_attention")


@dataclass(frozen=True)
class FoldedMLP:
    """`RelevanceMLP` for raw scalar features `[N, F]`: logits = relu(x @ w + bias[layer, head]) @ w2 + b2."""

    w: torch.Tensor  # [F, H] float32
    bias: torch.Tensor  # [layers, Hkv, H] float32
    w2: torch.Tensor  # [H] float32
    b2: float

    def logits(self, columns: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """In torch (the kernels' references): logits of feature `columns` `[..., F]` with `bias`
        (rows of `self.bias`) broadcast against their hidden units `[..., H]`."""
        return torch.relu(columns @ self.w + bias) @ self.w2 + self.b2


def fold_mlp(mlp) -> FoldedMLP:
    """The folded form of an eval-mode `RelevanceMLP` that reads no projected hidden state and no
    token type (what the plugin's predictors are)."""
    if mlp.projected_width or mlp.types:
        raise ValueError("only a predictor without the hidden state and the token type folds")
    with torch.no_grad():
        w1, kept = mlp.w1.weight.float(), mlp.kept
        norm = mlp.scalar_norm
        scale = (norm.running_var.float() + norm.eps).rsqrt()
        w = torch.zeros(len(SCALAR_FEATURES), w1.shape[0], device=w1.device)
        w[kept] = (w1[:, : len(kept)] * scale[kept]).t()
        base = mlp.w1.bias.float() - (w * norm.running_mean.float().unsqueeze(1)).sum(0)
        layers, heads = mlp.layer_embedding.weight.float(), mlp.head_embedding.weight.float()
        at = len(kept)
        by_layer = layers @ w1[:, at : at + layers.shape[1]].t()  # [L, H]
        by_head = heads @ w1[:, at + layers.shape[1] : at + layers.shape[1] + heads.shape[1]].t()  # [Hkv, H]
        bias = base + by_layer.unsqueeze(1) + by_head.unsqueeze(0)
        return FoldedMLP(w.contiguous(), bias.contiguous(), mlp.w2.weight.float()[0].contiguous(),
                         float(mlp.w2.bias.float()[0]))  # fmt: skip


def refresh_listed_scores(kept, values, received, key_norm, previous, pinned, prompt_len, block_table, seq_lens,
                          block_size: int, budget: int | float, refresh_every: int, group: int, mlp: FoldedMLP,
                          layer: int, width: int) -> None:  # fmt: skip
    """In place: for each request due this step (`(seq_len - prompt) % refresh_every == 0`, past
    its prompt; `prompt_len` at the physical slot of its first position), `values` of its listed
    entries (the first `kept_tokens(budget, seq_len - 1)`) become the MLP's logits of their
    current features (+inf where `pinned`). `kept`, `values`: the lists (`[N + 1, Hkv]`, by
    physical slot of the list index); `received`, `key_norm`, `pinned`, `previous` (the previous
    managed layer's `received`, or None): by physical slot of the position."""
    args = (kept, values, received, key_norm, previous, pinned, prompt_len, block_table, seq_lens, block_size, budget,
            refresh_every, group, mlp, layer, width)  # fmt: skip
    if use_triton(values):
        return refresh_listed_scores_triton(*args)
    return refresh_listed_scores_reference(*args)


def listed_features(kept, received, key_norm, previous, block_table, seq_lens, block_size: int, group: int,
                    width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Features `[B, Hkv, width, F]` of each request's first `width` list entries, their list
    slots `[B, width]` and their positions' physical slots `[B, Hkv, width]` (entries past a
    list: garbage, unused)."""
    b, heads = block_table.shape[0], kept.shape[1]
    at = list_slots(block_table, seq_lens, block_size, width, kept.shape[0] - 1)
    context = seq_lens.long().view(b, 1, 1)
    positions = kept[at].transpose(1, 2).long().clamp(min=0).minimum((context - 1).clamp(min=0)).contiguous()
    where = physical_slots(positions, block_table, block_size).long()  # [B, Hkv, width]
    head = torch.arange(heads, device=kept.device).view(1, -1, 1)
    seen = (context - 1 - positions).clamp(min=1).float()  # the queries that attended the token so far
    attention = received[where, head] / group / seen
    prev = torch.zeros_like(attention) if previous is None else previous[where].mean(-1) / group / seen
    newest = (context - 1).float()
    columns = feature_columns(attention, positions.float(), newest, torch.zeros_like(attention),
                              key_norm[where, head], prev)  # fmt: skip
    return columns, at, where


def refresh_listed_scores_reference(kept, values, received, key_norm, previous, pinned, prompt_len, block_table,
                                    seq_lens, block_size: int, budget: int | float, refresh_every: int, group: int,
                                    mlp: FoldedMLP, layer: int, width: int) -> None:  # fmt: skip
    b, heads = block_table.shape[0], kept.shape[1]
    columns, at, where = listed_features(kept, received, key_norm, previous, block_table, seq_lens, block_size,
                                         group, width)  # fmt: skip
    logits = mlp.logits(columns, mlp.bias[layer].view(1, heads, 1, -1))
    head = torch.arange(heads, device=kept.device).view(1, -1, 1)
    logits = torch.where(pinned[where, head], torch.inf, logits)
    context = seq_lens.long().view(b, 1, 1)
    first = prompt_len[physical_slots(torch.zeros_like(context), block_table, block_size).long().view(b)].long()
    steps = context.view(b) - first
    due = (steps > 0) & (steps % refresh_every == 0)
    held = kept_tokens(budget, (context - 1).clamp(min=0))
    j = torch.arange(width, device=kept.device).view(1, 1, -1)
    write = due.view(b, 1, 1) & (j < held) & (j < context)
    current = values[at].transpose(1, 2)
    values[at.unsqueeze(1).expand(-1, heads, -1), head] = torch.where(write, logits, current)


def refresh_listed_scores_triton(kept, values, received, key_norm, previous, pinned, prompt_len, block_table,
                                 seq_lens, block_size: int, budget: int | float, refresh_every: int, group: int,
                                 mlp: FoldedMLP, layer: int, width: int, block_j: int = 32,
                                 block_h: int = 128) -> None:  # fmt: skip
    """One program per (request, KV head, `block_j` entries), `block_h` hidden units at a time."""
    if SCALAR_FEATURES != KERNEL_FEATURES:
        raise RuntimeError(f"the refresh kernel computes {KERNEL_FEATURES}, atskv's features are {SCALAR_FEATURES}")
    b, heads = block_table.shape[0], kept.shape[1]
    hidden = mlp.w.shape[1]
    grid = (b * heads, triton.cdiv(width, block_j))
    _refresh_kernel[grid](
        kept, values, received, key_norm, received if previous is None else previous, pinned.view(torch.uint8),
        prompt_len, block_table,
        seq_lens, mlp.w, mlp.bias[layer], mlp.w2, mlp.b2, heads, width, kept.shape[0] - 1, budget, refresh_every,
        float(group), hidden, block_table.stride(0), PAGE=block_size, FRACTION=isinstance(budget, float),
        PREVIOUS=previous is not None, FEATURES=len(SCALAR_FEATURES), BLOCK_J=block_j, BLOCK_H=block_h,
        num_warps=4,
    )  # fmt: skip


@jit
def folded_logit(attention, pos, newest, key_norm, prev, w_ptr, bias_ptr, w2_ptr, b2, hidden,
                 BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """`FoldedMLP`'s logits `[BLOCK_J]` of tokens at positions `pos` (int64) against `newest`, from
    their attention received, key norm and previous layer's attention (`feature_columns`'
    definitions; the hidden-state norm 0), `bias_ptr` at the (layer, KV head)'s bias row,
    `BLOCK_H` hidden units at a time, each unit's share of the output summed across them once, at
    the end (a sum over the units every step cost a cross-thread reduction each)."""
    position = pos.to(tl.float32) / tl.maximum(newest, 1.0)
    log_age = tl.log(1.0 + tl.maximum(newest - pos.to(tl.float32), 0.0))
    shares = tl.zeros([BLOCK_J, BLOCK_H], tl.float32)
    for start in range(0, hidden, BLOCK_H):
        u = start + tl.arange(0, BLOCK_H)
        used = u < hidden
        acc = tl.zeros([BLOCK_J, BLOCK_H], tl.float32) + tl.load(bias_ptr + u, mask=used, other=0.0)[None, :]
        # the columns in SCALAR_FEATURES order: attention, position, log_age, hidden_norm (0), key_norm, prev
        acc += attention[:, None] * tl.load(w_ptr + 0 * hidden + u, mask=used, other=0.0)[None, :]
        acc += position[:, None] * tl.load(w_ptr + 1 * hidden + u, mask=used, other=0.0)[None, :]
        acc += log_age[:, None] * tl.load(w_ptr + 2 * hidden + u, mask=used, other=0.0)[None, :]
        acc += key_norm[:, None] * tl.load(w_ptr + 4 * hidden + u, mask=used, other=0.0)[None, :]
        acc += prev[:, None] * tl.load(w_ptr + 5 * hidden + u, mask=used, other=0.0)[None, :]
        shares += tl.maximum(acc, 0.0) * tl.load(w2_ptr + u, mask=used, other=0.0)[None, :]
    return tl.sum(shares, 1) + b2


@jit
def folded_logit_mma(attention, pos, newest, key_norm, prev, w_ptr, bias_ptr, w2_ptr, b2, hidden,
                     BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """`folded_logit` on tensor cores: the features and a constant 1 as a `[BLOCK_J, 16]` matrix
    against `[16, BLOCK_H]` of the weights with the bias as the 1's row, then the ReLU's output
    against `w2` as a `[BLOCK_H, 16]` matrix's first column (two `tl.dot`s a step: the elementwise
    work left is the ReLU). `PRECISION`: the dots' `input_precision` ("tf32x3" keeps float32's
    accuracy to ~1e-6; the interpreter computes in float32 whatever it is)."""
    position = pos.to(tl.float32) / tl.maximum(newest, 1.0)
    log_age = tl.log(1.0 + tl.maximum(newest - pos.to(tl.float32), 0.0))
    c = tl.arange(0, 16)
    # the columns in SCALAR_FEATURES order (hidden_norm, 3, stays 0), then the bias's constant 1 at 6
    x = (_column(attention, c, 0) + _column(position, c, 1) + _column(log_age, c, 2) + _column(key_norm, c, 4)
         + _column(prev, c, 5) + _column(tl.full([BLOCK_J], 1.0, tl.float32), c, 6))  # fmt: skip
    out = tl.zeros([BLOCK_J, 16], tl.float32)
    for start in range(0, hidden, BLOCK_H):
        u = start + tl.arange(0, BLOCK_H)
        used = u < hidden
        rows = (c < 6)[:, None] & used[None, :]
        w = tl.load(w_ptr + c[:, None] * hidden + u[None, :], mask=rows, other=0.0)
        w += tl.where(c == 6, 1.0, 0.0)[:, None] * tl.load(bias_ptr + u, mask=used, other=0.0)[None, :]
        units = tl.maximum(tl.dot(x, w, input_precision=PRECISION), 0.0)
        w2 = _column(tl.load(w2_ptr + u, mask=used, other=0.0), c, 0)  # [BLOCK_H, 16]
        out = tl.dot(units, w2, out, input_precision=PRECISION)
    return tl.sum(out, 1) + b2  # columns 1..15 are 0


@jit
def _column(values, c, k):
    """`values` `[N]` as column `k` of an `[N, 16]` matrix of zeros (`c`: the 16 column numbers)."""
    return tl.where(c[None, :] == k, values[:, None], 0.0)


@jit
def _refresh_kernel(
    kept_ptr, val_ptr, rec_ptr, norm_ptr, prev_ptr, pin_ptr, prompt_ptr, table_ptr, len_ptr, w_ptr, bias_ptr, w2_ptr,
    b2, n_heads, width, spare, budget, refresh_every, group, hidden, s_table,
    PAGE: tl.constexpr, FRACTION: tl.constexpr, PREVIOUS: tl.constexpr, FEATURES: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    _, h, seq_len, table_row = list_row(len_ptr, table_ptr, n_heads, s_table)
    first_page = tl.load(table_row).to(tl.int64)
    steps = seq_len - tl.load(prompt_ptr + first_page * PAGE).to(tl.int64)
    if (seq_len > 0) & (steps > 0) & (steps % refresh_every == 0):
        held, _unused = list_sizes(seq_len, budget, FRACTION)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J).to(tl.int64)
        listed = (j < held) & (j < width) & (j < seq_len)
        at = list_slot(table_row, j, seq_len, spare, PAGE, 2147483647, 0)  # never compacted: entry j at slot j
        pos = tl.load(kept_ptr + at * n_heads + h, mask=listed, other=0).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), tl.maximum(seq_len - 1, 0))
        where = tl.load(table_row + pos // PAGE, mask=listed, other=0).to(tl.int64) * PAGE + pos % PAGE
        seen = tl.maximum(seq_len - 1 - pos, 1).to(tl.float32)
        newest = (seq_len - 1).to(tl.float32)
        attention = tl.load(rec_ptr + where * n_heads + h, mask=listed, other=0.0) / group / seen
        prev = tl.zeros([BLOCK_J], tl.float32)
        if PREVIOUS:
            for k in range(n_heads):
                prev += tl.load(prev_ptr + where * n_heads + k, mask=listed, other=0.0)
            prev = prev / n_heads / group / seen
        key_norm = tl.load(norm_ptr + where * n_heads + h, mask=listed, other=0.0)
        logit = folded_logit(attention, pos, newest, key_norm, prev, w_ptr, bias_ptr + h * hidden, w2_ptr, b2, hidden,
                             BLOCK_J, BLOCK_H)  # fmt: skip
        pinned = tl.load(pin_ptr + where * n_heads + h, mask=listed, other=0) != 0
        tl.store(val_ptr + at * n_heads + h, tl.where(pinned, float("inf"), logit), mask=listed)
