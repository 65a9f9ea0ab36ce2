"""The one rule turning a budget into tokens, for torch code and for kernels: an int is tokens,
a float in (0, 1) that fraction of the row's context rounded up, at least 1, never more than the
context. `atskv.budget.resolve_budget` checks the budget and applies `kept_tokens` (per row;
`kept_count` for one count on the host);
kernels that decide per row inside the device (no host sync) call `budget_limit`."""

from __future__ import annotations

import math
import struct

import torch

from atskv.kernels.backend import jit, tl


def kept_count(budget: int | float, context: int) -> int:
    """`kept_tokens` for one host-side count: a Python int, no tensor read back, rounded as the
    tensors and kernels round (float32: 200 tokens at 0.3 keep 60 in float64, 61 in float32, and a
    list ranked with one count and stepped with the other reads an entry never written)."""
    if isinstance(budget, float):
        return min(context, max(1, math.ceil(_float32(_float32(context) * _float32(budget)))))
    return min(context, budget)


def _float32(x: float) -> float:
    """`x` rounded to float32 (a product of two float32 values is exact in float64, so rounding it
    once is float32's multiplication)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def kept_tokens(budget: int | float, context: torch.Tensor) -> torch.Tensor:
    """Tokens each row keeps, the shape of `context` (long)."""
    if isinstance(budget, float):
        return torch.clamp(torch.ceil(context * budget).long(), min=1).minimum(context)
    return torch.clamp(context, max=budget)


@jit
def budget_limit(context, budget, FRACTION: tl.constexpr):
    """`kept_tokens` for one row's `context` inside a kernel (int64)."""
    if FRACTION:
        limit = tl.maximum(tl.ceil(context.to(tl.float32) * budget), 1.0).to(tl.int64)
    else:
        limit = tl.full([], budget, tl.int64)
    return tl.minimum(limit, context.to(tl.int64))
