"""SparQ (Ribar et al., 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference", arXiv:2312.04985):
approximate attention from the r largest query components, then exact top-k.

Each query head picks its own r dimensions with the largest |q| (as the authors' code, which
expands K to the query heads; equal magnitudes: the lower dimension first) and approximates its
logits on them (`atskv.kernels.partial_scores`). The softmax of the approximation is sharpened by
SparQ's temperature correction: the logits are divided by `sqrt(D * a)` instead of `sqrt(D)`, with
`a = sum_r |q_i| / sum_D |q_i|` the share of the query's L1 mass kept (here `scaling / sqrt(a)`, so
a model's own attention scale is kept). Probabilities are summed over the query heads of a GQA
group (post-softmax pooling, as the oracle); the hook then keeps the exact top-budget, SparQ's
step 2.

On the fast path (`atskv.generate`) the selector keeps, as the paper does, a second, channel-major
copy of the layer's keys `[B, Hkv, D, S]`, so the r chosen dimensions are r contiguous rows: a step
reads r / D of K per query head instead of most of it (from row-major keys r scattered dimensions
touch most 32-byte sectors). It costs one more K of memory per managed layer. The step is four
kernels (`atskv.kernels.sparq_decode`: channels, approximate logits, pooled probabilities, the
chosen slots); elsewhere the reference gathers the dimensions from the keys and nothing is stored.

r is a fraction of the head dimension (rounded, at least 1), default 1/8: the default of the
authors' code (compression ratio 8 gives r = D / 8, 16 of D = 128). SparQ's mean-value
reallocation (mixing in the mean of V by the approximate mass left out) changes the attention
output, not which tokens are chosen, so it is not part of a selector and is left out.

The paper keeps no local window; `recent` (default 0: the paper's SparQ) makes the baseline
stronger by always choosing the newest `recent` positions, up to the query's own token, within the
budget (the newest first when they outnumber it): with 32, SmolLM2's attention recall went from
0.840 to 0.855.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.kernels.sparq_decode import channel_major, channel_rank, recent_first, sparq_decode, sparq_probs
from atskv.selectors.base import LayerView, Selector, budget_tokens


@dataclass
class SparQSelector(Selector):
    name = "sparq"
    fast_path = True
    query_aware = True
    rank_fraction: float = 1 / 8
    recent: int = 0

    def rank(self, head_dim: int) -> int:
        return channel_rank(head_dim, self.rank_fraction)

    def scores(self, view: LayerView):
        probs = sparq_probs(view.query, view.keys, view.valid, view.scaling, self.rank(view.query.shape[-1]))
        return recent_first(probs, view.slot_pos.unsqueeze(2), view.valid, self.recent, view.group_size)

    def static_write(self, view: LayerView) -> None:
        """Fast path: the channel-major key copy, built at the first decode step over the whole
        static buffer (after the prompt's slots were reordered); `decode_indices` then writes each
        decode token's key into it."""
        if not view.layer.decoding:
            view.layer.state.pop(self.name, None)
        elif self.name not in view.layer.state:
            view.layer.state[self.name] = channel_major(view.keys)

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """On the fast path the fused step over the channel-major copy (`sparq_decode`: the same
        slots as ranking `scores`, exactly equal probabilities going to the higher slot, listed in
        no particular order); elsewhere the default ranking of `scores`."""
        keys_t = view.layer.state.get(self.name) if view.fixed_shapes else None
        if keys_t is None:
            return super().decode_indices(view)
        k = min(budget_tokens(view), view.keys.shape[2])
        return sparq_decode(view.query[:, :, -1], view.keys, keys_t, view.slot_pos, view.layer.write_slot,
                            view.context[:, 0, -1], view.scaling, self.rank(view.query.shape[-1]), view.budget,
                            k, recent=self.recent)  # fmt: skip
