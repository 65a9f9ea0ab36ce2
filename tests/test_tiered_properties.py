"""The two-tier store under random use: hypothesis runs random sequences of append / demote /
promote / evict / retrieve, with transfers that fail half-way, over one `TieredLayer` and checks
after every operation that every token of every row and KV head is in exactly one tier (none once
evicted), bit-identical to what was written, with its selector state, and that a failed move left
both tiers as they were.

The fast run (`make test`) tries `FAST_SEQUENCES` sequences with a fixed seed; the slow one
(`-m slow`) `ATSKV_TIER_SEQUENCES` (default 10,000) with a fresh seed each time."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from atskv.runtime.reference.host_tier import HostTier
from atskv.runtime.reference.retrieval import make_index
from atskv.runtime.reference.tiered_cache import TieredLayer, TierStats

B, H, D = 2, 3, 4
CAPACITY = 96  # the most tokens a sequence reaches
STEPS = 25  # operations per sequence, at most
FAST_SEQUENCES = 60
STATE = "score"  # a selector's per-slot state: the token's first key channel, so it can be checked
seeds = st.integers(0, 2**31 - 1)
shares = st.floats(0.0, 1.0)
counts = {"sequences": 0, "operations": 0, "failed_moves": 0}


class TransferFailed(RuntimeError):
    """The fault injected into a host <-> GPU copy."""


class TwoTierStore(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.layer = TieredLayer(
            layer_idx=0,
            make_host=lambda i, k, v: HostTier(B, H, D, D, CAPACITY, k.dtype),
            make_index=lambda k: make_index("exact", head_dim=D),
            stats=TierStats(),
        )
        self.keys = torch.empty(B, H, 0, D)  # everything written, by position
        self.values = torch.empty(B, H, 0, D)
        self.evicted = torch.zeros(B, H, 0, dtype=torch.bool)
        counts["sequences"] += 1

    # --- operations ----------------------------------------------------------------------------
    @precondition(lambda self: self.layer.seen < CAPACITY)
    @rule(n=st.integers(1, 12), seed=seeds)
    def append(self, n, seed):
        n = min(n, CAPACITY - self.layer.seen)
        g = torch.Generator().manual_seed(seed)
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        start = self.layer.seen
        self.layer.update(k, v)
        state = self.layer.slot_tensor(STATE)
        new = self.layer.slot_pos[..., : self.layer.length] >= start
        state[new] = self.layer.keys[..., : self.layer.length, 0][new]
        self.keys, self.values = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
        self.evicted = torch.cat([self.evicted, torch.zeros(B, H, n, dtype=torch.bool)], 2)

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares)
    def demote(self, seed, share):
        self.layer.demote(self._some(self.layer.occupied, seed, share))

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares)
    def promote(self, seed, share):
        self.layer.promote(self._parked(seed, share))

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares)
    def evict(self, seed, share):
        drop = self._some(self.layer.occupied, seed, share)
        gone = self.layer.slot_pos[..., : self.layer.length].masked_fill(~drop, -1)
        b, h, s = (gone >= 0).nonzero(as_tuple=True)
        self.evicted[b, h, gone[b, h, s]] = True
        self.layer.evict(drop)

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares)
    def retrieve(self, seed, share):
        positions = self._parked(seed, share)
        before = self._tiers()
        keys, values = self.layer.read(positions)
        real = (positions >= 0).unsqueeze(-1)
        assert torch.equal(keys, self._written(self.keys, positions).masked_fill(~real, 0))
        assert torch.equal(values, self._written(self.values, positions).masked_fill(~real, 0))
        assert all(_position_sets(a) == _position_sets(b) for a, b in zip(before, self._tiers())), "a read moved tokens"

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares, cut=shares)
    def demote_failing_half_way(self, seed, share, cut):
        """The host tier takes the first `cut` of each row's tokens, then the copy fails."""
        host = self.layer.host
        real_write = host._write

        def partial(keys, values, positions):
            real_write(keys, values, _first_part(positions, cut))
            raise TransferFailed("device-to-host copy failed")

        self._failing(lambda: self.layer.demote(self._some(self.layer.occupied, seed, share)), host, "_write", partial)

    @precondition(lambda self: self.layer.is_initialized)
    @rule(seed=seeds, share=shares, cut=shares)
    def promote_failing_half_way(self, seed, share, cut):
        """The GPU slots take the first `cut` of each row's tokens, then the copy fails."""
        layer = self.layer
        real_write = layer._write_slots

        def partial(slots, keys, values, positions, ragged=False):
            real_write(slots, keys, values, _first_part(positions, cut), ragged=True)
            raise TransferFailed("host-to-device copy failed")

        self._failing(lambda: layer.promote(self._parked(seed, share)), layer, "_write_slots", partial)

    # --- the invariant -------------------------------------------------------------------------
    @invariant()
    def every_token_in_exactly_one_tier_bit_identical(self):
        counts["operations"] += 1
        layer = self.layer
        if not layer.is_initialized:
            return
        gpu, host = self._tiers()
        seen = layer.seen
        held = torch.zeros(B, H, seen + 1, dtype=torch.long)
        for positions in (gpu, host):
            held.scatter_add_(2, positions.masked_fill(positions < 0, seen), torch.ones_like(positions))
        assert torch.equal(held[..., :seen], (~self.evicted).long()), "a token in both tiers, in neither, or evicted"
        on_gpu, on_host = gpu >= 0, host >= 0
        for store, written in ((layer.keys, self.keys), (layer.values, self.values)):
            assert torch.equal(store[..., : layer.length, :][on_gpu], self._written(written, gpu)[on_gpu])
        for store, written in ((layer.host.keys, self.keys), (layer.host.values, self.values)):
            assert torch.equal(store[on_host], self._written(written, host)[on_host])
        assert torch.equal(layer.slot_tensor(STATE)[on_gpu], self._written(self.keys, gpu)[..., 0][on_gpu])
        # [0, 0] before an add
        indexed = layer.index.count() if len(layer.index) else torch.zeros(B, H, dtype=torch.long)
        assert torch.equal(indexed, on_host.sum(-1)), "the index lists exactly the parked tokens"
        assert layer.parked_tokens == int(on_host.sum())

    # --- helpers -------------------------------------------------------------------------------
    def _tiers(self) -> tuple[torch.Tensor, torch.Tensor]:
        gpu, host = self.layer.held_positions()
        return gpu.clone(), host.clone()

    def _some(self, mask: torch.Tensor, seed: int, share: float) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return mask & (torch.rand(mask.shape, generator=g) < share)

    def _parked(self, seed: int, share: float) -> torch.Tensor:
        """A random ragged set of parked positions `[B, Hkv, capacity]`, -1 elsewhere."""
        host = self.layer.host.positions()
        return torch.where(self._some(host >= 0, seed, share), host, -1)

    @staticmethod
    def _written(written: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        index = positions.clamp(min=0).unsqueeze(-1).expand(*positions.shape, D)
        return written.gather(2, index)

    def _failing(self, move, owner, name: str, partial) -> None:
        """Run `move` with `owner.name` replaced by `partial`: it must raise, and leave both tiers as they were."""
        before = self._tiers()
        setattr(owner, name, partial)
        try:
            move()
        except TransferFailed:
            counts["failed_moves"] += 1
        finally:
            delattr(owner, name)
        gpu_after, host_after = self._tiers()
        for was, now in zip(before, (gpu_after, host_after)):
            assert _position_sets(was) == _position_sets(now), "a failed move changed what a tier holds"


def _first_part(positions: torch.Tensor, cut: float) -> torch.Tensor:
    """`positions` with only the first `cut` share of each row's real entries kept (the rest -1)."""
    real = positions >= 0
    rank = real.cumsum(-1)
    return positions.masked_fill(rank > (real.sum(-1, keepdim=True) * cut).floor(), -1)


def _position_sets(positions: torch.Tensor) -> list[set[int]]:
    return [set(row[row >= 0].tolist()) for row in positions.flatten(0, -2)]  # rows may hold no slots at all


def _run(sequences: int, derandomize: bool) -> None:
    counts.update(sequences=0, operations=0, failed_moves=0)
    start = time.perf_counter()
    run_state_machine_as_test(
        TwoTierStore,
        settings=settings(
            max_examples=sequences, stateful_step_count=STEPS, deadline=None, database=None, derandomize=derandomize,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"\n{counts['sequences']} sequences, {counts['operations']} operations checked, "
          f"{counts['failed_moves']} failed moves, {time.perf_counter() - start:.1f} s")


def test_random_sequences_keep_every_token_in_exactly_one_tier():
    _run(FAST_SEQUENCES, derandomize=True)


@pytest.mark.slow
def test_many_random_sequences_keep_every_token_in_exactly_one_tier():
    _run(int(os.environ.get("ATSKV_TIER_SEQUENCES", "10000")), derandomize=False)
