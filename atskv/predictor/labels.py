"""Labels of the collected rows, per window, decision time t, managed layer and KV head:
the attention mass the next W queries give each token 0..t, membership in its top-k, and (with
`influence`) the gradient of the future loss with respect to an additive bias on the token's
attention logits.

A collection's `label` (`LABELS`) says which score ranks the tokens: `mass` (the future attention
above) or `kvzip` (reconstruction scores from a repeat-the-context pass, `atskv.predictor.kvzip`,
kept in a `kvzip` column beside the mass). It picks the top-k members, hence the sampled rows, and
training learns to order tokens by it (`atskv.predictor.shards.label_column`).

- `LabelCapture` computes mass and top-k inside the capture (`atskv.predictor.capture`) and
  keeps only sampled rows: all top-k members and as many uniformly drawn non-members, so shards
  stay small and classes balanced. With `full` it keeps every token 0..t instead and marks the
  ones the sample would have kept (`sampled`; the same draws, so those rows are the sampled ones):
  the whole-window recall of `atskv fit` (`val/window_recall`) is measured on such groups.
- `influence_gradients` runs the window through biased attention (`atskv.predictor.attention_bias`)
  with zero bias tensors `[B, Hkv, t+1]` on the logits of queries after t; one forward and one
  backward per decision time read their gradients. The loss is the mean NLL of the predictions
  made by queries t+1..t+W (tokens t+2..t+W+1), the queries the mass label averages; token t+1
  is predicted at position t, which the bias does not reach (its gradient would be zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from atskv.models import model_geometry
from atskv.predictor.attention_bias import attention_biases
from atskv.predictor.capture import FeatureCapture
from atskv.predictor.features import future_mass, topk_members
from atskv.selectors.base import LayerView

LABELS = ("mass", "kvzip")


@dataclass
class LabelCapture(FeatureCapture):
    """The collection's capture: at every (t, KV head) it keeps the labels and features of the
    sampled rows only, or with `full` of every token 0..t, with a `sampled` mask saying which of
    them the sample holds. `kvzip`: reconstruction scores `[1, Hkv, t+1]` by (t, layer index);
    when given, they pick the top-k members instead of the future mass."""

    future_queries: int = 1
    topk: int = 1
    generator: torch.Generator | None = None
    full: bool = False
    kvzip: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)

    def record(self, view: LayerView, t: int, probs: torch.Tensor, scalars: torch.Tensor) -> None:
        mass = future_mass(probs, t, self.future_queries)
        kvzip = self.kvzip.get((t, view.layer_idx))
        members = topk_members(mass if kvzip is None else kvzip, self.topk)
        for h in range(mass.shape[1]):
            rows = self._sample(members[0, h])  # drawn for full groups too: the generator's stream stays the same
            sampled = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
            if self.full:
                every = torch.arange(t + 1, device=rows.device)
                rows, sampled = every, torch.isin(every, rows)
            labels = {"mass": mass[0, h, rows], "in_topk": members[0, h, rows]}
            if kvzip is not None:
                labels["kvzip"] = kvzip[0, h, rows]
            self.groups.append(
                {
                    "layer_idx": view.layer_idx,
                    "t": t,
                    "head": h,
                    "position": rows,
                    "sampled": sampled,
                    "hidden": view.hidden[0, rows].to(torch.float16),
                    "scalars": scalars[0, h, rows],
                    **labels,
                }
            )

    def _sample(self, members: torch.Tensor) -> torch.Tensor:
        """Positions of all members plus as many uniformly drawn non-members (all if fewer), sorted."""
        positive = members.nonzero().flatten()
        negative = (~members).nonzero().flatten()
        order = torch.randperm(negative.numel(), generator=self.generator)[: positive.numel()]
        return torch.cat([positive, negative[order.to(negative.device)]]).sort().values


def influence_gradients(
    model, ids: torch.Tensor, layers: Sequence[int], times: Sequence[int], future_queries: int
) -> dict[tuple[int, int], torch.Tensor]:
    """`{(t, layer): d loss_t / d bias}` `[1, Hkv, t+1]` for ids `[1, span]` and every decision time
    t in `times`, where loss_t is the mean NLL of the predictions of queries t+1..t+W (W =
    `future_queries`). One forward; one backward per decision time."""
    hkv = model_geometry(model.config).num_kv_heads
    biases = {
        (t, layer): torch.zeros(1, hkv, t + 1, device=ids.device, requires_grad=True) for t in times for layer in layers
    }
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in params:  # no parameter gradients: saves the activations only they would need
            p.requires_grad_(False)
        with attention_biases(model, {layer: [(t, biases[t, layer]) for t in times] for layer in layers}):
            with torch.enable_grad():
                logits = model(ids[:, :-1], use_cache=False).logits[0].float()
                nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")  # nll[p]: token p+1 predicted at p
                grads = {}
                for n, t in enumerate(times):
                    wanted = [biases[t, layer] for layer in layers]
                    loss = nll[t + 1 : t + 1 + future_queries].mean()
                    for layer, g in zip(layers, torch.autograd.grad(loss, wanted, retain_graph=n < len(times) - 1)):
                        grads[t, layer] = g
    finally:
        for p in params:
            p.requires_grad_(True)
    return grads
