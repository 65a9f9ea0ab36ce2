"""SparK (Liao et al., 2025, "SparK: Query-Aware Unstructured Sparsity with Recoverable KV Cache
Channel Pruning", arXiv:2508.15212): query-aware unstructured pruning of key channels, with recovery.

After a dense (prefill) step, every held token keeps its T = floor((1 - prune_ratio) * D) key
channels of highest saliency `w[t, j] = a[j] * |k[t, j]|`, where `a[j]` is the magnitude of
query channel j over the observation window (the last `window` queries, as in SnapKV); the other
channels are pruned, and only their mean saliency `mu[t]` is kept. At attention, a pruned entry
is recovered as `sign(k[t, j]) * mu[t] / a[j]` (the paper's degenerate recovery, its default), so
it contributes the typical pruned saliency instead of zero. Tokens written after the last dense
step keep all channels. Token choice is delegated to any other selector (`base`, default SnapKV,
the pairing the paper reports most); tokens are scored on the recovered keys.
Paper defaults: keys only, degenerate recovery, pruning ratios 0.5 and 0.8 (0.5 here), window 32.
Choices made where the paper leaves one: `a[j]` is the root mean square of query channel j over
the window and over the KV group's query heads (a signed mean could cancel to ~0, and recovery
divides by it; the scale of `a` cancels out of both the ranking and the recovery); the recovered
entry keeps the sign of the pruned one (as the authors' code does; the paper's Eq. 8 gives only
its magnitude).

The reference path keeps the full keys and recovers at every read (a later dense step prunes
again from them). The fast path (`atskv.generate`) writes the recovered keys into its cache after
the prompt instead: its kernels read the cache, it prunes only once, and every later read of a
prompt token on the reference path (attention, the base's scores) is of the recovered key too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from atskv.attention import grouped_queries
from atskv.selectors.base import LayerView, Selector
from atskv.selectors.snapkv import SnapKVSelector

_THRESHOLD = "spark_threshold"  # per slot: saliency of its T-th channel (-inf: nothing pruned)
_MEAN = "spark_pruned_mean"  # per slot: mean saliency of its pruned channels
_QUERY_SCALE = "spark_query_scale"  # layer state: a[j] `[B, Hkv, D]` of the last dense step


@dataclass
class SparKSelector(Selector):
    """`base`: the token selector (an instance; `make_selector("spark", base="h2o", base_options=...)`
    builds it by name). SparK takes over how the hook must treat it (query-aware, evicting, what
    it needs: attention mass, hidden states) and passes every call through, on the recovered keys."""

    name = "spark"
    fast_path = True
    # not a composition's part on the fast path: it attends the cached keys, not SparK's recovered ones
    fast_path_as_part = False
    base: Selector = field(default_factory=SnapKVSelector)
    prune_ratio: float = 0.5
    window: int = 32

    def __post_init__(self):
        if not 0.0 <= self.prune_ratio < 1.0:
            raise ValueError(f"prune_ratio must lie in [0, 1), got {self.prune_ratio}")
        if not isinstance(self.base, Selector) or isinstance(self.base, SparKSelector):
            raise ValueError(f"spark needs another selector as its base, got {self.base!r}")
        for flag in ("query_aware", "evicts", "keeps_all", "needs_attention", "needs_hidden", "prompt_sample"):
            setattr(self, flag, getattr(self.base, flag))

    def has_fast_path(self) -> bool:
        """Its base's; not over a base that keeps every token: on the reference path every step is
        then a dense one, which prunes every token again."""
        return not self.keeps_all and self.base.has_fast_path()

    def check_model(self, model) -> None:
        self.base.check_model(model)

    def kept_channels(self, head_dim: int) -> int:
        """T: key channels each pruned token keeps."""
        return math.floor((1.0 - self.prune_ratio) * head_dim + 1e-9)

    def key_channel_fraction(self, head_dim: int) -> float:
        """Share of key channels stored for a pruned token (tokens after the prompt keep all), for
        memory accounting; each pruned token also stores one float (`mu`) and, to recover, the
        signs of its pruned entries."""
        return self.kept_channels(head_dim) / head_dim

    def prefill(self, view: LayerView) -> None:
        self.base.prefill(view)
        d = view.keys.shape[-1]
        kept = self.kept_channels(d)
        if kept == d:
            return
        w = min(self.window, view.query.shape[2])
        q = grouped_queries(view.query[:, :, -w:], view.keys.shape[1]).float()  # [B, Hkv, G, w, D]
        scale = q.square().mean(dim=(2, 3)).sqrt()
        # recovery divides by it: a channel the window never uses would recover to ~inf
        scale = scale.maximum(1e-4 * scale.amax(dim=-1, keepdim=True))
        saliency = self._saliency(view.keys, scale)
        top = saliency.topk(kept, dim=-1).values  # [B, Hkv, S, T]
        threshold = top[..., -1].masked_fill(view.slot_pos < 0, -torch.inf)
        pruned_mean = (saliency.sum(-1) - top.sum(-1)) / (d - kept)
        if view.layer.static:  # the fast path: into the cache (module docstring)
            view.keys.copy_(self._recovered(view.keys, scale, threshold, pruned_mean))
            return
        view.layer.state[_QUERY_SCALE] = scale
        view.layer.slot_tensor(_THRESHOLD, init=-torch.inf).copy_(threshold)
        view.layer.slot_tensor(_MEAN).copy_(pruned_mean)

    def attention_keys(self, view: LayerView) -> torch.Tensor:
        """The keys attention must use, `[B, Hkv, S, D]`: pruned entries replaced by their recovery."""
        scale = view.layer.state.get(_QUERY_SCALE)
        if scale is None:
            return view.keys
        threshold = view.layer.slot_tensor(_THRESHOLD, init=-torch.inf)
        return self._recovered(view.keys, scale, threshold, view.layer.slot_tensor(_MEAN))

    def scores(self, view: LayerView):
        return self.base.scores(self._on_recovered_keys(view))

    def decode_indices(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.decode_indices(self._on_recovered_keys(view))

    def unwanted(self, view: LayerView) -> torch.Tensor | None:
        return self.base.unwanted(self._on_recovered_keys(view))

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        self.base.observe(view, attention_mass)

    def static_write(self, view: LayerView) -> None:
        self.base.static_write(view)

    def decode_variant(self, layer) -> object:
        return self.base.decode_variant(layer)

    def mass_accumulator(self, view: LayerView) -> torch.Tensor | None:
        return self.base.mass_accumulator(view)

    def eviction_scores(self, view: LayerView) -> tuple[torch.Tensor, float]:
        return self.base.eviction_scores(self._on_recovered_keys(view))

    def _on_recovered_keys(self, view: LayerView) -> LayerView:
        return replace(view, keys=self.attention_keys(view))

    @classmethod
    def _recovered(cls, keys: torch.Tensor, scale: torch.Tensor, threshold: torch.Tensor, pruned_mean: torch.Tensor):
        """`keys` with each entry of saliency below its slot's `threshold` (`[B, Hkv, S]`) replaced
        by `sign * pruned_mean / scale`."""
        pruned = cls._saliency(keys, scale) < threshold.unsqueeze(-1)
        magnitude = pruned_mean.unsqueeze(-1) / scale.unsqueeze(2)
        recovered = torch.where(keys < 0, -magnitude, magnitude).to(keys.dtype)
        return torch.where(pruned, recovered, keys)

    @staticmethod
    def _saliency(keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`w[b, h, s, j] = a[b, h, j] * |k[b, h, s, j]|` in float32."""
        return keys.float().abs() * scale.unsqueeze(2)
