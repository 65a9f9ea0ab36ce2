"""What data-parallel training needs beside Lightning's DDP so that N processes train as one
(and the rank, world size and barrier of a collection split over processes, `atskv.predictor.launch`).

`atskv fit` and `atskv finetune` give every optimiser step the same rows on any number of
processes (`atskv.predictor.batches`); three things would still depend on how a step is split:
- Means. DDP averages the processes' gradients, so a loss averaged over each process's own rows
  weighs a row by 1 / (its process's rows). `global_means` divides by the count over all
  processes instead and scales by the world size that DDP's average divides by.
- Batch norm. The scalar features' BatchNorm standardises with the batch's statistics; on one
  process of N those are a part's. `GlobalBatchNorm1d` reduces count, mean and variance over the
  processes, with gradients (torch's SyncBatchNorm does this on GPUs only; this one runs on CPU
  with gloo as well, which is how the tests check it).
- Randomness. Each process has its own RNG stream, so random partners (the ranking loss) and
  sampled retentions (the policy) come from counters keyed by what they are drawn for:
  `counter_hash`, `seeded`.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def barrier() -> None:
    """Wait for every process (nothing to wait for in one)."""
    if world_size() > 1:
        dist.barrier()


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the processes (a copy on its own device; no gradient). NCCL reduces
    only CUDA tensors: a host tensor (a count, host-side statistics) goes through this process's
    GPU and comes back."""
    tensor = tensor.detach().clone()
    if world_size() > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else tensor.device
        moved = tensor.to(backend_device)
        dist.all_reduce(moved)
        tensor = moved.to(tensor.device)
    return tensor


def global_means(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Means over all processes of quantities summed here as `sums` `[Q]` over `counts` `[Q]`
    items: (this process's share to backpropagate, which DDP's average over processes turns into
    the gradient of the global means; the global means themselves, detached, equal everywhere)."""
    totals = all_sum(torch.cat([sums.detach().double(), counts.to(sums.device, torch.float64)]))
    n = len(sums)
    count = totals[n:].clamp_min(1).to(sums.dtype)
    return sums / count * world_size(), totals[:n].to(sums.dtype) / count


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose training statistics are those of the rows of all processes together.

    The same parameters and buffers as BatchNorm1d (checkpoints are interchangeable); outside
    training, or in one process, it is BatchNorm1d. Two-pass variance, as torch's batch norm."""

    @classmethod
    def replacing(cls, norm: nn.BatchNorm1d) -> GlobalBatchNorm1d:
        new = cls(norm.num_features, norm.eps, norm.momentum, norm.affine, norm.track_running_stats)
        new.load_state_dict(norm.state_dict())
        return new.to(norm.running_mean.device if norm.running_mean is not None else "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and world_size() > 1):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce  # differentiable

        count = all_sum(x.new_tensor(float(x.shape[0])))
        mean = all_reduce(x.sum(0)) / count
        var = all_reduce(((x - mean) ** 2).sum(0)) / count
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * count / (count - 1).clamp_min(1), self.momentum)
                self.num_batches_tracked += 1
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y * self.weight + self.bias if self.affine else y


def globalise_batch_norms(module: nn.Module) -> None:
    """Replace every BatchNorm1d inside `module` by a `GlobalBatchNorm1d` (in place)."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm1d:
            setattr(module, name, GlobalBatchNorm1d.replacing(child))
        else:
            globalise_batch_norms(child)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def counter_hash(*keys: torch.Tensor | int) -> torch.Tensor:
    """Non-negative int64 hash of integer keys (tensors broadcast): splitmix64's mixer applied
    after each key. The same keys give the same value in any process, in any order of calls."""
    x = torch.zeros((), dtype=torch.int64)
    for key in keys:
        x = x ^ torch.as_tensor(key, dtype=torch.int64)
        x = x + _GOLDEN
        x = (x ^ _shift(x, 30)) * _M1
        x = (x ^ _shift(x, 27)) * _M2
        x = x ^ _shift(x, 31)
    return x & ((1 << 63) - 1)


def stable_seed(text: str) -> int:
    """A 63-bit integer hash of `text` that does not change between processes or runs (Python's
    `hash` of a str does)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def seeded(*parts) -> Iterator[None]:
    """Inside, torch's RNG (CPU and the current CUDA device) starts from a `stable_seed` of
    `parts`; its state outside is restored after."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(stable_seed(repr(parts)))
        yield
