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

On the fast path (`atskv.generate`) the compact keys are a slot tensor over the whole static
buffer (so they follow the prompt's tokens when the padding is dropped) updated in place by
`static_write`: the new token's dimensions go to its slot, and every U-th step (a step variant,
decided from host counts alone) chooses new dimensions and rebuilds the copy. The step's pick is
SparQ's fused kernels with these channels fixed (`atskv.kernels.sparq_decode`, `channels=`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.attention import grouped_queries
from atskv.kernels.partial_scores import partial_scores
from atskv.kernels.sparq_decode import pooled_probs, sparq_decode
from atskv.selectors.base import LayerView, Selector, budget_tokens
from atskv.selectors.buffers import with_room
from atskv.slot_cache import slot_index


@dataclass
class _CompactKeys:
    dims: torch.Tensor  # [B, Hkv, D_b] long, ascending
    keys: torch.Tensor  # [B, Hkv, room, D_b]: column i holds key dimension dims[..., i] (fast path: a slot tensor)
    slots: int  # slots copied so far
    refreshed_at: int  # tokens the layer had seen when `dims` were chosen
    prompt_end: int = 0  # tokens it had seen at the prefill: the fast path counts its steps from there


@dataclass
class SparCasSelector(Selector):
    name = "sparcas"
    fast_path = True
    # not a composition's part on the fast path: the reference's composition makes SparCas choose
    # new dimensions after each eviction
    fast_path_as_part = False
    query_aware = True
    dims: int = 16
    refresh_every: int = 64

    def prefill(self, view: LayerView) -> None:
        state = self._refresh(view)
        state.prompt_end = view.layer.seen
        if view.layer.static:  # the fast path (module docstring)
            compact = view.layer.slot_tensor(self.name, dtype=state.keys.dtype, width=state.keys.shape[-1])
            state.keys = compact.copy_(state.keys)
            view.layer.reset_by_selector.add(self.name)  # `static_write` writes a decode token's entry

    def scores(self, view: LayerView):
        state = view.layer.state.get(self.name)
        if not view.fixed_shapes:  # on the fast path `static_write` keeps the copy up to date
            if state is None or view.layer.seen - state.refreshed_at >= self.refresh_every:
                state = self._refresh(view)
            else:
                self._extend(state, view.keys)
        dims = state.dims.repeat_interleave(view.group_size, dim=1).unsqueeze(2)  # [B, Hq, 1, D_b]
        logits = partial_scores(view.query, state.keys[:, :, : state.slots], dims, compact=True)
        return pooled_probs(logits * view.scaling, view.valid)

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """On the fast path SparQ's fused step with the channels fixed (`sparq_decode(channels=)`,
        over the compact copy read channel-major through its strides: the torch scores and top-k,
        launch after launch a layer, cost more than the whole fused step); elsewhere the default ranking of `scores`."""
        state = view.layer.state.get(self.name)
        if not view.fixed_shapes or state is None:
            return super().decode_indices(view)
        k = min(budget_tokens(view), view.keys.shape[2])
        return sparq_decode(view.query[:, :, -1], view.keys, state.keys.transpose(2, 3), view.slot_pos,
                            view.layer.write_slot, view.context[:, 0, -1], view.scaling, state.dims.shape[-1],
                            view.budget, k, channels=state.dims)  # fmt: skip

    def decode_variant(self, layer) -> bool:
        """Whether the next decode step refreshes the dimensions: every `refresh_every` tokens after
        the prompt, `scores`' rule (one token a step), from host counts."""
        return (layer.seen - layer.state[self.name].prompt_end) % self.refresh_every == 0

    def static_write(self, view: LayerView) -> None:
        """Fast path: the decode token just written at `write_slot` enters the compact copy, or on
        a refresh step new dimensions come from its query and the copy is rebuilt; in place."""
        layer = view.layer
        if not layer.decoding:  # a prompt chunk: `prefill` builds the state after the last one
            return
        state = layer.state[self.name]
        state.keys = layer.slot_tensor(self.name)  # where the prompt's end left it
        if self.decode_variant(layer):
            state.dims.copy_(self._choose_dims(view.query, layer.keys.shape[1]))
            state.keys.copy_(_compact(layer.keys, state.dims))
            return
        slot = layer.write_slot.unsqueeze(-1)  # [B, Hkv, 1]
        new = _compact(layer.keys.gather(2, slot_index(slot, layer.keys)), state.dims)
        state.keys.scatter_(2, slot_index(slot, state.keys), new)

    def _refresh(self, view: LayerView) -> _CompactKeys:
        """New dimensions from the newest query's |q| summed over each group; compact keys rebuilt."""
        keys = view.keys
        dims = self._choose_dims(view.query, keys.shape[1])
        empty = keys.new_empty(*keys.shape[:2], 0, dims.shape[-1])
        state = view.layer.state[self.name] = _CompactKeys(dims, empty, 0, view.layer.seen)
        self._extend(state, keys)
        return state

    def _choose_dims(self, query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """`[B, Hkv, D_b]`: the dimensions of highest |q| of the newest query, summed over each group."""
        importance = grouped_queries(query[:, :, -1:], num_kv_heads).abs().float().sum(dim=(2, 3))
        return importance.topk(min(self.dims, query.shape[-1]), dim=-1).indices.sort(dim=-1).values

    @staticmethod
    def _extend(state: _CompactKeys, keys: torch.Tensor) -> None:
        """Copy the chosen dimensions of the slots added since the last call."""
        slots = keys.shape[2]
        if slots <= state.slots:
            return
        state.keys = with_room(state.keys, slots)
        state.keys[:, :, state.slots : slots] = _compact(keys[:, :, state.slots :], state.dims)
        state.slots = slots


def _compact(keys: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`keys` `[B, Hkv, n, D]` on `dims` `[B, Hkv, D_b]`: `[B, Hkv, n, D_b]`."""
    return keys.gather(-1, dims.unsqueeze(2).expand(*keys.shape[:3], -1))
