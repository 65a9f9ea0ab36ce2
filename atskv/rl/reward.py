"""The method's reward, `R = alpha * performance - (1 - alpha) * memory` (the ATSKV
proposal, "Adaptive Token-Relevance Sparse KV-Cache for Efficient Long Context Understanding"),
and the leave-one-out baseline over the K samples of one context.

Performance is -NLL of the continuation (corpus windows) or task exact-match in {0, 1}; memory
is the retained fraction of the managed layers' context KV in [0, 1]. alpha = 1 cares only
about quality, alpha = 0 only about memory.

Training maximises E[R] but does not estimate both parts from samples: the leave-one-out
baseline is taken over the performances alone (REINFORCE), and E[memory] enters with its exact
gradient (`atskv.rl.training`); `reward` is what is logged and evaluated.
"""

from __future__ import annotations

import torch


def check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha weighs performance against memory and must lie in [0, 1], got {alpha!r}")
    return float(alpha)


def reward(performance: torch.Tensor, memory: torch.Tensor, alpha: float) -> torch.Tensor:
    """`alpha * performance - (1 - alpha) * memory`, elementwise."""
    alpha = check_alpha(alpha)
    return alpha * performance - (1.0 - alpha) * memory


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """Advantages `R_k - mean_{j != k} R_j` over the last dim (the K >= 2 samples of one context):
    an unbiased baseline, since sample k's own reward is left out of it."""
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError(f"the leave-one-out baseline needs at least 2 samples per context, got {k}")
    others = (rewards.sum(-1, keepdim=True) - rewards) / (k - 1)
    return rewards - others
