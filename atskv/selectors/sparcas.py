"""SparCas ("SparCas: A Dimension-First Cascade for Efficient Long-Context LLM Inference", anonymous,
under double-blind review; no arXiv id): a dimension-first cascade. Pick the top D_b key dimensions
by |q| once every U steps, keep a compact copy of the keys on those dimensions, and rank tokens by
partial logits over that copy only.

Paper defaults: D_b = 16 dimensions, refreshed every U = 64 decode steps, first two layers dense
(the hook's `dense_layers=2`). Under GQA the paper chooses one dimension set per KV group from
"group-wise importance": here the |q| of the group's query heads summed. The dimensions come from
the newest query of the step that refreshes them: the prompt's last query after a dense prefill
(the paper's one-off compact-K gathering after prefill), then the query of every U-th token after
it. The compact keys `[B, Hkv, S, D_b]` live in the layer's state and are extended with each new
token (slots are append-only for non-evicting selectors), rebuilt on refresh.

Token scores: each query head's partial logits, scaled by the model's attention scale as in the
paper's `A_Db = Q_sel K_sel^T / sqrt(D)`, softmaxed over the slots and summed over the group
(post-softmax pooling: the paper does not say how the group's heads combine; this is the mass the
group would put on each token under the approximation, as for the oracle and SparQ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.hook.gqa import grouped_queries
from atskv.kernels.partial_scores import partial_scores
from atskv.kernels.sparq_decode import pooled_probs
from atskv.selectors.base import LayerView, Selector
from atskv.selectors.buffers import with_room


@dataclass
class _CompactKeys:
    dims: torch.Tensor  # [B, Hkv, D_b] long, ascending
    keys: torch.Tensor  # [B, Hkv, room, D_b]: column i holds key dimension dims[..., i]
    slots: int  # slots copied so far
    refreshed_at: int  # tokens the layer had seen when `dims` were chosen


@dataclass
class SparCasSelector(Selector):
    name = "sparcas"
    query_aware = True
    dims: int = 16
    refresh_every: int = 64

    def prefill(self, view: LayerView) -> None:
        self._refresh(view)

    def scores(self, view: LayerView):
        state = view.layer.state.get(self.name)
        if state is None or view.layer.seen - state.refreshed_at >= self.refresh_every:
            state = self._refresh(view)
        else:
            self._extend(state, view.keys)
        dims = state.dims.repeat_interleave(view.group_size, dim=1).unsqueeze(2)  # [B, Hq, 1, D_b]
        logits = partial_scores(view.query, state.keys[:, :, : state.slots], dims, compact=True)
        return pooled_probs(logits * view.scaling, view.valid)

    def _refresh(self, view: LayerView) -> _CompactKeys:
        """New dimensions from the newest query's |q| summed over each group; compact keys rebuilt."""
        keys = view.keys
        importance = grouped_queries(view.query[:, :, -1:], keys.shape[1]).abs().float().sum(dim=(2, 3))
        dims = importance.topk(min(self.dims, keys.shape[-1]), dim=-1).indices.sort(dim=-1).values
        empty = keys.new_empty(*keys.shape[:2], 0, dims.shape[-1])
        state = view.layer.state[self.name] = _CompactKeys(dims, empty, 0, view.layer.seen)
        self._extend(state, keys)
        return state

    @staticmethod
    def _extend(state: _CompactKeys, keys: torch.Tensor) -> None:
        """Copy the chosen dimensions of the slots added since the last call."""
        slots = keys.shape[2]
        if slots <= state.slots:
            return
        new = keys[:, :, state.slots :]
        state.keys = with_room(state.keys, slots)
        state.keys[:, :, state.slots : slots] = new.gather(-1, state.dims.unsqueeze(2).expand(*new.shape[:3], -1))
        state.slots = slots
