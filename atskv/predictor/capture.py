"""Capture: one dense forward of a window through the hook, taking at chosen decision times
what the predictor reads in every managed layer (attention input, cache keys, the attention
pooled over each KV group), turned into features by `atskv.predictor.features`.

The capturing selector's `prefill` sees one managed layer at a time and builds that layer's
pooled probabilities `[B, Hkv, T, T]` in query chunks; `record` keeps what it needs and the rest
is dropped, so no two layers' T x T tensors are alive together. `decision_features` keeps every
token (the policy-gradient rollouts); the collection's labels subclass it (`atskv.predictor.labels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atskv.attention import grouped_probs
from atskv.predictor.features import attention_so_far, scalar_features
from atskv.selectors.base import LayerView, Selector


def managed_layers(model, dense_layers: int) -> list[int]:
    """The layers the hook manages with `dense_layers` (what the learned selector will score)."""
    from atskv.runtime.reference.sparse import SparseSession, SparsityConfig

    config = SparsityConfig(1, dense_layers)  # the budget plays no part in which layers are managed
    return sorted(SparseSession(model, FeatureCapture(), config).managed_layers)


@dataclass
class FeatureCapture(Selector):
    """Keeps everything (dense prefill); in each managed layer's `prefill` it computes the
    features of tokens 0..t at every decision time and hands them to `record`, which by default
    keeps all of them in `features[layer_idx][t]` = (hidden `[t+1, d_model]`, scalars
    `[Hkv, t+1, F]`)."""

    needs_hidden = True
    keeps_all = True
    decision_times: tuple[int, ...] = ()
    query_chunk: int = 512
    prev: dict[int, torch.Tensor] = field(default_factory=dict)  # t -> previous managed layer's attention
    features: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def prefill(self, view: LayerView) -> None:
        n, c = view.query.shape[2], self.query_chunk
        in_order = torch.arange(n, device=view.slot_pos.device)
        if view.query.shape[0] != 1 or not torch.equal(view.slot_pos[0, 0], in_order):
            raise RuntimeError("collection runs one window at a time on a fresh cache")
        chunks = [
            grouped_probs(view.query[:, :, s : s + c], view.keys, view.valid[:, :, s : s + c], view.scaling).mean(2)
            for s in range(0, n, c)
        ]
        probs = torch.cat(chunks, dim=2)  # [1, Hkv, T, T], pooled over the group; freed when this returns
        del chunks
        for t in self.decision_times:
            attention = attention_so_far(probs, t)
            scalars = scalar_features(attention, self.prev.get(t), view.hidden[:, : t + 1], view.keys[:, :, : t + 1], t)
            self.prev[t] = attention.mean(1)
            self.record(view, t, probs, scalars)

    def record(self, view: LayerView, t: int, probs: torch.Tensor, scalars: torch.Tensor) -> None:
        """Keep the features of every token 0..t (`probs` `[1, Hkv, T, T]`, `scalars` `[1, Hkv, t+1, F]`)."""
        self.features.setdefault(view.layer_idx, {})[t] = (view.hidden[0, : t + 1], scalars[0])


def decision_features(
    model, ids: torch.Tensor, t: int, dense_layers: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`{managed layer: (hidden [t+1, d_model], scalars [Hkv, t+1, F])}`: the features of every
    token 0..t at decision time t, from one dense forward of `ids[:, :t+1]` (`[1, >t]`) through
    the hook. No gradients (`no_grad`, not `inference_mode`: the results may feed a trained MLP)."""
    from atskv.runtime.reference.sparse import sparse

    capture = FeatureCapture((t,))
    with sparse(model, capture, budget=t + 1, dense_layers=dense_layers), torch.no_grad():  # every token
        model(ids[:, : t + 1])
    return {layer: by_time[t] for layer, by_time in capture.features.items()}
