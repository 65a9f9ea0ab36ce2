"""Adaptive sparsity: which active tokens stay on the GPU, which go to the host, which come back.

Why. A fixed top-k keeps the same number of tokens whatever the context; ATSKV (the proposal
"Adaptive Token-Relevance Sparse KV-Cache for Efficient Long Context Understanding") instead keeps
the tokens whose relevance clears a per-layer threshold that tightens as the active tier fills
(memory feedback). Relevance of a single step is noisy, so a token is judged on a momentum of its
recent verdicts (no flapping), and tokens cross between the tiers only across a gap (hysteresis),
since every crossing is a host<->device copy. On top of the soft rule sits a hard cap: the cache
sizes GPU buffers from it, so it is never exceeded. This module is pure tensor logic over
`[B, Hkv, S]` (batch row, KV head, slot), on any device, without Python loops over rows or heads and without
host syncs; it holds no KV itself.

As implemented, per layer l with its `LayerPolicy` and per (row, KV head):
- `q = q_min + (q_max - q_min) * min(1, current / target_active)`, `current` the active-token
  count (or what the caller passes instead, e.g. a measure of allocated memory in tokens);
- `tau = beta * quantile(r over the active tokens, q)`, linear interpolation between order
  statistics (what `torch.quantile` does), so q is the fraction of active tokens counted low;
- `M <- lambda * M + (1 - lambda) * 1[r > tau]` for every active token; a token stays if `M > 0.5`;
- given the slots the selector does not want (`Selector.unwanted`: the learned selector's `r <= threshold`),
  the verdict is `1[not unwanted]` instead;
- protected tokens (position < `sinks`, or position >= seen - `recent`) always stay;
- hard cap: if more than `max_active` would stay, the protected ones plus the highest-scoring
  others up to `max_active` stay (ties: the newer token);
- promotion: a passive candidate comes back if `r > tau_promote`, at most `free` per row, best first.

Choices where the proposal is silent:
- Hysteresis lives in quantile space: `tau_promote = beta * quantile(r, min(1, q + promote_margin))`
  over the same active tokens, and `tau_demote = tau` (demotion additionally waits for the
  momentum to decay). A promoted token must rank among the top `1 - q - margin` of the active
  ones. A score-space margin (`tau + m`) depends on the predictor's calibration: sigmoid scores
  that crowd into a narrow band (common for BCE-trained scorers with rare positives) would make
  any fixed m either block all promotions or separate nothing; quantiles are scale-free. The gap
  only closes where the active scores between the two quantiles are tied.
- A token entering the active tier (new, or promoted) starts at `M = INITIAL_MOMENTUM = 1.0`: it
  is kept until it has been low for `ceil(log 0.5 / log lambda)` refreshes (4 at lambda = 0.8).
- The quantile is over all the layer's tokens (`total` of them per row and KV head, when the
  caller passes it), active and parked, counting every parked token as scoring below every
  active one (they left because they scored low; their current scores are not on the GPU). So
  the level over the active tokens is `1 - (1 - q) * total / active`, clamped to 1 (below 0 the
  quantile lies among the parked tokens and the threshold is -inf): the active tier converges
  to the top `1 - q` of the whole context. A quantile over the active
  tokens alone (no `total`) has no fixed point: each refresh pushes the lowest `q_min` of
  whatever remains towards the host, so the tier drains to its protected tokens (measured on
  Gemma 3 at 32K: 1.2% of the context left active under a "10%" cap). Protected tokens are in
  the tier and count; a row with no active token gets `tau = tau_promote = -inf`.
- Momentum is updated for protected tokens too, so a token leaving the recent window carries an
  honest history; slots that are not active keep the momentum they were given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atskv.errors import is_int

INITIAL_MOMENTUM = 1.0  # momentum of a token entering the active tier: new tokens start kept


@dataclass(frozen=True)
class LayerPolicy:
    """Threshold schedule and stability knobs of one layer (see the module docstring)."""

    beta: float = 1.0
    q_min: float = 0.5
    q_max: float = 0.9
    momentum: float = 0.8  # lambda
    promote_margin: float = 0.05  # in quantile levels; 0 disables the hysteresis gap

    def __post_init__(self):
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")
        if not 0.0 <= self.q_min <= self.q_max <= 1.0:
            raise ValueError(f"need 0 <= q_min <= q_max <= 1, got q_min={self.q_min}, q_max={self.q_max}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum (lambda) must lie in [0, 1), got {self.momentum}")
        if not 0.0 <= self.promote_margin < 1.0:
            raise ValueError(f"promote_margin is a quantile gap in [0, 1), got {self.promote_margin}")


@dataclass(frozen=True)
class SparsityBudget:
    """Active-tier sizes per (row, KV head), in tokens: `max_active` is a hard cap (the cache
    derives it from GPU bytes), `target_active` (default: the cap) the memory-feedback target;
    the first `sinks` and last `recent` positions are always active."""

    max_active: int
    target_active: int | None = None
    sinks: int = 4
    recent: int = 64

    def __post_init__(self):
        if self.target_active is None:
            object.__setattr__(self, "target_active", self.max_active)
        for name in ("max_active", "target_active", "sinks", "recent"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int (tokens), got {value!r}")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks and recent must be >= 0, got sinks={self.sinks}, recent={self.recent}")
        if self.max_active < max(1, self.sinks + self.recent):
            raise ValueError(
                f"max_active={self.max_active} cannot hold the {self.sinks} sink + {self.recent} recent tokens "
                f"that are always active: it needs at least {max(1, self.sinks + self.recent)} "
                "(raise the GPU budget or lower sinks/recent)"
            )
        if not 1 <= self.target_active <= self.max_active:
            raise ValueError(f"target_active must lie in [1, max_active={self.max_active}], got {self.target_active}")


@dataclass(frozen=True)
class Decision:
    """What one refresh decides for one layer; all `[B, Hkv, S]` unless noted."""

    keep: torch.Tensor  # bool: active tokens that stay
    demote: torch.Tensor  # bool: active tokens to move to the host (active & ~keep)
    momentum: torch.Tensor  # float: updated where active, unchanged elsewhere
    tau: torch.Tensor  # [B, Hkv, 1]
    tau_promote: torch.Tensor  # [B, Hkv, 1]: what `promote` needs
    free: torch.Tensor  # [B, Hkv] long: max_active minus the kept tokens, room for promotions


class SparsityManager:
    """Per-layer adaptive thresholds, momentum, hysteresis and the hard cap of the active tier.

    `policies`: one `LayerPolicy` for every layer, or a dict of them by layer index."""

    def __init__(self, policies: LayerPolicy | dict[int, LayerPolicy], budget: SparsityBudget):
        if isinstance(policies, dict):
            bad = [k for k, p in policies.items() if not isinstance(p, LayerPolicy)]
            if bad or not policies:
                raise TypeError(f"policies must map layer indices to LayerPolicy; bad entries for layers {bad}")
        elif not isinstance(policies, LayerPolicy):
            raise TypeError(f"policies must be a LayerPolicy or a dict of them, got {type(policies).__name__}")
        if not isinstance(budget, SparsityBudget):
            raise TypeError(f"budget must be a SparsityBudget, got {type(budget).__name__}")
        self.policies = policies
        self.budget = budget

    def policy(self, layer: int) -> LayerPolicy:
        if isinstance(self.policies, LayerPolicy):
            return self.policies
        if layer not in self.policies:
            raise ValueError(f"no LayerPolicy for layer {layer}; policies cover layers {sorted(self.policies)}")
        return self.policies[layer]

    def quantile_level(self, layer: int, current: torch.Tensor) -> torch.Tensor:
        """`q_l(t)` `[B, Hkv]` float32 from the active-token counts `current` `[B, Hkv]`."""
        p = self.policy(layer)
        fill = (current.float() / self.budget.target_active).clamp(0.0, 1.0)
        return p.q_min + (p.q_max - p.q_min) * fill

    def thresholds(
        self,
        layer: int,
        scores: torch.Tensor,
        active: torch.Tensor,
        current: torch.Tensor | None = None,
        total: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(tau, tau_promote)`, each `[B, Hkv, 1]`, from the scores of the active tokens
        (`current` defaults to their count; `total`: the layer's tokens, active and parked, an int
        or `[B, Hkv]`; default: the active ones)."""
        _check(scores, active=active)
        count = active.sum(-1)
        if current is None:
            current = count
        elif current.shape != scores.shape[:2]:
            raise ValueError(f"current must be [B, Hkv] = {list(scores.shape[:2])}, got {list(current.shape)}")
        p = self.policy(layer)
        q = self.quantile_level(layer, current).unsqueeze(-1)
        levels = torch.cat([q, (q + p.promote_margin).clamp(max=1.0)], dim=-1)
        below = torch.zeros_like(levels, dtype=torch.bool)
        if total is not None:  # parked tokens rank below every active one
            share = torch.as_tensor(total, device=scores.device).float().expand_as(count) / count.clamp(min=1)
            levels = 1.0 - (1.0 - levels) * share.unsqueeze(-1)
            below = levels < 0  # the quantile falls among the parked tokens: every active one clears it
            levels = levels.clamp(0.0, 1.0)
        both = (p.beta * _masked_quantile(scores, active, levels)).masked_fill(below, -math.inf)
        return both[..., :1], both[..., 1:]

    def decide(
        self,
        layer: int,
        scores: torch.Tensor,
        active: torch.Tensor,
        positions: torch.Tensor,
        momentum: torch.Tensor,
        seen: int,
        current: torch.Tensor | None = None,
        total: int | torch.Tensor | None = None,
        reserve: torch.Tensor | None = None,
        unwanted: torch.Tensor | None = None,
    ) -> Decision:
        """Keep/demote the active tokens of one layer (`scores`, `active` bool, `positions` long,
        `momentum` float: all `[B, Hkv, S]`; `seen`: tokens written so far, for the recent window;
        `current`, `total`: see `thresholds`; `reserve` `[B, Hkv]`: slots to free under the cap
        for promotions, taken from the unprotected tokens, lowest priority first; `unwanted` bool
        `[B, Hkv, S]`: the slots the selector drops whatever its budget (`Selector.unwanted`), whose
        complement the momentum votes on instead of `scores > tau`; `tau` is still computed and
        returned)."""
        _check(scores, active=active, positions=positions, momentum=momentum)
        if positions.is_floating_point() or not momentum.is_floating_point():
            raise ValueError(f"positions must be integer and momentum float, got {positions.dtype}, {momentum.dtype}")
        lam, b = self.policy(layer).momentum, self.budget
        tau, tau_promote = self.thresholds(layer, scores, active, current, total)
        wanted = scores > tau if unwanted is None else ~unwanted
        updated = lam * momentum + (1.0 - lam) * wanted.to(momentum.dtype)
        momentum = torch.where(active, updated, momentum)
        protected = active & ((positions < b.sinks) | (positions >= seen - b.recent))
        want = active & (protected | (momentum > 0.5))
        # hard cap: rank by (protected, wanted, score, newer) and keep the first max_active wanted
        priority = 2 * protected.to(torch.int8) + want.to(torch.int8)
        room = b.max_active if reserve is None else (b.max_active - reserve).clamp(min=protected.sum(-1))
        keep = want & _first(room, positions, scores, priority)
        free = b.max_active - keep.sum(-1)
        return Decision(keep, active & ~keep, momentum, tau, tau_promote, free)

    @staticmethod
    def promote(
        candidate_scores: torch.Tensor, candidate_valid: torch.Tensor, tau_promote: torch.Tensor, free: torch.Tensor
    ) -> torch.Tensor:
        """Bool `[B, Hkv, n]`: the valid candidates with `r > tau_promote` (`[B, Hkv, 1]`, from
        `decide` or `thresholds`), at most `free` (`[B, Hkv]`) per row, best first (ties: lower index)."""
        _check(candidate_scores, candidate_valid=candidate_valid)
        b, h = candidate_scores.shape[:2]
        if tau_promote.shape != (b, h, 1) or free.shape != (b, h):
            raise ValueError(
                f"tau_promote must be [B, Hkv, 1] and free [B, Hkv] for candidates of shape "
                f"{list(candidate_scores.shape)}, got {list(tau_promote.shape)} and {list(free.shape)}"
            )
        eligible = candidate_valid & (candidate_scores > tau_promote)
        return eligible & _first(free, candidate_scores, eligible.to(torch.int8))


def _check(scores: torch.Tensor, **others: torch.Tensor) -> None:
    """`scores` is `[B, Hkv, S]` and every other tensor has its shape; the bool ones are bool."""
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, Hkv, S], got shape {list(scores.shape)}")
    for name, t in others.items():
        if t.shape != scores.shape:
            raise ValueError(f"{name} must have the shape of the scores {list(scores.shape)}, got {list(t.shape)}")
        if name in ("active", "candidate_valid") and t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool mask, got {t.dtype}")


def _masked_quantile(values: torch.Tensor, mask: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Quantiles `[B, Hkv, k]` of `values` over the `mask`ed entries of each row at `levels`
    `[B, Hkv, k]`, interpolated linearly as `torch.quantile` does; -inf for an empty row.
    Masked-out entries sort last as +inf, so a row's n entries are its first n."""
    work = values.to(torch.promote_types(values.dtype, torch.float32))
    ordered = work.masked_fill(~mask, math.inf).sort(dim=-1).values
    n = mask.sum(-1, keepdim=True)
    rank = levels.to(work.dtype) * (n - 1).clamp(min=0)
    below = rank.floor()
    lo = ordered.gather(-1, below.long())
    hi = ordered.gather(-1, rank.ceil().long())
    return torch.lerp(lo, hi, rank - below).masked_fill(n == 0, -math.inf)


def _first(count: int | torch.Tensor, *keys: torch.Tensor) -> torch.Tensor:
    """Bool mask of the first `count` (int or `[B, Hkv]`) entries of each row in descending
    lexicographic order of `keys`, the most significant last; remaining ties go to the lower
    index. Stable sorts, least significant key first, compose into that order without a sync."""
    order = None
    for key in keys:
        idx = (key if order is None else key.gather(-1, order)).sort(dim=-1, descending=True, stable=True).indices
        order = idx if order is None else order.gather(-1, idx)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    return rank < (count.unsqueeze(-1) if isinstance(count, torch.Tensor) else count)
