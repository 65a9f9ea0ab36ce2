"""A cache with fixed-size slot buffers, so that a decode step has static shapes and no host sync
and can be captured once in a CUDA graph and replayed for every token.

Every attention layer (managed or not, global or sliding-window) is a `StaticSlotLayer`:
buffers `[B, Hkv, capacity, D]` allocated once, `slot_pos` (logical position per slot, -1 free)
and per-slot selector state as in `SlotLayer`. The prompt is appended contiguously (host-side
counters, outside any graph); afterwards `finish_prompt` moves each row's real tokens to the
front (left padding is dropped), and from then on each decode token goes to `write_slot`
`[B, Hkv]`, a device tensor the session advances inside the graph: the next slot for layers
that keep everything, the slot just freed for evicting ones, position modulo the window for
sliding-window layers. Nothing in a decode step depends on a Python value that changes per
token, which is what makes the graph valid for every step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from atskv.kernels.evict import first_free
from atskv.kernels.slot_write import write_decode_token
from atskv.slot_cache import SlotLayer, slot_index


class StaticSlotLayer(SlotLayer):
    """One layer's KV in preallocated slots; see the module docstring."""

    static = True

    def __init__(self, capacity: int, window: int | None = None):
        super().__init__()
        self.capacity = capacity
        self.window = window  # sliding-window layers: a token older than this is never attended
        self.is_sliding = window is not None
        self.filled = 0  # prompt slots written (host-side; the prompt is appended contiguously)
        self.decoding = False  # set by `finish_prompt`: updates go to `write_slot`
        self.write_slot: torch.Tensor | None = None  # [B, Hkv] long
        # device counters, one pair shared by every layer of a cache: tokens written ([1] long: the
        # next token's logical position) and real tokens each row has seen ([B] long)
        self.position: torch.Tensor | None = None
        self.context: torch.Tensor | None = None
        # slot tensors whose slot a selector's own decode write restarts, in the kernel that writes
        # the token's state anyway (the learned selector's): `write` does not scatter their inits
        self.reset_by_selector: set[str] = set()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, h, self.capacity, d)
        self.values = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.slot_pos = torch.full((b, h, self.capacity), -1, dtype=torch.long, device=self.device)
        self.length = self.capacity  # views cover the whole buffer: static shapes
        self.is_initialized = True

    @torch.compiler.disable  # host-side counters and lazy buffers: eager inside a compiled layer
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.decoding:
            self.write(self.write_slot.unsqueeze(-1), key_states, value_states)
        else:
            self._append_prompt(key_states, value_states)
        return self.keys, self.values

    def _append_prompt(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = key_states.shape[2]
        if self.filled + n > self.capacity:
            if self.window is None:
                raise ValueError(f"the prompt outgrew the static cache ({self.seen + n} > {self.capacity} slots)")
            self._drop_outside_window(n)
        start = self.filled
        sl = slice(start, start + n)
        self.keys[:, :, sl] = key_states
        self.values[:, :, sl] = value_states
        self.slot_pos[:, :, sl] = torch.arange(self.seen, self.seen + n, device=self.device)
        self.filled = start + n
        self.seen += n

    def _drop_outside_window(self, incoming: int) -> None:
        """A sliding-window layer between prompt chunks: keep the last `window - 1` tokens (all a
        later query can still see) at the front, making room for the next chunk."""
        keep = min(self.window - 1, self.filled)
        sl = slice(self.filled - keep, self.filled)
        for t in (self.keys, self.values, self.slot_pos):
            t[:, :, :keep] = t[:, :, sl].clone()
        self.slot_pos[:, :, keep:] = -1
        self.filled = keep
        if keep + incoming > self.capacity:
            raise ValueError(f"a prompt chunk of {incoming} tokens does not fit a window cache of {self.capacity}")

    def token_tensor(
        self, name: str, width: int, init: float = 0.0, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """During the prompt every KV head's slot i holds token i, so a state of the token alone is
        held once, `[B, 1, S, width]` (the learned selector's features: 1 / Hkv of a per-slot copy
        while the whole prompt is held); `finish_prompt` keeps it shared, `shrink` gives each head
        its own copy of the slots it kept, and from then on it is a `slot_tensor`."""
        heads = self.slot_pos.shape[1]
        if name not in self._slot_state and not self.decoding:
            b, _, cap = self.slot_pos.shape
            self._slot_state[name] = (torch.full((b, 1, cap, width), init, dtype=dtype, device=self.device), init)
        elif self.decoding and name in self._slot_state and self._slot_state[name][0].shape[1] < heads:
            tensor, _ = self._slot_state[name]  # decoding without a shrink (nothing evicted): each head its copy
            self._slot_state[name] = (tensor.expand(-1, heads, *tensor.shape[2:]).contiguous(), init)
        return self.slot_tensor(name, init, dtype, width)

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode write of one token per (row, KV head) into `slots` `[B, Hkv, 1]`, at position
        `position - 1` (the step's counters already count it: `StaticKVCache.start_step`); the
        slot's selector state restarts at its init (but for `reset_by_selector`)."""
        write_decode_token(self.keys, self.values, self.slot_pos, slots, keys, values, self.position)
        for name, (tensor, init) in self._slot_state.items():
            if name not in self.reset_by_selector:
                tensor.scatter_(2, slot_index(slots, tensor), init)  # a scalar: no filled source tensor per step

    def finish_prompt(self, real: torch.Tensor | None) -> None:
        """End of the prompt: each row's real tokens (`real` `[B, seen]` bool, None: all) move to
        the front of its slots, and the device counters for decoding start."""
        b, h, _ = self.slot_pos.shape
        pos = self.slot_pos
        held = pos >= 0
        if self.window is not None:  # the next query sees the last window - 1 prompt tokens
            held = held & (pos > self.seen - self.window)
        if real is not None:
            held = held & real.gather(1, pos.clamp(min=0).view(b, -1)).view(b, h, -1)
        order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)  # real tokens first, in order
        for name in ("keys", "values"):
            t = getattr(self, name)
            setattr(self, name, t.gather(2, slot_index(order, t)))
        self.slot_pos = pos.gather(2, order).masked_fill(~held.gather(2, order), -1)
        # a `token_tensor` stays shared: every head's order is the same while the heads hold the same tokens
        self._slot_state = {k: (t.gather(2, slot_index(order[:, : t.shape[1]], t)), i)
                            for k, (t, i) in self._slot_state.items()}  # fmt: skip
        count = held.sum(-1)  # [B, Hkv]
        self.position = torch.tensor([self.seen], device=self.device)
        self.context = (real.sum(-1) if real is not None else torch.full((b,), self.seen, device=self.device)).long()
        self.write_slot = count
        self.decoding = True
        if self.window is not None:
            self.shrink(self.window)

    def shrink(self, capacity: int) -> None:
        """Reallocate to `capacity` slots keeping the held tokens (at most `capacity` per row, at
        the front after `finish_prompt` and an eviction pass): frees the evicted tokens' memory."""
        order = torch.argsort((self.slot_pos < 0).to(torch.int8), dim=-1, stable=True)[..., :capacity]
        self.keys = self.keys.gather(2, slot_index(order, self.keys)).contiguous()
        self.values = self.values.gather(2, slot_index(order, self.values)).contiguous()
        self.slot_pos = self.slot_pos.gather(2, order).contiguous()
        heads = self.slot_pos.shape[1]  # a shared `token_tensor` becomes each head's own here: their slots part
        self._slot_state = {k: (t.expand(-1, heads, *t.shape[2:]).gather(2, slot_index(order, t)).contiguous(), i)
                            for k, (t, i) in self._slot_state.items()}  # fmt: skip
        self.capacity = self.length = capacity
        self.write_slot = first_free(self.slot_pos)

    def stack_rows(self, rows: list[StaticSlotLayer]) -> None:
        """Become the batch of `rows` (this layer among them), each a one-row layer of the same
        call after its prompt: buffers, slot state and counters concatenated along the batch."""
        for name in ("keys", "values", "slot_pos", "write_slot", "context"):
            setattr(self, name, torch.cat([getattr(r, name) for r in rows]))
        self._slot_state = {k: (torch.cat([r._slot_state[k][0] for r in rows]), i)
                            for k, (_, i) in self._slot_state.items()}  # fmt: skip

    def evict(self, drop: torch.Tensor) -> None:
        """Free slots where `drop` is True; no compaction (shapes stay fixed)."""
        self.slot_pos.masked_fill_(drop, -1)

    def reset(self) -> None:
        super().reset()
        self.filled = 0
        self.decoding = False
        self.write_slot = self.position = self.context = None
        self.reset_by_selector.clear()


class StaticKVCache(Cache):
    """The cache of `atskv.generate`: a `StaticSlotLayer` for every layer, its capacity from
    `capacity(layer_idx, window)` (window: the layer's sliding window, None for global layers)."""

    is_compileable = True

    def __init__(self, config, capacity: Callable[[int, int | None], int]):
        text_config = config.get_text_config(decoder=True)
        kinds = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        window = getattr(text_config, "sliding_window", None)
        layers = []
        for i, kind in enumerate(kinds):
            w = window if kind == "sliding_attention" else None
            layers.append(StaticSlotLayer(capacity(i, w), w))
        super().__init__(layers=layers)

    def finish_prompt(self, real: torch.Tensor | None) -> None:
        for layer in self.layers:
            layer.finish_prompt(real)
        self._share_counters()

    def start_step(self) -> None:
        """Before a decode step's layers write: the shared counters count the new token, in one
        launch for the whole model (each layer adding its own was two kernels per layer)."""
        first = self.layers[0]
        torch._foreach_add_([first.position, first.context], 1)

    def _share_counters(self) -> None:
        """Every layer reads the first layer's `position` and `context` (they are equal)."""
        first = self.layers[0]
        for layer in self.layers[1:]:
            layer.position, layer.context = first.position, first.context

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    @staticmethod
    def stack(caches: list[StaticKVCache]) -> StaticKVCache:
        """One batch cache from one-row caches of the same call, each after its prompt."""
        merged = caches[0]
        for i, layer in enumerate(merged.layers):
            layer.stack_rows([cache.layers[i] for cache in caches])
        merged._share_counters()
        return merged
