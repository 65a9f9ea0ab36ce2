"""The learned retention policy: an exported relevance scorer (`RelevanceMLP`, or another kind
of `atskv.predictor.export.SCORERS`) decides which tokens each managed layer and KV head keeps
under the budget (query-agnostic and evicting, like H2O and SnapKV).

Scores are not recomputed for every token at every step. A token's fixed features (its projected
hidden state, hidden-state norm and token type) are computed once, when it enters the cache, and
kept in a slot tensor; all scores are refreshed from the current features every `refresh_every`
steps and at the end of the prompt (the fast path's decode steps do both with the kernels of
`atskv.kernels.learned_features` for a float32 MLP). Between refreshes a newly written token scores +inf, so the
last few tokens are always kept (a short recent window of at most `refresh_every` tokens).
`refresh_every` 0 scores the prompt once, at its end, as the vLLM plugin does by default: every
generated token is then kept and the prompt's tokens leave in their scores' order.

The features are the collection's (`atskv.predictor.features`), computed from run-time state:
`attention` from an H2O-style accumulator of the attention each token received (summed over the
group's heads, divided by the group size and by the queries that could see it; after eviction the
accumulated attention is that of the sparse run, not of the dense one the labels came from),
`prev_attention` from the previous managed layer's accumulator matched by position, the rest
from positions, keys and the stored hidden-state norms.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atskv.attention import check_prompt_sample
from atskv.errors import InputError
from atskv.features import SCALAR_FEATURES
from atskv.kernels.learned_features import (
    attention_by_position,
    refresh_scores,
    scatter_token_features,
    score_slots,
    slot_scalars,
    write_token_features,
)
from atskv.learned_options import check_refresh_every, check_window_share
from atskv.predictor.export import LoadedPredictor, find_predictor, load_predictor
from atskv.predictor.model import RelevanceMLP
from atskv.selectors.base import LayerView, Selector, budget_tokens, check_view_fits
from atskv.selectors.snapkv import check_window, window_votes

# Per-slot state in three slot tensors, not five: the reference cache resets every slot tensor of a
# slot it writes, one kernel per tensor (on the fast path the features kernel of `static_write`
# does it instead). `_STATE` (float32, 0 when a token enters) holds what depends on the token
# alone: the projected hidden state as bfloat16 pairs, the hidden-state norm and 1 + the token
# type (0: not entered yet); a `token_tensor`, held once per token while a static cache's prompt
# is (the prompt's whole length in every managed layer: a copy per KV head was about half of
# what the selector held above SnapKV, docs/results.md). `_RECEIVED` (float32) is the attention
# each slot received; `_SCORE` waits at +inf.
_STATE, _RECEIVED, _SCORE = "learned_state", "learned_received", "learned_score"
# the default stays 0 until the figures measured at it are rerun (NOTES.md); the leaderboard's best
WINDOW_SHARE_HINT = ("; window_share 0: the predictor alone (best measured: window_share 0.5, "
                     "--selector_options '{learned: {window_share: 0.5}}')")
_PINNED = "learned_pinned"  # bool: kept whatever the predictor says (`window_share`)
# the projected hidden state is as wide per token and KV head as a head's K+V in bf16 (64 floats):
# kept in bfloat16 it costs half of that, not as much GPU memory as the KV it serves
_PROJECTED_DTYPE = torch.bfloat16
logger = logging.getLogger("atskv")


@dataclass(frozen=True)
class _Slots:
    """Views `[B, Hkv, S(, width)]` of one layer's `_STATE` and `_RECEIVED`."""

    projected: torch.Tensor
    hidden_norm: torch.Tensor
    kind: torch.Tensor
    received: torch.Tensor


@dataclass
class LearnedSelector(Selector):
    name = "learned"
    fast_path = True
    per_model = "predictor"
    evicts = True
    needs_attention = True
    needs_hidden = True
    predictor: str | Path | LoadedPredictor | None = None
    refresh_every: int = 16  # 0: never after the prompt's end
    # Keep only tokens whose logit exceeds this (0: the predictor's own decision, p > 1/2), the
    # budget then being a cap: how much each layer, KV head and context keeps follows the
    # predictor's calibration, which is what policy-gradient fine-tuning learns (docs/results.md).
    # None: fill the budget, the same amount in every layer and KV head.
    threshold: float | None = None
    # Share of the budget kept for the prompt tokens its last `window` queries attend most (SnapKV's
    # vote, `window_votes`): the predictor scores a token from one pass in which the question at
    # the prompt's end is one query among thousands, so the passage it asks about can be evicted
    # (QA on the leaderboard). Those tokens are pinned (a slot flag that moves with the token): they
    # score +inf at every refresh.
    window_share: float = 0.0
    window: int = 32
    prompt_sample: int = 1  # the prompt's attention received from every s-th query of a chunk (`sampled_queries`)
    # the last managed layer refreshed and its `attention_by_position`, for the next one
    _previous: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.predictor is None:
            raise InputError("the learned selector needs an exported predictor: LearnedSelector(predictor=PATH)")
        if not isinstance(self.predictor, LoadedPredictor):
            path = self.predictor
            self.predictor = load_predictor(path)
            header = self.predictor.header
            logger.info(
                "learned selector: predictor %s, base model %r (config %s), trained on %s%s",
                path, header.base_model, header.config_hash or "not recorded", _training_data(header.training),
                "" if self.window_share else WINDOW_SHARE_HINT,
            )
        if tuple(self.predictor.header.feature_spec.scalar_features) != SCALAR_FEATURES:
            raise ValueError(
                f"the predictor reads features {self.predictor.header.feature_spec.scalar_features}, "
                f"this version of atskv computes {SCALAR_FEATURES}"
            )
        check_refresh_every(self.refresh_every)
        check_window_share(self.window_share)
        check_window(self.window)
        check_prompt_sample(self.prompt_sample)
        self._layer_index = {layer: i for i, layer in enumerate(self.predictor.header.managed_layers)}

    # --- the selector protocol ---------------------------------------------------------------
    def prefill(self, view: LayerView) -> None:
        self._check(view)
        self._enter(view)
        if self.window_share > 0:
            self._pin_window_pick(view)
        self._refresh(view)
        view.layer.state[self.name]["prompt_end"] = view.layer.seen

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        self.mass_accumulator(view).add_(attention_mass)

    def mass_accumulator(self, view: LayerView) -> torch.Tensor:
        return self._slots(view.layer).received

    def unwanted(self, view: LayerView) -> torch.Tensor | None:
        """Slots `[B, Hkv, S]` scored at or below `threshold` (new tokens wait at +inf). On the fast
        path None between refreshes: every held token was wanted when the last step evicted, and
        only a refresh rewrites a held token's score (so only refresh steps, their own graph, pay
        for the mask)."""
        if self.threshold is None:
            return None
        if view.fixed_shapes and view.layer.state[self.name]["refreshed_at"] != view.layer.seen:
            return None
        return view.layer.slot_tensor(_SCORE, init=torch.inf) <= self.threshold

    def scores(self, view: LayerView) -> torch.Tensor:
        if not view.fixed_shapes:  # the fast path enters new tokens in `static_write`
            self._enter(view)
        state = view.layer.state.setdefault(self.name, {"refreshed_at": view.layer.seen})
        if self.refresh_every and view.layer.seen - state["refreshed_at"] >= self.refresh_every:
            self._refresh(view)
        return view.layer.slot_tensor(_SCORE, init=torch.inf).unsqueeze(2)

    def decode_variant(self, layer) -> bool:
        """Whether the next decode step refreshes the scores: every `refresh_every` tokens after
        the prompt, the same rule as `scores`, counted from the prompt's end (never with 0)."""
        steps = layer.seen - layer.state[self.name]["prompt_end"]
        return bool(self.refresh_every) and steps % self.refresh_every == 0

    def static_write(self, view: LayerView) -> None:
        """Fast path: a prompt chunk's tokens enter by slice (`_enter_chunk`); a decode token's
        fixed features go to the slot it was written to, whose received attention and score
        restart there too rather than in the cache's write (one kernel for a float32 MLP; no
        host sync)."""
        layer, mlp = view.layer, self.predictor.mlp
        if not layer.decoding:
            self._check(view)  # before the first features: the predictor moves to the model's device
            self._enter_chunk(view)
            layer.reset_by_selector.update((_STATE, _RECEIVED, _SCORE))  # the decode writes below restart them
            return
        slots, hidden, ids = self._slots(layer), view.hidden[:, -1], view.token_ids[:, -1]
        state = (layer.write_slot, slots.projected, slots.hidden_norm, slots.kind, slots.received,
                 layer.slot_tensor(_SCORE, init=torch.inf))  # fmt: skip
        if _fused(mlp):
            write_token_features(mlp.project.weight, mlp.project.bias, hidden, self.predictor.token_types, ids, *state)
            return
        with torch.no_grad():
            projected = mlp.project_hidden(hidden)
        norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
        scatter_token_features(projected, norm, self.predictor.token_types[ids].float() + 1, *state)

    @classmethod
    def for_model(cls, model_name: str) -> Path:
        """The predictor folder for a model (`find_predictor`: the user's export, else the one that
        ships), or an `InputError` saying how to get one."""
        folder = find_predictor(model_name)
        if not (folder / "predictor.safetensors").is_file():
            raise InputError(
                f"no predictor for {model_name!r}: none ships with atskv and none was exported to {folder}; "
                "run `atskv collect`, `atskv fit` and `atskv export` for this model, "
                "or pass LearnedSelector(predictor=PATH)"
            )
        return folder

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
        slots = self._slots(view.layer)
        scalars = slot_scalars(slots.received, slots.hidden_norm, view.keys, view.slot_pos, view.context[:, 0, -1],
                               _seen(view), view.group_size, self._previous_sums(view))  # fmt: skip
        self._previous = (view.layer_idx, attention_by_position(scalars[..., 0], view.slot_pos, _positions(view)))
        return scalars

    def _previous_sums(self, view: LayerView) -> torch.Tensor | None:
        """The previous managed layer's `attention_by_position` when it is this step's (None in the
        first managed layer: `prev_attention` is 0 there)."""
        index = self._layer_index.get(view.layer_idx)
        if self._previous is None or index in (None, 0) or self._previous[0] >= view.layer_idx:
            return None
        sums = self._previous[1]
        return sums if sums.shape[-1] == _positions(view) + 1 else None

    def _slots(self, layer, shared: bool = False) -> _Slots:
        """The views `[B, Hkv, S(, width)]` of `layer`'s state (created on first use, zeros), the
        token's part broadcast over the KV heads where the layer holds it once per token;
        `shared`: that part as held (`[B, 1, S]` then), to write."""
        width = self.predictor.mlp.projected_width
        pairs = (width + 1) // 2
        state = layer.token_tensor(_STATE, width=pairs + 2)
        heads = state.shape[1] if shared else layer.slot_pos.shape[1]
        parts = state[..., :pairs].view(_PROJECTED_DTYPE)[..., :width], state[..., pairs], state[..., pairs + 1]
        projected, norm, kind = (t.expand(t.shape[0], heads, *t.shape[2:]) for t in parts)
        return _Slots(projected, norm, kind, layer.slot_tensor(_RECEIVED))

    # --- state ---------------------------------------------------------------------------------
    def _enter(self, view: LayerView) -> None:
        """Store the fixed features of the tokens written in this step (projected hidden state,
        its norm, token type) in the slots that hold them; their score stays +inf until the next
        refresh."""
        slots = self._slots(view.layer, shared=True)
        slot_pos = view.slot_pos[:, : slots.kind.shape[1]]  # the heads hold the same tokens where shared
        fresh = (slots.kind == 0) & (slot_pos >= 0)
        if view.hidden is None or not bool(fresh.any()):
            return
        tq = view.hidden.shape[1]
        offset = (slot_pos - (view.layer.seen - tq)).clamp(min=0, max=tq - 1)  # [B, h, S]: row of view.hidden
        rows = fresh.nonzero(as_tuple=True)
        tokens = (rows[0], offset[rows])  # each fresh slot's batch row and chunk position
        for slot, feature in zip((slots.projected, slots.hidden_norm, slots.kind), self._token_features(view)):
            slot[rows] = feature[tokens]

    def _enter_chunk(self, view: LayerView) -> None:
        """`_enter` for the fast path's prompt chunk, whose tokens are the last ones appended, in
        the same slots of every KV head: written by slice, with no search for the fresh slots (and
        none of its host syncs)."""
        slots, stop, tq = self._slots(view.layer, shared=True), view.layer.filled, view.hidden.shape[1]
        for slot, feature in zip((slots.projected, slots.hidden_norm, slots.kind), self._token_features(view)):
            slot[:, :, stop - tq : stop] = feature.unsqueeze(1)

    def _token_features(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[B, Tq(, width)]` for the tokens of `view.hidden`: the projected hidden state, its norm
        and 1 + the token type, once per token (gathering the hidden states per slot first held
        Hkv float32 copies of a prompt chunk at once, gigabytes at the 8B shape)."""
        batch, tq = view.hidden.shape[:2]
        with torch.no_grad():
            projected = self.predictor.mlp.project_hidden(view.hidden.flatten(0, 1)).view(batch, tq, -1)
        norm = torch.linalg.vector_norm(view.hidden, dim=-1, dtype=torch.float32)
        if view.token_ids is not None:
            kind = self.predictor.token_types.to(view.keys.device)[view.token_ids].float() + 1
        else:  # inputs_embeds: the last type, "other"
            kind = norm.new_full((batch, tq), float(len(self.predictor.header.feature_spec.token_types)))
        return projected.to(_PROJECTED_DTYPE), norm, kind

    def _refresh(self, view: LayerView) -> None:
        """Recompute every held token's score from its current features. The fast path with a
        float32 MLP does it in one kernel (`refresh_scores`), its features read from the same
        state as `features` reads."""
        layer, mlp, slots = view.layer, self.predictor.mlp, self._slots(view.layer)
        score, index = layer.slot_tensor(_SCORE, init=torch.inf), self._layer_index[view.layer_idx]
        if view.fixed_shapes and _fused(mlp):
            previous = self._previous_sums(view)
            sums = torch.zeros(view.slot_pos.shape[0], 2, view.longest + 1, device=score.device)
            refresh_scores(mlp, index, slots.projected, slots.hidden_norm, slots.kind, slots.received, view.keys,
                           view.slot_pos, view.context[:, 0, -1], _seen(view), view.group_size, previous, sums,
                           score)  # fmt: skip
            self._previous = (view.layer_idx, sums)
        else:
            score_slots(mlp, index, self.features(view), slots.projected, slots.kind, view.slot_pos, score)
        if self.window_share > 0:
            score.masked_fill_(layer.slot_tensor(_PINNED, init=False, dtype=torch.bool), torch.inf)
        layer.state.setdefault(self.name, {})["refreshed_at"] = layer.seen

    def _pin_window_pick(self, view: LayerView) -> None:
        """Pin the `window_share` of the budget that the prompt's last queries attend most (the
        window itself first): a slot flag that moves with its token and clears when the slot
        takes a new one."""
        votes = window_votes(view, self.window).masked_fill(view.slot_pos < 0, -torch.inf)
        n = min(math.ceil(self.window_share * budget_tokens(view)), votes.shape[-1])
        top, slots = votes.topk(n, dim=-1)
        pinned = view.layer.slot_tensor(_PINNED, init=False, dtype=torch.bool)
        pinned.zero_().scatter_(-1, slots, top > -torch.inf)


def _fused(mlp) -> bool:
    """Whether the fast path's kernels compute this scorer: a float32 `RelevanceMLP` in eval mode.
    The ridge scorer has no kernel, and a bfloat16 MLP's torch steps round where the kernels,
    computing in float32, do not: the fast path must pick the reference path's tokens."""
    return isinstance(mlp, RelevanceMLP) and mlp.dtype == torch.float32 and not mlp.training


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


def _seen(view: LayerView):
    """Tokens written so far, the current one included: the host count on the reference path, the
    cache's device counter on the fast path (a captured graph must not bake a Python number in)."""
    return view.layer.position if view.fixed_shapes else view.layer.seen


def _positions(view: LayerView) -> int:
    """Width of the by-position buffers: the tokens seen, or on the fast path the longest context
    of the call (fixed shapes; positions not yet written stay zero)."""
    return view.longest if view.fixed_shapes else view.layer.seen
