"""SparQ (Ribar et al., 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference", arXiv:2312.04985):
approximate attention from the r largest query components, then exact top-k.

Each query head picks its own r dimensions with the largest |q| (as the authors' code, which
expands K to the query heads) and approximates its logits on them (`atskv.kernels.partial_scores`,
gathered from the full keys each step, nothing stored). The softmax of the approximation is
sharpened by SparQ's temperature correction: the logits are divided by `sqrt(D * a)` instead of
`sqrt(D)`, with `a = sum_r |q_i| / sum_D |q_i|` the share of the query's L1 mass kept (here
`scaling / sqrt(a)`, so a model's own attention scale is kept). Probabilities are summed over the
query heads of a GQA group (post-softmax pooling, as the oracle); the hook then keeps the exact
top-budget, SparQ's step 2.

r is a fraction of the head dimension (rounded, at least 1), default 1/8: the default of the
authors' code (compression ratio 8 gives r = D / 8, 16 of D = 128). SparQ's mean-value
reallocation (mixing in the mean of V by the approximate mass left out) changes the attention
output, not which tokens are chosen, so it is not part of a selector and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.kernels.partial_scores import partial_scores
from atskv.selectors.base import LayerView, Selector


def pooled_probs(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax of per-query-head logits `[B, Hq, Tq, S]` over the slots `valid` (`[B, Hkv, Tq, S]`)
    allows, summed over each GQA group: `[B, Hkv, Tq, S]`."""
    b, hkv, tq, s = valid.shape
    grouped = logits.view(b, hkv, -1, tq, s).masked_fill(~valid.unsqueeze(2), torch.finfo(logits.dtype).min)
    return torch.softmax(grouped, dim=-1).sum(dim=2)


@dataclass
class SparQSelector(Selector):
    name = "sparq"
    query_aware = True
    rank_fraction: float = 1 / 8

    def scores(self, view: LayerView):
        query = view.query
        d = query.shape[-1]
        rank = max(1, min(d, round(d * self.rank_fraction)))
        magnitude = query.abs().float()
        top = magnitude.topk(rank, dim=-1)
        logits = partial_scores(query, view.keys, top.indices)  # [B, Hq, Tq, S]
        tiny = torch.finfo(torch.float32).tiny
        kept_share = top.values.sum(-1) / magnitude.sum(-1).clamp(min=tiny)
        scale = view.scaling / kept_share.clamp(min=tiny).sqrt()
        return pooled_probs(logits * scale.unsqueeze(-1), view.valid)
