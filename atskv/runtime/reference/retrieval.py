"""Retrieval indexes over the keys of the passive KV tier.

Tokens the relevance predictor rates low leave the GPU for the host tier. At decode time the
current query must find the parked tokens it needs again (to promote them, or to attend to them
directly), per (batch row, KV head). An index covers one managed layer: every (row, KV head)
*group* of it in one object, so one call searches all groups. GQA stays grouped: the search query
of KV head h is the G query vectors `[G, D]` of its group, and a candidate is ranked by an
estimate of max over those heads of q·k. Entries are named by their logical token position (the
cache's `slot_pos`), unique per group; position -1 means "no entry" everywhere and is skipped,
so ragged per-group batches travel as padded tensors.

Three implementations behind one protocol (`KeyIndex`, built by name with `make_index`):
- `LSHIndex`: sign random projections, `bucket(k) = sign(P k)` with b bits per table and L
  independent tables (the ATSKV proposal's `argmin_j |sgn(Pk) - c_j|_1` over the 2^b sign-pattern
  centroids is exactly this). Cheap and approximate: a token costs L small packed ints, the search
  is plain tensor ops over all groups at once and runs wherever the codes live (CPU or CUDA), so
  it can sit next to a GPU-resident code store while the keys themselves stay on the host.
  Sign projections estimate the *angle* between q and k, not q·k (key norms are not stored);
  MagicPIG uses the same SimHash family over keys, with many more tables, as a sampler.
- `FaissIndex`: exact inner product (faiss `IndexFlatIP`) on the CPU, the reference and the
  high-recall path; one faiss index per group.
- `ExactIndex`: the same ranking by one float32 matmul and one top-n per call (torch, CPU by
  default): the fast path when a step retrieves thousands of candidates.

Choices where the method leaves one open:
- Adding a position already present, or removing an absent one, raises `ValueError`: the tiered
  cache keeps every token in exactly one tier, so either is a bookkeeping bug to surface early.
- Ties are broken by recency (the larger position first), so results are deterministic and equal
  across devices (LSH and faiss; `ExactIndex` leaves float ties in `torch.topk`'s order).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class KeyIndex(Protocol):
    """Per-layer index of parked keys, grouped per (batch row, KV head); see the module docstring."""

    def add(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Add `keys` `[B, Hkv, n, D]` under `positions` `[B, Hkv, n]` (-1: skip)."""

    def remove(self, positions: torch.Tensor) -> None:
        """Remove the entries at `positions` `[B, Hkv, n]` (-1: skip; absent: ValueError)."""

    def search(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Positions `[B, Hkv, n]` of the best candidates for `queries` `[B, Hkv, G, D]`, -1 padded.
        `offsets` `[B, Hkv, G]`, if given, is subtracted from query head g's scores before the max
        over heads: with each head's log-normaliser, heads are compared by attention probability
        rather than by raw logit (a head with large logits everywhere no longer fills the list)."""

    def count(self) -> torch.Tensor:
        """Entries per group, `[B, Hkv]` (`[0, 0]` before the first add)."""

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Memory the index holds, in bytes."""


class _Groups:
    """Shape checks shared by the indexes: the (row, KV head) grid is fixed by the first add.
    `on_model_device`: whether the index belongs next to the model (small codes searched on the
    GPU) or on the host beside the parked keys (anything as large as the keys themselves)."""

    on_model_device: ClassVar[bool] = False

    def __init__(self, head_dim: int):
        if int(head_dim) < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        self.head_dim = int(head_dim)
        self.groups: tuple[int, int] | None = None

    def _check_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        if keys.dim() != 4 or keys.shape[-1] != self.head_dim:
            raise ValueError(f"keys must be [B, Hkv, n, {self.head_dim}], got {tuple(keys.shape)}")
        if tuple(positions.shape) != tuple(keys.shape[:3]):
            raise ValueError(
                f"positions must be {tuple(keys.shape[:3])} to match the keys, got {tuple(positions.shape)}"
            )
        self._check_groups(keys.shape[:2], "keys")

    def _check_groups(self, shape, what: str, init: bool = True) -> None:
        shape = (int(shape[0]), int(shape[1]))
        if self.groups is None:
            if init:
                self.groups = shape
        elif shape != self.groups:
            raise ValueError(f"{what} cover (rows, KV heads) {shape}, the index holds {self.groups}")

    def _check_queries(self, queries: torch.Tensor, n: int) -> None:
        if queries.dim() != 4 or queries.shape[-1] != self.head_dim:
            raise ValueError(f"queries must be [B, Hkv, G, {self.head_dim}], got {tuple(queries.shape)}")
        if int(n) < 1:
            raise ValueError(f"n (candidates per group) must be >= 1, got {n}")
        self._check_groups(queries.shape[:2], "queries", init=False)

    @staticmethod
    def _check_unique(positions: torch.Tensor) -> None:
        ordered = positions.sort(-1).values
        if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
            raise ValueError("positions repeat within one (row, KV head) of the same call")


class _SlotStore(_Groups):
    """Entries of every (row, KV head) group in one set of tensors: `payload[B, Hkv, capacity, ...]`
    (what the index keeps of each key) and `slot_pos[B, Hkv, capacity]` (its position, -1 for a
    free slot). Free slots are reused by later adds, lowest first, and the capacity grows
    geometrically (it never shrinks); a search scores only the slots below `end`, the highest ever
    taken (`held`), not the room a growth made for later adds (a growth doubles the capacity, and
    scoring the empty half cost the CPU 13% of a tiered decode step). `add`/`remove` synchronise
    with the host (uniqueness checks, free-slot claims)."""

    min_capacity = 16

    def __init__(self, head_dim: int, device, payload_shape: tuple[int, ...], payload_dtype: torch.dtype):
        super().__init__(head_dim)
        self.device = torch.device(device)
        self.payload = torch.empty(0, 0, 0, *payload_shape, dtype=payload_dtype, device=self.device)
        self.slot_pos = torch.empty(0, 0, 0, dtype=torch.long, device=self.device)
        self.end = 0  # slots [0, end) may hold entries (host side: no sync to read)

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """The payload of `keys` `[..., D]`."""
        raise NotImplementedError

    def _best(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None) -> torch.Tensor:
        """Positions `[B, Hkv, <= n]` of the best entries (-1 where fewer qualify); `end` > 0."""
        raise NotImplementedError

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`payload` and `slot_pos` of the slots below `end`: all a search needs to score."""
        return self.payload[:, :, : self.end], self.slot_pos[..., : self.end]

    def search(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
        self._check_queries(queries, n)
        out = torch.full((*queries.shape[:2], int(n)), -1, dtype=torch.long, device=self.device)
        if self.end > 0:
            best = self._best(queries, min(int(n), self.slot_pos.shape[-1]), offsets)
            out[..., : best.shape[-1]] = best
        return out

    def _check_positions(self, positions: torch.Tensor) -> None:
        """Extra conditions on the positions of an add (raise ValueError)."""

    def add(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        self._check_keys(keys, positions)
        positions = positions.to(self.device, torch.long)
        if self.slot_pos.shape[:2] != self.groups:
            self.payload = self.payload.new_empty(*self.groups, 0, *self.payload.shape[3:])
            self.slot_pos = self.slot_pos.new_empty(*self.groups, 0)
            self.end = 0
        valid = positions >= 0
        self._check_unique(positions)
        if bool(self._locate(positions)[1].any()):
            raise ValueError("adding a position the index already holds (positions are unique per row and KV head)")
        self._check_positions(positions)
        self._ensure_capacity(int((self.count() + valid.sum(-1)).max()))
        # the k-th new entry of a group goes to the k-th free slot of that group
        free_first = (self.slot_pos >= 0).to(torch.uint8).sort(dim=-1, stable=True).indices
        rank = valid.long().cumsum(-1) - 1
        row, head, i = valid.nonzero(as_tuple=True)
        slot = free_first[row, head, rank[row, head, i]]
        self.payload[row, head, slot] = self.encode(keys[valid.to(keys.device)])  # same row-major order
        self.slot_pos[row, head, slot] = positions[row, head, i]
        if slot.numel():
            self.end = max(self.end, int(slot.max()) + 1)

    def remove(self, positions: torch.Tensor) -> None:
        if positions.dim() != 3:
            raise ValueError(f"positions must be [B, Hkv, n], got {tuple(positions.shape)}")
        self._check_groups(positions.shape[:2], "positions", init=False)
        positions = positions.to(self.device, torch.long)
        self._check_unique(positions)
        slots, found = self._locate(positions)
        missing = (positions >= 0) & ~found
        if bool(missing.any()):
            row, head, i = (int(x[0]) for x in missing.nonzero(as_tuple=True))
            raise ValueError(f"position {int(positions[row, head, i])} is not in the index (row {row}, KV head {head})")
        row, head, i = found.nonzero(as_tuple=True)
        self.slot_pos[row, head, slots[row, head, i]] = -1

    def count(self) -> torch.Tensor:
        return (self.slot_pos >= 0).sum(-1)

    def __len__(self) -> int:
        return int((self.slot_pos >= 0).sum())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.payload, self.slot_pos))

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self.slot_pos.shape[-1]
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, self.min_capacity)
        payload = self.payload.new_zeros(*self.groups, capacity, *self.payload.shape[3:])
        slot_pos = self.slot_pos.new_full((*self.groups, capacity), -1)
        payload[:, :, : self.payload.shape[2]] = self.payload
        slot_pos[:, :, : self.slot_pos.shape[2]] = self.slot_pos
        self.payload, self.slot_pos = payload, slot_pos

    def _locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot of each of `positions` `[B, Hkv, n]` and whether it is held (False for -1)."""
        if self.slot_pos.shape[-1] == 0:
            return torch.zeros_like(positions), torch.zeros_like(positions, dtype=torch.bool)
        held, order = self.slot_pos.sort(-1)
        at = torch.searchsorted(held, positions.contiguous()).clamp_max(held.shape[-1] - 1)
        found = (held.gather(-1, at) == positions) & (positions >= 0)
        return order.gather(-1, at), found


class LSHIndex(_SlotStore):
    """Sign-random-projection LSH over keys, all (row, KV head) groups in one set of tensors.

    The payload of an entry is its L table codes (b bits each, packed into the smallest integer
    type that holds them), `codes[B, Hkv, capacity, L]`. `search` does not synchronise with the
    host, and its work is `[B, Hkv, G, capacity, L]` integer ops (no chunking yet).

    The estimate of max_g q·k is angular (key and query norms are not stored): the number of the
    L*b bits where the codes of k and of query head g agree, `agree_g`, estimates their angle as
    `pi * (1 - agree_g / (L*b))`. Two rankings, both maximised over the group's query heads:
    - `rank="collisions"` (classical LSH): the candidates are the entries whose code equals some
      query head's code in at least one table, ranked by the number of colliding tables, then by
      `agree`, then by recency.
    - `rank="hamming"`: every entry is a candidate, ranked by `agree`, then by recency. The search
      scans all codes either way, so this costs the same; it keeps the information the collision
      count throws away. On SmolLM2-135M (2K tokens of prose, 4 layers, top 64 of 1900 parked
      keys, b=8, L=4) the attention mass retrieved was 0.51 against 0.18 for "collisions" (exact
      top 64: 0.84, random: 0.03); with L=16 tables, 0.71. Hence the defaults: hamming, b=8, L=16.
    """

    ranks = ("collisions", "hamming")
    on_model_device = True  # L small codes per entry: cheap to keep beside the model and search there

    def __init__(
        self, head_dim: int, bits: int = 8, tables: int = 16, seed: int = 0, device="cpu", rank: str = "hamming"
    ):
        if rank not in self.ranks:
            raise ValueError(f"unknown LSH rank {rank!r}; supported: {', '.join(self.ranks)}")
        if not 1 <= int(bits) <= 62:
            raise ValueError(f"bits must be in 1..62 (one table's code is packed into an int64), got {bits}")
        if int(tables) < 1:
            raise ValueError(f"tables must be >= 1, got {tables}")
        self.bits, self.tables, self.rank = int(bits), int(tables), rank
        self.code_dtype = next(
            dtype
            for dtype, width in ((torch.uint8, 8), (torch.int16, 15), (torch.int32, 31), (torch.int64, 62))
            if self.bits <= width
        )
        super().__init__(head_dim, device, (self.tables,), self.code_dtype)
        generator = torch.Generator().manual_seed(int(seed))
        self.projection = torch.randn(self.tables * self.bits, self.head_dim, generator=generator).to(self.device)
        self._bit_weights = torch.ones(1, dtype=torch.long).bitwise_left_shift(torch.arange(self.bits)).to(self.device)
        # a search key packs (rank score, position) into one int64, so top-k is exact and deterministic
        max_score = self.tables * (self.tables * self.bits + 1) + self.tables * self.bits
        self._position_bits = 63 - max_score.bit_length()

    @property
    def codes(self) -> torch.Tensor:
        """`[B, Hkv, capacity, L]` table codes of the entries."""
        return self.payload

    def encode(self, vectors: torch.Tensor) -> torch.Tensor:
        """Table codes `[..., L]` of `vectors` `[..., D]`: bit j of table t is `sign(P_tj · v) > 0`."""
        signs = vectors.to(self.device, torch.float32) @ self.projection.T > 0
        signs = signs.view(*signs.shape[:-1], self.tables, self.bits)
        return (signs.long() * self._bit_weights).sum(-1).to(self.code_dtype)

    # --- the KeyIndex protocol -----------------------------------------------------------
    def _check_positions(self, positions: torch.Tensor) -> None:
        if bool((positions >= 1 << self._position_bits).any()):
            raise ValueError(
                f"positions must be < 2**{self._position_bits} with bits={self.bits}, tables={self.tables}"
            )

    def _best(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None) -> torch.Tensor:
        """`offsets` are ignored: the estimate is angular, there is no logit to shift."""
        codes, slot_pos = self.held()
        q = self.encode(queries).unsqueeze(3)  # [B, Hkv, G, 1, L]
        k = codes.unsqueeze(2)  # [B, Hkv, 1, end, L]
        score = self.tables * self.bits - _popcount(torch.bitwise_xor(q, k)).sum(-1)  # agreeing bits [B, Hkv, G, end]
        if self.rank == "collisions":
            collisions = (q == k).sum(-1)
            score = (collisions * (self.tables * self.bits + 1) + score).masked_fill(collisions == 0, -1)
        score = score.amax(2)
        key = (score << self._position_bits) | slot_pos
        key = key.masked_fill((score < 0) | (slot_pos < 0), -1)
        best = key.topk(min(n, self.end), dim=-1).values  # keys are unique but for -1: any width ranks alike
        return torch.where(best >= 0, best & ((1 << self._position_bits) - 1), -1)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.projection.numel() * self.projection.element_size()


def _popcount(codes: torch.Tensor) -> torch.Tensor:
    """Set bits per byte of integer `codes` `[..., L]` -> uint8 `[..., L * bytes]` (bitwise, any device)."""
    x = codes.contiguous().view(torch.uint8)
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


class FaissIndex(_Groups):
    """Exact inner-product search with faiss on the CPU: one `IndexIDMap2(IndexFlatIP)` per
    (row, KV head) group, ids = positions. The G query heads of a group are searched together
    (top-n each) and merged by max score per position, which is exactly the top-n of max_g q·k.
    Keys and queries are copied to CPU float32; results come back on `device`.
    """

    kinds = ("flat",)

    def __init__(self, head_dim: int, kind: str = "flat", device="cpu"):
        super().__init__(head_dim)
        if kind not in self.kinds:
            raise ValueError(f"unknown faiss index kind {kind!r}; supported: {', '.join(self.kinds)}")
        try:
            import faiss
        except ImportError as error:
            raise ImportError("FaissIndex needs faiss: pip install faiss-cpu") from error
        self._faiss, self.kind, self.device = faiss, kind, torch.device(device)
        self.indexes: list = []

    def _ids(self, index):
        return self._faiss.vector_to_array(index.id_map)

    def add(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        self._check_keys(keys, positions)
        self._check_unique(positions)
        if not self.indexes:
            self.indexes = [
                self._faiss.IndexIDMap2(self._faiss.IndexFlatIP(self.head_dim))
                for _ in range(self.groups[0] * self.groups[1])
            ]
        keys = keys.detach().to("cpu", torch.float32).numpy()
        positions = positions.detach().to("cpu", torch.long).numpy()
        groups = list(zip(np.ndindex(*self.groups), self.indexes))
        for (row, head), index in groups:  # check every group before changing any
            if np.isin(positions[row, head], self._ids(index)).any():
                raise ValueError(f"adding a position the index already holds (row {row}, KV head {head})")
        for (row, head), index in groups:
            take = positions[row, head] >= 0
            index.add_with_ids(np.ascontiguousarray(keys[row, head][take]), positions[row, head][take])

    def remove(self, positions: torch.Tensor) -> None:
        if positions.dim() != 3:
            raise ValueError(f"positions must be [B, Hkv, n], got {tuple(positions.shape)}")
        self._check_groups(positions.shape[:2], "positions", init=False)
        self._check_unique(positions)
        positions = positions.detach().to("cpu", torch.long).numpy()
        drop = [positions[row, head][positions[row, head] >= 0] for row, head in np.ndindex(*positions.shape[:2])]
        for g, ids in enumerate(drop):
            absent = ids[~np.isin(ids, self._ids(self.indexes[g]))] if self.indexes else ids
            if absent.size:
                row, head = divmod(g, positions.shape[1])
                raise ValueError(f"position {int(absent[0])} is not in the index (row {row}, KV head {head})")
        for ids, index in zip(drop, self.indexes):
            if ids.size:
                index.remove_ids(ids)

    def search(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
        self._check_queries(queries, n)
        b, h, g, _ = queries.shape
        out = np.full((b, h, int(n)), -1, dtype=np.int64)
        queries = queries.detach().to("cpu", torch.float32).numpy()
        offsets = torch.zeros(b, h, g) if offsets is None else offsets.detach().to("cpu", torch.float32)
        shift = offsets.numpy().reshape(b, h, g, 1)  # per query head, broadcast over its n results
        for (row, head), index in zip(np.ndindex(b, h), self.indexes):
            scores, ids = index.search(np.ascontiguousarray(queries[row, head]), min(int(n), max(index.ntotal, 1)))
            scores, ids = (scores - shift[row, head]).ravel(), ids.ravel()
            keep = ids >= 0
            scores, ids = scores[keep], ids[keep]
            # best score per position (a position can come back for several heads), recency on ties
            order = np.lexsort((-ids, -scores))
            ids = ids[order]
            ids = ids[np.sort(np.unique(ids, return_index=True)[1])][: int(n)]
            out[row, head, : ids.size] = ids
        return torch.from_numpy(out).to(self.device)

    def count(self) -> torch.Tensor:
        counts = [index.ntotal for index in self.indexes]
        shape = self.groups if counts else (0, 0)
        return torch.tensor(counts, dtype=torch.long).view(shape).to(self.device)

    def __len__(self) -> int:
        return sum(index.ntotal for index in self.indexes)

    @property
    def nbytes(self) -> int:
        # the flat vectors (float32) and the id map (int64); faiss's reverse hash map is not counted
        return len(self) * (4 * self.head_dim + 8)


class ExactIndex(_SlotStore):
    """Exact top-n of max over the group's query heads of q·k: the parked keys in float32 on
    `device` (default the CPU, beside the host tier), scored by one matmul per call and ranked by
    one top-n. It returns what `FaissIndex` returns, but when the candidates are thousands per step
    (long contexts, where a query needs over 10% of the context) one scan and one top-n beat faiss's
    per-query-head heaps and their merge (measured on a CPU: docs/results/kernel-notes.md). Ties
    come out in `torch.topk`'s order (float scores rarely tie)."""

    def __init__(self, head_dim: int, device="cpu"):
        super().__init__(head_dim, device, (int(head_dim),), torch.float32)

    @property
    def keys(self) -> torch.Tensor:
        """`[B, Hkv, capacity, D]` float32 keys of the entries."""
        return self.payload

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.to(self.device, torch.float32)

    def _best(self, queries: torch.Tensor, n: int, offsets: torch.Tensor | None) -> torch.Tensor:
        keys, slot_pos = self.held()
        scores = torch.matmul(queries.to(self.device, torch.float32), keys.transpose(-1, -2))  # [B, Hkv, G, end]
        if offsets is not None:
            scores = scores - offsets.to(self.device, torch.float32).unsqueeze(-1)
        # ranked at the capacity's width, -inf above `end`: `topk` orders tied scores (common among
        # the best: q·k minus the offset is coarse in float32) differently at another width
        ranked = torch.full(self.slot_pos.shape, -torch.inf, device=self.device)
        ranked[..., : self.end] = scores.amax(2).masked_fill(slot_pos < 0, -torch.inf)
        best = ranked.topk(n, dim=-1)
        return torch.where(best.values > -torch.inf, self.slot_pos.gather(-1, best.indices), -1)


INDEXES = {"lsh": LSHIndex, "faiss": FaissIndex, "exact": ExactIndex}


def make_index(name: str, **kwargs) -> KeyIndex:
    """The index registered as `name` ("lsh", "faiss" or "exact"), built with `kwargs`."""
    if name not in INDEXES:
        raise ValueError(f"unknown index {name!r}; choose one of: {', '.join(sorted(INDEXES))}")
    return INDEXES[name](**kwargs)
