"""The passive tier of one managed layer: parked keys/values in host memory.

Storage is allocated once, for the most tokens a sequence can hold (`capacity`), so a host tier
that cannot be had fails before any work starts, and no step ever reallocates pinned memory
(slow) or grows a file: keys/values `[B, Hkv, capacity, D]` in pinned memory, or in a
memory-mapped file (`torch.from_file`, shared) when a path is given. `slot_pos[b, h, s]` is the
logical position parked in host slot s (-1 free) and `slot_of[b, h, p]` the host slot of position
p (-1: not parked), so lookups by position cost no search.

Transfers are batched: tokens arrive as one gathered block per call (`park`) and leave as one
(`fetch`), each a single copy per tensor. On CUDA both copies run on a side stream: `park`
records an event after its device-to-host copy and writes the block into host slots only when
the data is next needed (`_drain`), so the copy overlaps the layers that follow; `fetch` copies
host-to-device on the side stream and makes the compute stream wait for it. Moving a token is
always copy first, then release the source (the callers free GPU slots after `park` returned,
host slots after the fetched block was written into GPU slots), so a failed transfer leaves
the token where it was.
"""

from __future__ import annotations

from pathlib import Path

import torch

from atskv.slot_cache import first_true


class HostTier:
    """Parked KV of one managed layer; see the module docstring."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        key_dim: int,
        value_dim: int,
        capacity: int,
        dtype: torch.dtype,
        *,
        pin: bool = True,
        path: str | Path | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"host tier capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        shape_k, shape_v = (batch, kv_heads, capacity, key_dim), (batch, kv_heads, capacity, value_dim)
        try:
            if path is not None:
                self.keys, self.values = _mapped(Path(path), shape_k, shape_v, dtype)
            else:
                pin = pin and torch.cuda.is_available()
                self.keys = torch.empty(shape_k, dtype=dtype, pin_memory=pin)
                self.values = torch.empty(shape_v, dtype=dtype, pin_memory=pin)
        except (RuntimeError, OSError) as error:
            gib = (_numel(shape_k) + _numel(shape_v)) * dtype.itemsize / 2**30
            where = f"a memory-mapped file at {path}" if path is not None else "pinned host memory"
            raise RuntimeError(
                f"cannot allocate the host KV tier ({gib:.2f} GiB in {where}) for {capacity} tokens x "
                f"{batch} rows x {kv_heads} KV heads: {error}. Lower the host capacity or use a file path."
            ) from error
        self.slot_pos = torch.full((batch, kv_heads, capacity), -1, dtype=torch.long)
        self.slot_of = torch.full((batch, kv_heads, capacity), -1, dtype=torch.long)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]] = []
        self._stream = None
        self._stage: list[torch.Tensor | None] = [None, None]  # pinned staging of `fetch`
        self._staged = None  # the event of the last copy out of the staging buffers

    # --- accounting ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host bytes held for KV (the whole preallocated store)."""
        return self.keys.nbytes + self.values.nbytes

    def count(self) -> torch.Tensor:
        """`[B, Hkv]` tokens parked per row and KV head."""
        self._drain()
        return (self.slot_pos >= 0).sum(-1)

    def positions(self) -> torch.Tensor:
        """`[B, Hkv, capacity]` parked positions (-1 free), for indexes and tests."""
        self._drain()
        return self.slot_pos

    # --- moves ---------------------------------------------------------------------------------
    def park(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Take a gathered block `[B, Hkv, n, D]` with its positions `[B, Hkv, n]` (-1: padding,
        not stored; all < capacity, which the cache checks when tokens arrive, so a position
        always finds a slot). The caller frees the source slots after this returns."""
        if keys.device.type == "cuda":
            stream = self._side_stream(keys.device)
            stream.wait_stream(torch.cuda.current_stream(keys.device))
            with torch.cuda.stream(stream):
                block = [t.to("cpu", non_blocking=True) for t in (keys, values, positions)]
                event = torch.cuda.Event()
                event.record(stream)
            for t in (keys, values, positions):
                t.record_stream(stream)
            self._pending.append((*block, event))
        else:
            self._write(keys, values, positions)

    def fetch(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values `[B, Hkv, n, D]` of parked `positions` `[B, Hkv, n]` (-1 -> zeros) on `device`,
        in one copy each. The tokens stay parked until `release`."""
        self._drain()
        positions = positions.cpu()
        slots = self.slot_of.gather(-1, positions.clamp(min=0))
        missing = (positions >= 0) & (slots < 0)
        if bool(missing.any()):
            raise KeyError(f"positions not in the host tier: {positions[missing][:8].tolist()}")
        slots, absent = slots.clamp(min=0), positions < 0
        # zeroing a gathered block costs 2/3 of the gather (CPU, 4K tokens, batch 4): only when a -1 asks for it
        absent = absent.unsqueeze(-1) if bool(absent.any()) else None
        if torch.device(device).type != "cuda":
            keys, values = (_gather_rows(store, slots, absent=absent) for store in (self.keys, self.values))
            return keys.to(device), values.to(device)
        # gathered straight into reused pinned staging buffers: no pinned allocation per step
        keys, values = (
            _gather_rows(store, slots, self._staging(i, (*slots.shape, store.shape[-1])), absent)
            for i, store in enumerate((self.keys, self.values))
        )
        stream = self._side_stream(device)
        with torch.cuda.stream(stream):
            out = keys.to(device, non_blocking=True), values.to(device, non_blocking=True)
            self._staged = torch.cuda.Event()
            self._staged.record(stream)
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        for t in out:
            t.record_stream(compute)
        return out

    def release(self, positions: torch.Tensor) -> None:
        """Free the host slots of `positions` `[B, Hkv, n]` (-1 skipped): they now live on the GPU."""
        self._drain()
        positions = positions.cpu()
        real = positions >= 0
        slots = self.slot_of.gather(-1, positions.clamp(min=0))
        drop = real & (slots >= 0)
        b, h, n = torch.nonzero(drop, as_tuple=True)
        self.slot_pos[b, h, slots[b, h, n]] = -1
        self.slot_of[b, h, positions[b, h, n]] = -1

    # --- internals ---------------------------------------------------------------------------
    def _side_stream(self, device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _staging(self, which: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A pinned buffer of `shape` for fetch `which` (0 keys, 1 values), grown when too small;
        the previous fetch's copy out of it is waited for before it is written again."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None
        n, stage = _numel(shape), self._stage[which]
        if stage is None or stage.numel() < n:
            size = max(n, 2 * stage.numel()) if stage is not None else n
            self._stage[which] = stage = torch.empty(size, dtype=self.keys.dtype, pin_memory=True)
        return stage[:n].view(shape)

    def _drain(self) -> None:
        """Write the blocks whose device-to-host copies were in flight into host slots."""
        pending, self._pending = self._pending, []
        for keys, values, positions, event in pending:
            event.synchronize()
            self._write(keys, values, positions)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        positions = positions.cpu()
        real = positions >= 0
        free = self.slot_pos < 0
        slots = first_true(free, positions.shape[-1])  # the first n free host slots of every row
        rank = real.cumsum(-1) - 1  # the j-th real entry of a row takes its j-th free slot
        b, h, n = torch.nonzero(real, as_tuple=True)
        s = slots[b, h, rank[b, h, n]]
        self.keys[b, h, s] = keys.cpu()[b, h, n]
        self.values[b, h, s] = values.cpu()[b, h, n]
        self.slot_pos[b, h, s] = positions[b, h, n]
        self.slot_of[b, h, positions[b, h, n]] = s


def _gather_rows(
    store: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None, absent: torch.Tensor | None = None
) -> torch.Tensor:
    """`store[b, h, slots[b, h, i]]` -> `[B, Hkv, n, D]`, zeros where `absent` (`[B, Hkv, n, 1]`):
    whole rows by `index_select` over the flattened store (a row copy each), far faster on
    the CPU than an element-wise gather."""
    b, h, capacity, d = store.shape
    base = torch.arange(b * h).view(b, h, 1) * capacity
    flat = (base + slots).view(-1)
    rows = torch.index_select(store.view(-1, d), 0, flat, out=None if out is None else out.view(-1, d))
    rows = rows.view(*slots.shape, d)
    return rows if absent is None else rows.masked_fill_(absent, 0)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mapped(path: Path, shape_k, shape_v, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values in one memory-mapped file (created or truncated to size)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n_k, n_v = _numel(shape_k), _numel(shape_v)
    with open(path, "wb") as f:
        f.truncate((n_k + n_v) * dtype.itemsize)
    flat = torch.from_file(str(path), shared=True, size=n_k + n_v, dtype=dtype)
    return flat[:n_k].view(shape_k), flat[n_k:].view(shape_v)
