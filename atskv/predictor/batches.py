"""Batches of whole groups, the same global batches on any number of processes.

A group is a set of rows that must be seen together (the ranking loss pairs rows of one group;
in `atskv finetune` every context is a group of one). Batches are packed from whole groups up
to `batch_size` rows, the rows of ALL processes together: one optimiser step sees the same rows
whether one process or N take it. Each process takes a share of every batch's groups, dealt
largest first to the least loaded process, so `devices` changes how a step is computed, never
what it computes; a process whose share is empty (fewer groups than processes) still takes the
step, with no rows.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class GroupBatchSampler(Sampler[list[int]]):
    """Batches of whole groups, about `batch_size` rows each over all `world_size` processes (a
    larger group is a batch alone); yields this `rank`'s share of each batch.

    With `shuffle`, pass e over the data draws its group order from `seed + e`; without, groups
    keep their order. `keep`: a bool per row; the batches hold only those rows (default all).
    """

    def __init__(
        self, group: torch.Tensor, batch_size: int, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1,
        keep: torch.Tensor | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size} processes")
        index = torch.arange(len(group)) if keep is None else keep.nonzero().flatten()
        _, inverse, counts = torch.unique(group[index], return_inverse=True, return_counts=True)
        self.rows = index[torch.argsort(inverse, stable=True)].split(counts.tolist())  # row indices per group
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._batches = self._pack(range(len(self.rows)))

    def _pack(self, order) -> list[list[int]]:
        """Group ids per batch, filled in `order`."""
        batches, current, size = [], [], 0
        for g in order:
            if current and size + len(self.rows[g]) > self.batch_size:
                batches.append(current)
                current, size = [], 0
            current.append(g)
            size += len(self.rows[g])
        return batches + [current] if current else batches

    def _share(self, batch: list[int]) -> list[int]:
        """This rank's groups of `batch`: largest first to the least loaded rank (ties: lower rank)."""
        if self.world_size == 1:
            return batch
        owner, load = {}, [0] * self.world_size
        for g in sorted(batch, key=lambda g: -len(self.rows[g])):
            owner[g] = load.index(min(load))
            load[owner[g]] += len(self.rows[g])
        return [g for g in batch if owner[g] == self.rank]

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self.epoch += 1
            self._batches = self._pack(torch.randperm(len(self.rows), generator=generator).tolist())
        for batch in self._batches:
            share = self._share(batch)
            yield torch.cat([self.rows[g] for g in share]).tolist() if share else []

    def __len__(self) -> int:
        return len(self._batches)
