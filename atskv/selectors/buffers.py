"""Append-only selector buffers kept in `SlotLayer.state` (Quest's page bounds, SparCas's compact
keys): their room grows geometrically, so extending them by a token each decode step costs
amortised O(1) copies rather than a `torch.cat` of the whole buffer every step."""

from __future__ import annotations

import torch


def with_room(buffer: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    """`buffer` itself if it has room for `length` entries along `dim`, else a larger copy (at least
    double) whose first entries are `buffer`'s."""
    have = buffer.shape[dim]
    if have >= length:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = max(length, 2 * have)
    grown = buffer.new_empty(shape)
    grown.narrow(dim, 0, have).copy_(buffer)
    return grown
