"""Kascade (Deshmukh et al., 2025, "Kascade: A Practical Sparse Attention Method for Long-Context LLM
Inference", arXiv:2512.16391): exact top-k in a few anchor layers, reused by the layers between.

In an anchor layer a token's score is its exact attention probability summed over the query
heads of the KV group after the softmax (the paper's post-softmax GQA pooling); the hook keeps
the top-budget. A reuse layer takes the scores of the nearest preceding anchor *of the same
forward step*, with each of its KV heads reading the anchor KV head the profile maps it to, and
matched by logical position (`slot_pos`), so it keeps exactly the anchor's tokens. Anchors and
head map come from a per-model `KascadeProfile` (profile.py); the first layers the hook
keeps dense stand for the paper's dense layer 0, and the profile must be computed with the same
`dense_layers`. Budget: the paper uses 10% of the context with at least 128 tokens. Choice made
here: a sparse prefill pools per query like decode (the paper's 128-query prefill tiles are a
kernel device).

On the fast path's decode (`atskv.generate`) every appending layer holds each token in the same
slot (the prompt packed alike, one write slot per layer advanced alike), so a reuse layer reads
its anchor's scores by slot: no tensor that grows with the context, so the step can be captured.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atskv.attention import grouped_probs
from atskv.selectors.base import LayerView, Selector, check_view_fits
from atskv.selectors.kascade.profile import HOW_TO_COMPUTE, KascadeProfile, default_profile_path

_STATE = "kascade_topk"  # anchor layer state: (layer.seen when scored, scores by slot or by logical position)


@dataclass
class KascadeSelector(Selector):
    name = "kascade"
    fast_path = True
    fast_path_as_part = False
    per_model = "profile"
    query_aware = True
    profile: KascadeProfile | str | Path | None = None
    # anchor layer index -> its cache layer, for the forward step under way only
    _anchor_layers: dict[int, weakref.ref] = field(default_factory=dict, init=False, repr=False, compare=False)
    _last_layer: int = field(default=-1, init=False, repr=False, compare=False)
    # (reuse layer, device) -> its head map as an index tensor, made once (not inside a captured step)
    _heads: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                                 compare=False)  # fmt: skip

    def __post_init__(self):
        if self.profile is None:
            raise ValueError(f"the kascade selector needs a per-model profile: {HOW_TO_COMPUTE}")
        if not isinstance(self.profile, KascadeProfile):
            self.profile = KascadeProfile.load(self.profile)
        self._anchor_set = frozenset(self.profile.anchors)

    @classmethod
    def for_model(cls, model_name: str) -> Path:
        """Where `atskv profile kascade` saves the model's profile by default."""
        return default_profile_path(model_name)

    def scores(self, view: LayerView):
        self._check(view)
        if view.layer_idx <= self._last_layer:  # layers come in order: a new forward step began
            self._anchor_layers.clear()
        self._last_layer = view.layer_idx
        if view.layer_idx in self._anchor_set:
            return self._anchor_scores(view)
        anchor = self.profile.anchor_of(view.layer_idx)
        ref = self._anchor_layers.get(anchor)
        anchor_layer = ref() if ref is not None else None
        seen, by_position = anchor_layer.state.get(_STATE, (None, None)) if anchor_layer is not None else (None, None)
        if seen is None or seen != view.layer.seen or anchor_layer.seen != seen:
            raise RuntimeError(
                f"kascade: reuse layer {view.layer_idx} found no top-k of its anchor layer {anchor} from this "
                f"forward step; the hook must manage the profile's layers {self.profile.managed_layers} "
                f"(dense_layers={self.profile.managed_layers[0]} for a model without sliding-window layers)"
            )
        key = (view.layer_idx, by_position.device)
        if key not in self._heads:
            self._heads[key] = torch.tensor(self.profile.head_map[view.layer_idx], device=by_position.device)
        mapped = by_position.index_select(1, self._heads[key])  # [B, Hkv, Tq, seen] (by slot: S)
        if _slots_align(view.layer):
            return mapped
        b, h, s = view.slot_pos.shape
        idx = view.slot_pos.clamp(min=0).unsqueeze(2).expand(b, h, mapped.shape[2], s)
        return mapped.gather(-1, idx)

    def _anchor_scores(self, view: LayerView) -> torch.Tensor:
        """Pooled probabilities `[B, Hkv, Tq, S]`; also kept by logical position for the reuse layers."""
        pooled = grouped_probs(view.query, view.keys, view.valid, view.scaling).sum(dim=2)
        self._anchor_layers[view.layer_idx] = weakref.ref(view.layer)
        b, h, tq, s = pooled.shape
        seen = view.layer.seen
        if _slots_align(view.layer):
            view.layer.state[_STATE] = (seen, pooled)
            return pooled
        by_position = pooled.new_full((b, h, tq, seen + 1), -torch.inf)  # last column: free slots
        pos = view.slot_pos.masked_fill(view.slot_pos < 0, seen).unsqueeze(2).expand(b, h, tq, s)
        by_position.scatter_(-1, pos, pooled)
        view.layer.state[_STATE] = (seen, by_position[..., :seen])
        return pooled

    def _check(self, view: LayerView) -> None:
        made_for = f"the kascade profile of {self.profile.model!r}"
        check_view_fits(view, self.profile.geometry, self.profile.managed_layers, made_for, HOW_TO_COMPUTE)


def _slots_align(layer) -> bool:
    """A decoding layer of the fast path's static cache that appends: its slots hold the same
    tokens as every other such layer's (see the module docstring)."""
    return layer.static and layer.decoding and layer.window is None
