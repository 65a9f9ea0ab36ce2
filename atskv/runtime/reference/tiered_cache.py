"""The two-tier KV cache: an active set of GPU slots per managed layer and a passive host tier.

`TieredLayer` is a `SlotLayer` whose demoted tokens are not dropped but parked in its `HostTier`
(and indexed for retrieval by the layer's `KeyIndex`); `promote` brings parked tokens back into
free GPU slots. Every token of every (row, KV head) is in exactly one tier at any time, and its
key and value are bit-identical after any number of moves (copies, never recomputation).

A token also carries its selector state (H2O's accumulated attention, the learned selector's
projected features, ...): it is parked beside the KV, by position, and restored on promotion, so
a promoted token is scored as it was before it left. That state is small (a few floats per token)
and moves with a plain synchronous copy.

Moving is always copy first, release second: `demote` frees GPU slots only after the host tier
has taken the block, `promote` releases host slots only after the block is written into GPU
slots, so an exception in between leaves the token where it was. A copy that fails after writing
part of its block is undone (the part written is freed again on the receiving tier), so a move
either completes or leaves both tiers as they were.
`TieredKVCache` is the transformers `Cache` for it, with the move accounting of a run (`stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from atskv.runtime.reference.host_tier import HostTier
from atskv.runtime.reference.retrieval import KeyIndex
from atskv.slot_cache import SlotLayer, SparseKVCache, first_true, slot_index

MOMENTUM = "tier_momentum"  # the manager's per-slot momentum: a promoted token starts afresh, not parked


@dataclass
class TierStats:
    """Tokens and bytes moved by a cache so far (all layers, rows and KV heads): demoted to the
    host, promoted back, and read from the host for one step's attention (retrieval)."""

    demoted_tokens: int = 0
    promoted_tokens: int = 0
    read_tokens: int = 0
    demoted_bytes: int = 0
    promoted_bytes: int = 0
    read_bytes: int = 0


class TieredLayer(SlotLayer):
    """A managed layer with a host tier; see the module docstring.

    `make_host(layer_idx, keys, values)` and `make_index(keys)` build the host tier and the index when the first
    tokens arrive (shapes, dtype and device come from them); `make_index` may be None (no
    retrieval). `max_tokens`: the longest sequence the host tier holds; a longer one raises
    before anything is written."""

    def __init__(
        self,
        layer_idx: int,
        make_host: Callable[[int, torch.Tensor, torch.Tensor], HostTier],
        make_index: Callable[[torch.Tensor], KeyIndex] | None,
        stats: TierStats,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.layer_idx, self._make_host, self._make_index, self.stats = layer_idx, make_host, make_index, stats
        self.host: HostTier | None = None
        self.index: KeyIndex | None = None
        self.parked_tokens = 0  # over all rows and KV heads, kept on the host side: no device sync to read
        self._parked_state: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.host = self._make_host(self.layer_idx, key_states, value_states)
        self.index = self._make_index(key_states) if self._make_index is not None else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.host is not None and self.seen + key_states.shape[-2] > self.host.capacity:
            raise ValueError(
                f"the sequence would reach {self.seen + key_states.shape[-2]} tokens, but the host tier holds "
                f"{self.host.capacity}; raise max_tokens of atskv.tiered"
            )
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.host = self.index = None
        self.parked_tokens = 0
        self._parked_state.clear()

    @property
    def parked(self) -> torch.Tensor:
        """`[B, Hkv]` tokens in the host tier."""
        return self.host.count() if self.host is not None else torch.zeros(0, 0, dtype=torch.long)

    # --- moves ---------------------------------------------------------------------------------
    def demote(self, drop: torch.Tensor) -> None:
        """Move the tokens of the slots where `drop` (`[B, Hkv, S]`) is True to the host tier."""
        slots, real = _first_true(drop)
        if slots.shape[-1] == 0:
            return
        positions = self.slot_pos.gather(2, slots).masked_fill(~real, -1)
        keys, values = (
            self.keys.gather(2, slot_index(slots, self.keys)),
            self.values.gather(2, slot_index(slots, self.values)),
        )
        try:
            self.host.park(keys, values, positions)
        except BaseException:
            self.host.release(positions)  # whatever part arrived: these tokens stay on the GPU only
            raise
        if self.index is not None:
            self.index.add(keys, positions)
        self._park_state(slots, positions)
        self.evict(drop)
        moved = int(real.sum())
        self.parked_tokens += moved
        self.stats.demoted_tokens += moved
        self.stats.demoted_bytes += moved * _token_bytes(keys, values)

    def promote(self, positions: torch.Tensor) -> None:
        """Bring parked `positions` (`[B, Hkv, n]`, -1 skipped) back into free GPU slots."""
        positions = _real_first(positions)
        if positions.shape[-1] == 0:
            return
        keys, values = self.host.fetch(positions, self.device)
        positions = positions.to(self.device)
        free = self.slot_pos[..., : self.length] < 0
        slots = self._claim_free_slots(positions.shape[-1], free, need=(positions >= 0).sum(-1))
        try:
            self._write_slots(slots, keys, values, positions, ragged=True)
            self._restore_state(slots, positions)
        except BaseException:
            self._free(slots, positions)  # whatever part arrived: these tokens stay on the host only
            raise
        self.host.release(positions)
        if self.index is not None:
            self.index.remove(positions)
        moved = int((positions >= 0).sum())
        self.parked_tokens -= moved
        self.stats.promoted_tokens += moved
        self.stats.promoted_bytes += moved * _token_bytes(keys, values)

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of parked `positions` `[B, Hkv, n]` (-1: zeros) on this layer's device, for
        one step's attention; they stay parked."""
        positions = positions.cpu()  # fetch needs them on the host anyway; counting there costs no sync
        keys, values = self.host.fetch(positions, self.device)
        moved = int((positions >= 0).sum())
        self.stats.read_tokens += moved
        self.stats.read_bytes += moved * _token_bytes(keys, values)
        return keys, values

    def held_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(GPU positions `[B, Hkv, S]`, host positions `[B, Hkv, capacity]`), -1 for free slots."""
        return self.slot_pos[..., : self.length], self.host.positions()

    def _free(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Free the claimed `slots` of a promotion that failed (they were free before it)."""
        b, h, i = (positions >= 0).nonzero(as_tuple=True)
        self.slot_pos[b, h, slots[b, h, i]] = -1
        self.may_have_free = True

    # --- selector state of parked tokens ---------------------------------------------------------
    def _park_state(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        rows = (positions >= 0).cpu().nonzero(as_tuple=True)
        pos = positions.cpu()[rows]
        for name, (tensor, _) in self._slot_state.items():
            if name == MOMENTUM:
                continue
            store = self._parked_state.get(name)
            if store is None:
                store = torch.zeros(*tensor.shape[:2], self.host.capacity, *tensor.shape[3:], dtype=tensor.dtype)
                self._parked_state[name] = store
            store[rows[0], rows[1], pos] = tensor.gather(2, slot_index(slots, tensor)).cpu()[rows]

    def _restore_state(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        rows = (positions >= 0).nonzero(as_tuple=True)
        pos = positions[rows].cpu()
        cpu_rows = tuple(r.cpu() for r in rows[:2])
        for name, (tensor, _) in self._slot_state.items():
            store = self._parked_state.get(name)
            if store is not None:  # state created after these tokens left keeps its init
                tensor[rows[0], rows[1], slots[rows]] = store[cpu_rows[0], cpu_rows[1], pos].to(tensor.device)


def _first_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices `[B, Hkv, m]` of the True entries of each row of `mask` (m: the most in any row),
    padded with other indices, and which of them are real."""
    idx = first_true(mask, int(mask.sum(-1).max()) if mask.numel() else 0)
    return idx, mask.gather(-1, idx)


def _real_first(positions: torch.Tensor) -> torch.Tensor:
    """`positions` `[B, Hkv, n]` with the real (>= 0) entries first in each row, cut to the most
    real entries of any row."""
    idx, real = _first_true(positions >= 0)
    return positions.gather(-1, idx).masked_fill(~real, -1)


def _token_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()


class TieredKVCache(SparseKVCache):
    """The cache under `atskv.tiered`: a `TieredLayer` for each managed layer (the others as in
    `SparseKVCache`), and `stats`, the tokens and bytes moved between the tiers."""

    def __init__(
        self,
        config,
        managed_layers: Iterable[int],
        make_host: Callable[[int, torch.Tensor, torch.Tensor], HostTier],
        make_index: Callable[[torch.Tensor], KeyIndex] | None,
    ):
        self.stats = TierStats()
        super().__init__(config, managed_layers, lambda i: TieredLayer(i, make_host, make_index, self.stats))

    def host_bytes(self) -> int:
        return sum(layer.host.nbytes for layer in self.layers if isinstance(layer, TieredLayer) and layer.host)
