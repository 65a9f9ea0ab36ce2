"""The predictor's scalar features (columns defined in `atskv.features`) and its labels for one
managed layer at a decision time t.

Everything here is a small pure function of tensors: the collection (`atskv collect`) computes
it from one layer's attention probabilities pooled over each KV group's query heads,
`probs` `[B, Hkv, T, T]` (query x key), and the learned selector computes the same features at
run time from its own accumulators. Tokens are those at positions 0..t; the "future" queries
are t+1..t+W, the ones a cache chosen at time t would serve.
"""

import torch

from atskv.features import feature_columns


def attention_so_far(probs: torch.Tensor, t: int) -> torch.Tensor:
    """`[B, Hkv, t+1]`: mean attention token i received from queries i..t (causal: the only ones
    that can see it), the H2O accumulator divided by the number of queries it summed."""
    received = probs[..., : t + 1, : t + 1].float().sum(-2)
    queries = torch.arange(t + 1, 0, -1, device=probs.device, dtype=received.dtype)  # t - i + 1
    return received / queries


def future_mass(probs: torch.Tensor, t: int, future_queries: int) -> torch.Tensor:
    """`[B, Hkv, t+1]`: mean attention token i (<= t) receives from queries t+1..t+W: the label."""
    return probs[..., t + 1 : t + 1 + future_queries, : t + 1].float().mean(-2)


def topk_members(mass: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the `k` highest-`mass` tokens per row (last dim), the oracle's kept set."""
    top = mass.topk(min(k, mass.shape[-1]), dim=-1).indices
    return torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, top, True)


def scalar_features(
    attention: torch.Tensor,
    prev_attention: torch.Tensor | None,
    hidden: torch.Tensor,
    keys: torch.Tensor,
    t: int,
) -> torch.Tensor:
    """`[B, Hkv, t+1, F]` float32 in `SCALAR_FEATURES` order for tokens 0..t.

    `attention` `[B, Hkv, t+1]` (see `attention_so_far`); `prev_attention` `[B, t+1]` from the
    previous managed layer or None in the first; `hidden` `[B, t+1, d_model]` (attention input);
    `keys` `[B, Hkv, t+1, D]` (post-RoPE)."""
    b, hkv, n = attention.shape
    pos = torch.arange(n, device=attention.device, dtype=torch.float32)

    def per_head(x: torch.Tensor) -> torch.Tensor:  # [n] or [B, n], shared by the KV heads
        return x.to(torch.float32).view(-1, 1, n).expand(b, hkv, n)

    prev = torch.zeros(b, n, device=attention.device) if prev_attention is None else prev_attention
    newest = torch.tensor(float(t), device=attention.device)
    return feature_columns(
        attention.float(), per_head(pos), newest, per_head(hidden.float().norm(dim=-1)), keys.float().norm(dim=-1),
        per_head(prev),
    )
