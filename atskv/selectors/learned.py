"""The learned retention policy: an exported relevance scorer (`RelevanceMLP`, or another kind
of `atskv.predictor.export.SCORERS`) decides which tokens each managed layer and KV head keeps
under the budget (query-agnostic and evicting, like H2O and SnapKV).

Scores are not recomputed for every token at every step. A token's fixed features (its projected
hidden state, hidden-state norm and token type) are computed once, when it enters the cache, and
kept in slot tensors; all scores are refreshed from the current features every `refresh_every`
steps and at the end of the prompt. Between refreshes a newly written token scores +inf, so the
last few tokens are always kept (a short recent window of at most `refresh_every` tokens).

The features are the collection's (`atskv.predictor.features`), computed from run-time state:
`attention` from an H2O-style accumulator of the attention each token received (summed over the
group's heads, divided by the group size and by the queries that could see it; after eviction the
accumulated attention is that of the sparse run, not of the dense one the labels came from),
`prev_attention` from the previous managed layer's accumulator matched by position, the rest
from positions, keys and the stored hidden-state norms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atskv.errors import InputError
from atskv.memory.slot_cache import slot_index
from atskv.predictor.export import LoadedPredictor, load_predictor
from atskv.predictor.features import SCALAR_FEATURES, feature_columns
from atskv.selectors.base import LayerView, Selector, check_view_fits

_PROJECTED, _HIDDEN_NORM, _TYPE, _RECEIVED, _SCORE = (
    "learned_projected",
    "learned_hidden_norm",
    "learned_type",
    "learned_received",
    "learned_score",
)
# the projected hidden state is as wide per token and KV head as a head's K+V in bf16 (64 floats):
# kept in bfloat16 it costs half of that, not as much GPU memory as the KV it serves
_PROJECTED_DTYPE = torch.bfloat16
logger = logging.getLogger("atskv")


@dataclass
class LearnedSelector(Selector):
    name = "learned"
    evicts = True
    needs_attention = True
    needs_hidden = True
    predictor: str | Path | LoadedPredictor | None = None
    refresh_every: int = 16
    # Keep only tokens whose logit exceeds this (0: the predictor's own decision, p > 1/2), the
    # budget then being a cap: how much each layer, KV head and context keeps follows the
    # predictor's calibration, which is what policy-gradient fine-tuning learns (docs/results.md).
    # None: fill the budget, the same amount in every layer and KV head.
    threshold: float | None = None
    _previous: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.predictor is None:
            raise InputError("the learned selector needs an exported predictor: LearnedSelector(predictor=PATH)")
        if not isinstance(self.predictor, LoadedPredictor):
            path = self.predictor
            self.predictor = load_predictor(path)
            header = self.predictor.header
            logger.info(
                "learned selector: predictor %s, base model %r (config %s), trained on %s",
                path, header.base_model, header.config_hash or "not recorded", _training_data(header.training),
            )
        if tuple(self.predictor.header.feature_spec.scalar_features) != SCALAR_FEATURES:
            raise ValueError(
                f"the predictor reads features {self.predictor.header.feature_spec.scalar_features}, "
                f"this version of atskv computes {SCALAR_FEATURES}"
            )
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        self._layer_index = {layer: i for i, layer in enumerate(self.predictor.header.managed_layers)}

    # --- the selector protocol ---------------------------------------------------------------
    def prefill(self, view: LayerView) -> None:
        self._check(view)
        self._enter(view)
        self._refresh(view)
        view.layer.state[self.name]["prompt_end"] = view.layer.seen

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        view.layer.slot_tensor(_RECEIVED).add_(attention_mass)

    def unwanted(self, view: LayerView) -> torch.Tensor | None:
        if self.threshold is None:
            return None
        return view.layer.slot_tensor(_SCORE, init=torch.inf) <= self.threshold  # new tokens wait at +inf

    def scores(self, view: LayerView) -> torch.Tensor:
        if view.longest is None:  # the fast path enters new tokens in `static_write`
            self._enter(view)
        state = view.layer.state.setdefault(self.name, {"refreshed_at": view.layer.seen})
        if view.layer.seen - state["refreshed_at"] >= self.refresh_every:
            self._refresh(view)
        return view.layer.slot_tensor(_SCORE, init=torch.inf).unsqueeze(2)

    def decode_variant(self, layer) -> bool:
        """Whether the next decode step refreshes the scores: every `refresh_every` tokens after
        the prompt, the same rule as `scores`, counted from the prompt's end."""
        return (layer.seen - layer.state[self.name]["prompt_end"]) % self.refresh_every == 0

    def static_write(self, view: LayerView) -> None:
        """Fast path: a prompt chunk's tokens enter as on the reference path; a decode token's
        fixed features go to the slot it was written to, by scatter (no host sync)."""
        layer = view.layer
        if not layer.decoding:
            self._check(view)  # before the first features: the predictor moves to the model's device
            self._enter(view)
            return
        mlp, slot = self.predictor.mlp, layer.write_slot.unsqueeze(-1)  # [B, Hkv, 1]
        b, h, _ = slot.shape
        hidden = view.hidden[:, -1]  # [B, d_model]
        with torch.no_grad():
            projected = mlp.project_hidden(hidden).to(_PROJECTED_DTYPE)  # [B, width]
        store = _projected(layer, mlp.projected_width)
        store.scatter_(2, slot_index(slot, store), projected.view(b, 1, 1, -1).expand(b, h, 1, -1))
        norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
        layer.slot_tensor(_HIDDEN_NORM).scatter_(2, slot, norm.view(b, 1, 1).expand(b, h, 1))
        kind = self.predictor.token_types[view.token_ids[:, -1]].float().view(b, 1, 1).expand(b, h, 1)
        layer.slot_tensor(_TYPE, init=-1.0).scatter_(2, slot, kind)

    def check_model(self, model) -> None:
        """Refuse a base model other than the predictor's (`PredictorHeader.check_model`)."""
        self.predictor.header.check_model(model)

    def _check(self, view: LayerView) -> None:
        header = self.predictor.header
        made_for = f"the predictor trained for {header.base_model!r}"
        check_view_fits(view, header.geometry, header.managed_layers, made_for, "export one for this model")
        if self.predictor.mlp.device != view.keys.device:  # loaded on the CPU, run beside the model
            self.predictor.mlp.to(view.keys.device)
            self.predictor.token_types = self.predictor.token_types.to(view.keys.device)

    # --- features ------------------------------------------------------------------------------
    def features(self, view: LayerView) -> torch.Tensor:
        """`[B, Hkv, S, F]` scalar features of every slot, in `SCALAR_FEATURES` order."""
        layer = view.layer
        # positions within each row's own text: left padding shifts a row's slots, not its features
        padding = (_seen(view) - view.context[:, 0, -1]).view(-1, 1, 1)
        pos = (view.slot_pos - padding).clamp(min=0).float()
        newest = (view.context[:, 0, -1] - 1).float().view(-1, 1, 1)
        seen_by = (newest - pos + 1).clamp(min=1)  # queries that could attend to the token so far
        attention = layer.slot_tensor(_RECEIVED) / view.group_size / seen_by
        previous = self._previous_attention(view)
        self._previous = (view.layer_idx, self._head_mean_by_position(view, attention))
        return feature_columns(
            attention, pos, newest, layer.slot_tensor(_HIDDEN_NORM), view.keys.float().norm(dim=-1), previous
        )

    def _previous_attention(self, view: LayerView) -> torch.Tensor:
        """The previous managed layer's mean attention per token, read at this layer's slots."""
        index = self._layer_index.get(view.layer_idx)
        if self._previous is None or index in (None, 0) or self._previous[0] >= view.layer_idx:
            return torch.zeros(view.slot_pos.shape, device=view.keys.device)
        by_position = self._previous[1]  # [B, seen]
        if by_position.shape[-1] != _positions(view):
            return torch.zeros(view.slot_pos.shape, device=view.keys.device)
        b, h, s = view.slot_pos.shape
        mean = by_position.gather(-1, view.slot_pos.clamp(min=0).reshape(b, h * s)).view(b, h, s)
        return mean.masked_fill(view.slot_pos < 0, 0.0)

    @staticmethod
    def _head_mean_by_position(view: LayerView, per_slot: torch.Tensor) -> torch.Tensor:
        """Per-slot values `[B, Hkv, S]` averaged over the KV heads that hold each token, laid out
        by position `[B, seen]` (each head has its own slot layout once it has evicted)."""
        b, h, _ = per_slot.shape
        seen = _positions(view)
        pos = view.slot_pos.masked_fill(view.slot_pos < 0, seen)  # free slots land in a spare column
        total = torch.zeros(b, h, seen + 1, device=per_slot.device).scatter_(-1, pos, per_slot.float())
        held = torch.zeros(b, h, seen + 1, device=per_slot.device).scatter_(-1, pos, torch.ones_like(per_slot))
        return (total.sum(1) / held.sum(1).clamp(min=1))[:, :seen]

    # --- state ---------------------------------------------------------------------------------
    def _enter(self, view: LayerView) -> None:
        """Store the fixed features of the tokens written in this step (projected hidden state,
        its norm, token type); their score stays +inf until the next refresh."""
        layer, mlp = view.layer, self.predictor.mlp
        width = mlp.projected_width
        kind = layer.slot_tensor(_TYPE, init=-1.0)
        fresh = (kind < 0) & (view.slot_pos >= 0)
        if view.hidden is None or not bool(fresh.any()):
            return
        tq = view.hidden.shape[1]
        offset = (view.slot_pos - (layer.seen - tq)).clamp(min=0, max=tq - 1)  # [B, Hkv, S]: row of view.hidden
        b, h, s = offset.shape
        rows = fresh.nonzero(as_tuple=True)
        hidden = view.hidden[rows[0], offset[rows]]  # [n, d_model]
        with torch.no_grad():
            _projected(layer, width)[rows] = mlp.project_hidden(hidden).to(_PROJECTED_DTYPE)
        layer.slot_tensor(_HIDDEN_NORM)[rows] = hidden.float().norm(dim=-1)
        ids = view.token_ids[rows[0], offset[rows]] if view.token_ids is not None else None
        types = self.predictor.token_types.to(view.keys.device)
        other = float(len(self.predictor.header.feature_spec.token_types) - 1)  # no ids: inputs_embeds
        kind[rows] = types[ids].float() if ids is not None else other

    def _refresh(self, view: LayerView) -> None:
        """Recompute every held token's score from its current features: the MLP runs on every
        slot (free ones masked to -inf after), so the shapes are fixed and nothing is read back."""
        layer, mlp = view.layer, self.predictor.mlp
        scalars = self.features(view)
        b, h, s = view.slot_pos.shape
        heads = torch.arange(h, device=scalars.device).view(1, h, 1).expand(b, h, s)
        with torch.no_grad():
            logits = mlp.score(
                _projected(layer, mlp.projected_width).reshape(b * h * s, -1).to(mlp.dtype),
                scalars.reshape(b * h * s, -1),
                layer.slot_tensor(_TYPE, init=-1.0).reshape(-1).clamp(min=0).long(),
                torch.full((b * h * s,), self._layer_index[view.layer_idx], device=scalars.device),
                heads.reshape(-1),
            )
        score = layer.slot_tensor(_SCORE, init=torch.inf)
        score.copy_(logits.float().view(b, h, s).masked_fill(view.slot_pos < 0, -torch.inf))
        layer.state.setdefault(self.name, {})["refreshed_at"] = layer.seen


def _training_data(training: dict) -> str:
    """What a header's provenance says the predictor was trained on, for the load log: the corpus
    (fine-tuning) or shard folder (supervised fitting), and for fine-tuning what it started from."""
    data = training.get("data", {})
    said = data.get("corpus") or data.get("folder")
    started = training.get("started_from")
    if started:
        before = _training_data(started.get("training", {}))
        return f"{said or 'data not recorded'}, fine-tuned from a predictor trained on {before}"
    return str(said) if said else "data not recorded"


def _projected(layer, width: int) -> torch.Tensor:
    """The per-slot projected hidden states `[B, Hkv, S, width]`, stored in `_PROJECTED_DTYPE`."""
    return layer.slot_tensor(_PROJECTED, dtype=_PROJECTED_DTYPE, width=width)


def _seen(view: LayerView):
    """Tokens written so far, the current one included: the host count on the reference path, the
    cache's device counter on the fast path (a captured graph must not bake a Python number in)."""
    return view.layer.position if view.longest is not None else view.layer.seen


def _positions(view: LayerView) -> int:
    """Width of the by-position buffers: the tokens seen, or on the fast path the longest context
    of the call (fixed shapes; positions not yet written stay zero)."""
    return view.longest if view.longest is not None else view.layer.seen
