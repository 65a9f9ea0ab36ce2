"""A transformers `Cache` whose managed layers store KV in *slots* that can be freed and reused.

Each managed layer keeps keys/values in buffers `[B, Hkv, capacity, D]` (grouped, never
expanded), plus `slot_pos[B, Hkv, S]`: the logical position of the token in each slot, -1 when
the slot is free. Eviction frees slots per (row, KV head); new tokens are written into free
slots first, so a selector that keeps a fixed budget runs in fixed memory, and the buffers are
compacted (really reallocated smaller) once most slots are free. Logical positions are what the
model's masks and `get_seq_length` speak of, so RoPE positions and padding stay right after
eviction. Layers the hook does not manage (the first dense layers, sliding-window layers) keep
the standard transformers layer classes. The fast path's static layer
(`atskv.runtime.fast.static_cache`) is a `SlotLayer` too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs


class SlotLayer(CacheLayerMixin):
    """KV of one managed layer in reusable slots; see the module docstring."""

    is_sliding = False
    is_croppable = False
    min_growth = 16
    static = False  # the fast path's layer, sized once (`StaticSlotLayer`): selectors write into it in place

    def __init__(self, **kwargs):
        super().__init__()
        self.slot_pos: torch.Tensor | None = None
        self.length = 0  # slots in use (occupied or free); views are cut to this
        self.seen = 0  # logical tokens written so far
        self.may_have_free = False  # host-side flag: lets append skip a device sync until a first eviction
        self._slot_state: dict[str, tuple[torch.Tensor, float]] = {}
        # free-form per-layer selector state that is not per slot (Quest page bounds, SparCas's
        # compact keys, ...): it lives and dies with the cache, so no state leaks between prompts
        self.state: dict[str, object] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.slot_pos = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    # --- the transformers layer protocol -------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        positions = torch.arange(self.seen, self.seen + n, device=self.device)
        free = self.slot_pos[..., : self.length] < 0 if self.may_have_free else None
        if free is None or not bool(free.any()):  # common case: append contiguously
            self._ensure_capacity(self.length + n)
            sl = slice(self.length, self.length + n)
            self.keys[:, :, sl] = key_states
            self.values[:, :, sl] = value_states
            self.slot_pos[:, :, sl] = positions
            for tensor, init in self._slot_state.values():
                tensor[:, :, sl] = init
            self.length += n
        else:
            slots = self._claim_free_slots(n, free)  # [B, Hkv, n]
            self._write_slots(slots, key_states, value_states, positions.expand_as(slots).contiguous())
        self.seen += n
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.slot_pos = None
        self.length = self.seen = 0
        self.may_have_free = False
        self._slot_state.clear()
        self.state.clear()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported under atskv.sparse yet; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("cropping (assisted decoding) is not supported under atskv.sparse yet")

    # --- slots ------------------------------------------------------------------------------
    @property
    def occupied(self) -> torch.Tensor:
        """`[B, Hkv, S]` bool: slots holding a token."""
        return self.slot_pos[..., : self.length] >= 0

    def slot_tensor(
        self, name: str, init: float = 0.0, dtype: torch.dtype = torch.float32, width: int | None = None
    ) -> torch.Tensor:
        """A per-slot state `[B, Hkv, S]` (or `[B, Hkv, S, width]`) for a selector, created on first
        use with `init`; it is moved along with its tokens and reset to `init` when a slot gets a
        new token."""
        if name not in self._slot_state:
            b, h, cap = self.slot_pos.shape
            shape = (b, h, cap) if width is None else (b, h, cap, width)
            self._slot_state[name] = (torch.full(shape, init, dtype=dtype, device=self.device), init)
        return self._slot_state[name][0][:, :, : self.length]

    def token_tensor(
        self, name: str, width: int, init: float = 0.0, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """A selector state that depends on the token alone (not on the KV head holding it):
        `[B, h, S, width]` with h = 1 where every KV head's slot i holds the same token (a static
        cache's prompt: `StaticSlotLayer`), else h = Hkv, a `slot_tensor`. Read it through a
        broadcast over the KV heads."""
        return self.slot_tensor(name, init, dtype, width)

    def evict(self, drop: torch.Tensor) -> None:
        """Free the slots where `drop` (`[B, Hkv, S]`) is True; compact once most slots are free."""
        self.slot_pos[..., : self.length].masked_fill_(drop, -1)
        self.may_have_free = True
        kept = int(self.occupied.sum(-1).max())
        if self.length > 2 * self.min_growth and kept <= self.length // 2:
            self._compact(kept)

    def kv_bytes(self) -> int:
        """Bytes held by this layer's KV buffers (their full capacity: what the allocator holds)."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def _write_slots(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        ragged: bool = False,
    ) -> None:
        """Write tokens `[B, Hkv, n, D]` with their `positions` `[B, Hkv, n]` into free `slots`
        `[B, Hkv, n]`; the slots' selector state restarts at its init. `ragged`: rows are padded
        with position -1, whose entries are not written (their slot may be any slot of the row);
        otherwise every entry is real and one scatter per tensor writes them, without a sync."""
        if not ragged:
            self.keys.scatter_(2, slot_index(slots, self.keys), keys)
            self.values.scatter_(2, slot_index(slots, self.values), values)
            self.slot_pos.scatter_(2, slots, positions)
            for tensor, init in self._slot_state.values():
                idx = slot_index(slots, tensor)
                tensor.scatter_(2, idx, torch.full(idx.shape, init, dtype=tensor.dtype, device=self.device))
            return
        b, h, i = (positions >= 0).nonzero(as_tuple=True)
        s = slots[b, h, i]
        self.keys[b, h, s] = keys[b, h, i]
        self.values[b, h, s] = values[b, h, i]
        self.slot_pos[b, h, s] = positions[b, h, i]
        for tensor, init in self._slot_state.values():
            tensor[b, h, s] = init

    def _claim_free_slots(self, n: int, free: torch.Tensor, need: torch.Tensor | None = None) -> torch.Tensor:
        """First `n` free slots of every (row, KV head) (`free`: the current `[B, Hkv, S]` free-slot
        mask), growing the buffers only where a row has fewer free slots than it `need`s (`[B, Hkv]`,
        default n: the other entries of a row are padding and are not written)."""
        missing = int(((n if need is None else need) - free.sum(-1)).max())
        if missing > 0:
            self._ensure_capacity(self.length + missing)
            self.slot_pos[..., self.length : self.length + missing] = -1
            self.length += missing
        return first_true(self.slot_pos[..., : self.length] < 0, n)

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        # small geometric headroom: few reallocations, at most ~3% more than the tokens held
        new_capacity = max(needed, capacity + max(self.min_growth, capacity // 32))
        self._reallocate(new_capacity, torch.arange(self.length, device=self.device))

    def _compact(self, kept: int) -> None:
        """Move occupied slots to the front (per row) and shrink the buffers to `kept` slots."""
        order = torch.argsort((~self.occupied).to(torch.int8), dim=-1, stable=True)[..., :kept]
        self._reallocate(kept, order)

    def _reallocate(self, capacity: int, source: torch.Tensor) -> None:
        """New buffers of `capacity` slots filled from slots `source` (`[n]` or `[B, Hkv, n]`)."""
        n = source.shape[-1]

        def moved(t: torch.Tensor, fill) -> torch.Tensor:
            new = torch.full((*t.shape[:2], capacity, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            if source.dim() == 1:
                new[:, :, :n] = t[:, :, source]
            else:
                new[:, :, :n] = t.gather(2, slot_index(source, t))
            return new

        self.keys = moved(self.keys, 0)
        self.values = moved(self.values, 0)
        self.slot_pos = moved(self.slot_pos, -1)
        self._slot_state = {k: (moved(t, init), init) for k, (t, init) in self._slot_state.items()}
        self.length = n


def slot_index(slots: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Slot ids `[B, Hkv, n]` expanded to index dim 2 of `tensor` `[B, Hkv, S, ...]` (gather/scatter)."""
    return slots.view(*slots.shape, *[1] * (tensor.dim() - 3)).expand(*slots.shape, *tensor.shape[3:])


def first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices `[B, Hkv, n]` of the first `n` True entries of each row of `mask`; a row with
    fewer is padded with other indices. Earlier entries weigh more, so top-n picks them in order."""
    weight = mask * torch.arange(mask.shape[-1], 0, -1, device=mask.device)
    return weight.topk(n, dim=-1).indices


class SparseKVCache(Cache):
    """The cache used under `atskv.sparse`: `make_layer(layer_idx)` (a `SlotLayer`) for managed layers,
    the standard transformers layer (full or sliding window) for every other layer."""

    def __init__(
        self, config, managed_layers: Iterable[int], make_layer: Callable[[int], SlotLayer] = lambda i: SlotLayer()
    ):
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        managed = set(managed_layers)
        layers = [
            make_layer(i) if i in managed else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs))
        ]
        super().__init__(layers=layers)
        self.managed_layers = frozenset(managed)


def kv_bytes(cache: Cache) -> int:
    """Bytes of KV held by any transformers cache: slot layers at their full capacity (what the
    allocator holds), standard layers as stored. The same measure for dense and sparse runs."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SlotLayer):
            total += layer.kv_bytes()
        elif getattr(layer, "is_initialized", False) and layer.keys is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total
