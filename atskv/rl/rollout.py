"""Rollouts: the predictor's logits for one context, and K sampled retentions run through the
real base model to score its continuation.

For an item (context 0..T-1, continuation T..T+C-1) the decision is taken at t = T - 1, as the
learned selector takes it at the end of a prompt after a dense prefill:
1. `context_features`: the features of every context token for every managed layer and KV head,
   from one dense forward through the hook (`atskv.predictor.capture.decision_features`), no
   gradients; `predictor_logits` turns them into logits `[L, Hkv, T]` (with gradients).
2. The policy samples K keep-masks `[K, L, Hkv, T]` (`atskv.rl.policy`).
3. `rollout`: the context is run once, densely, into a `DynamicCache`, which is repeated K times;
   then ONE batched forward of the continuation, K rows, continues it with the biased attention
   of the collection (`attention_biases`): in the managed layers the dropped context tokens get
   a bias of float32's lowest value (probability exactly 0) on the continuation's queries. The
   first `dense_layers` layers and the layers the model restricts itself (sliding windows) stay as
   they are. Running the context once instead of K times gives the same numbers: the masks only
   change what queries after t see. With `retrieve` r, each continuation query also reads back
   the r dropped tokens it rates highest, per layer and KV head: the retention judged as a
   two-tier store's GPU tier, whose parked tokens the host tier fetches per query.

Scores (choices):
- NLL: mean over the continuation tokens T+1..T+C-1, those predicted by the queries the
  retention affects. Token T is predicted at position t, by the dense prefill, the same in
  every sample (as at inference, where the prompt's last position is computed before eviction),
  so it is left out of the NLL, as in the collection's influence label.
- Exact-match (task prompts): all C answer tokens are the argmax under teacher forcing (the
  first from the dense position t). Equal to greedy decoding of the answer's C tokens, since
  with every earlier token right the teacher-forced inputs are the greedy ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atskv.models import model_geometry
from atskv.models.cache_names import returned_cache, with_cache
from atskv.predictor.attention_bias import DROPPED, attention_biases
from atskv.predictor.capture import decision_features
from atskv.predictor.model import RelevanceMLP
from atskv.rl.items import RolloutItem


def retrieved_tokens(retrieve: int | float, context: int) -> int:
    """Tokens a query reads back: `retrieve` tokens (int) or that fraction of the context (float)."""
    if isinstance(retrieve, bool) or not isinstance(retrieve, int | float) or retrieve < 0:
        raise ValueError(f"retrieve must be tokens (int >= 0) or a fraction of the context (float), got {retrieve!r}")
    return retrieve if isinstance(retrieve, int) else math.ceil(retrieve * context)


@dataclass(frozen=True)
class ContextFeatures:
    """Features of the tokens 0..T-1 of one context at decision time T-1, per managed layer."""

    hidden: torch.Tensor  # [L, T, d_model]: attention inputs
    scalars: torch.Tensor  # [L, Hkv, T, F] in SCALAR_FEATURES order
    token_types: torch.Tensor  # [T] long


def context_features(
    model, context_ids: torch.Tensor, layers: Sequence[int], type_table: torch.Tensor
) -> ContextFeatures:
    """Features of every context token (`context_ids` `[T]`) in the managed `layers` (the
    predictor's, a contiguous run of the model's global layers from `layers[0]` on)."""
    device = next(model.parameters()).device
    ids = context_ids.to(device).view(1, -1)
    found = decision_features(model, ids, ids.shape[1] - 1, dense_layers=layers[0])
    if sorted(found) != list(layers):
        raise ValueError(
            f"the hook manages layers {sorted(found)} from layer {layers[0]} on; the predictor {list(layers)}"
        )
    hidden = torch.stack([found[layer][0] for layer in layers])
    scalars = torch.stack([found[layer][1] for layer in layers])
    return ContextFeatures(hidden, scalars, type_table.to(device)[ids[0]].long())


def predictor_logits(mlp: RelevanceMLP, features: ContextFeatures) -> torch.Tensor:
    """Logits `[L, Hkv, T]` of every token, managed layer and KV head (differentiable in `mlp`)."""
    n_layers, hkv, t, n_features = features.scalars.shape
    projected = mlp.project_hidden(features.hidden.reshape(n_layers * t, -1))
    projected = projected.view(n_layers, 1, t, -1).expand(n_layers, hkv, t, -1).reshape(n_layers * hkv * t, -1)
    grid = torch.meshgrid(
        torch.arange(n_layers, device=projected.device), torch.arange(hkv, device=projected.device),
        torch.arange(t, device=projected.device), indexing="ij",
    )
    layer, head, position = (g.flatten() for g in grid)
    logits = mlp.score(
        projected, features.scalars.reshape(-1, n_features), features.token_types[position], layer, head
    )
    return logits.view(n_layers, hkv, t)


@dataclass(frozen=True)
class RolloutResult:
    nll: torch.Tensor  # [K] mean NLL of continuation tokens T+1..T+C-1
    exact: torch.Tensor  # [K] bool: every continuation token is the argmax


def continuation_scores(first: torch.Tensor, rest: torch.Tensor, continuation: torch.Tensor) -> RolloutResult:
    """Scores from the logits `first` `[V]` at t (predicting continuation[0]) and `rest`
    `[K, C-1, V]` at T..T+C-2 (predicting continuation[1:])."""
    target = continuation[1:].to(rest.device).expand(rest.shape[0], -1)
    nll = F.cross_entropy(rest.float().transpose(1, 2), target, reduction="none").mean(1)
    exact = (rest.argmax(-1) == target).all(1) & (first.argmax(-1) == continuation[0].to(first.device))
    return RolloutResult(nll, exact)


@torch.no_grad()
def rollout(model, item: RolloutItem, keep: torch.Tensor, layers: Sequence[int], retrieve: int = 0) -> RolloutResult:
    """Score `item`'s continuation under K retentions `keep` `[K, L, Hkv, T]` of its context in
    the managed `layers` (each query reading back `retrieve` dropped tokens): one dense pass of
    the context, one batched pass of the continuation."""
    hkv = model_geometry(model.config).num_kv_heads
    t, k = item.context, keep.shape[0]
    if keep.shape[1:] != (len(layers), hkv, t):
        raise ValueError(f"keep masks have shape {tuple(keep.shape)}, expected (K, {len(layers)}, {hkv}, {t})")
    device = next(model.parameters()).device
    ids = item.ids.to(device)
    out = model(ids[None, :t], use_cache=True, logits_to_keep=1)
    cache = returned_cache(out)
    cache.batch_repeat_interleave(k)
    keep = keep.to(device)
    biases = {
        layer: [(t - 1, torch.zeros(keep.shape[0], hkv, t, device=device).masked_fill(~keep[:, i], DROPPED))]
        for i, layer in enumerate(layers)
    }
    with attention_biases(model, biases, retrieve):
        rest = model(ids[None, t:-1].expand(k, -1), **with_cache(model, cache)).logits
    return continuation_scores(out.logits[0, -1], rest, ids[t:])
