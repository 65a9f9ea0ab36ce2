"""Biased attention: per-token bias tensors added to the attention logits of the queries after a
decision time t, so that gradients can be taken through them (influence labels,
`atskv.predictor.labels`) or tokens dropped exactly (the policy rollouts, `atskv.rl.rollout`),
where each query may read back its best dropped tokens, as a two-tier store's host tier does.
The hook's fused paths give neither, so the biased layers attend eagerly through a session of
their own, attached by the hook's one attention registration (`atskv.runtime.reference.sparse.attach`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from atskv.attention import group_matmul, grouped_probs, grouped_queries
from atskv.runtime.reference.sparse import ATTENTION_NAME, attach

DROPPED = torch.finfo(torch.float32).min  # the bias that drops a token: the mask's own fill value, probability 0


def allowed(attention_mask: torch.Tensor | None, tq: int, s: int, device) -> torch.Tensor:
    """Where the last `tq` queries may attend among `s` keys, `[B or 1, Tq, S]` bool, from the mask
    the hook's attention registration hands a session (None: plain causal)."""
    if attention_mask is None:
        return torch.ones(tq, s, dtype=torch.bool, device=device).tril(s - tq).unsqueeze(0)
    mask = attention_mask[:, 0, :, :s]
    return mask if mask.dtype == torch.bool else mask == 0  # additive float mask: 0 where allowed


class BiasSession:
    """Layer l adds every `(t, bias [B, Hkv, t+1])` of `biases[l]` to the logits of its queries
    after t on tokens i <= t (all query heads of KV head h); other layers run SDPA. The caller's
    cache (none, or a plain `DynamicCache` the forward continues) is used as it is. `retrieve`:
    each query reads back the `retrieve` tokens it rates highest (q·k, max over the group's query
    heads) among those a bias drops (`DROPPED`), per KV head: what a host tier fetches for it."""

    attention_name = ATTENTION_NAME
    needs_hidden = False

    def __init__(self, biases: dict[int, list[tuple[int, torch.Tensor]]], retrieve: int = 0):
        if retrieve < 0:
            raise ValueError(f"retrieve must be >= 0 tokens, got {retrieve}")
        self.biases, self.retrieve = biases, retrieve

    def handles(self, layer_idx: int) -> bool:
        return layer_idx in self.biases

    def bind(self, cache):
        return cache

    def attend(self, module, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
        """Eager grouped attention with the layer's biases; queries are the last Tq positions.
        Returns `[B, Tq, Hq, D]`."""
        b, s = key.shape[0], key.shape[2]
        tq = query.shape[2]
        mask = allowed(attention_mask, tq, s, query.device)
        queries = torch.arange(s - tq, s, device=query.device)
        bias = sum(
            F.pad(g, (0, s - t - 1))[:, :, None, :] * (queries > t).to(g.dtype)[:, None]
            for t, g in self.biases[module.layer_idx]
        )  # [B, Hkv, Tq, S]
        if self.retrieve and isinstance(bias, torch.Tensor):
            bias = self._read_back(query, key, mask.view(-1, 1, tq, s), bias)
        probs = grouped_probs(query, key, mask.view(-1, 1, tq, s), scaling, bias=bias)
        out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))
        return out.view(b, -1, tq, value.shape[-1]).transpose(1, 2)

    def _read_back(self, query, key, mask, bias) -> torch.Tensor:
        """`bias` with each query's `retrieve` best dropped tokens let through (bias 0)."""
        dropped = (bias == DROPPED) & mask  # [B, Hkv, Tq, S]
        rating = group_matmul(grouped_queries(query, key.shape[1]), key.transpose(-1, -2)).float().amax(2)
        best = rating.masked_fill(~dropped, -torch.inf).topk(min(self.retrieve, key.shape[2]), dim=-1)
        back = torch.zeros_like(dropped).scatter_(-1, best.indices, best.values > -torch.inf)
        return bias.masked_fill(back, 0.0)


@contextlib.contextmanager
def attention_biases(
    model, biases: dict[int, list[tuple[int, torch.Tensor]]], retrieve: int = 0
) -> Iterator[BiasSession]:
    """Inside the block `model` attends through a `BiasSession` of `biases` (and `retrieve`):
    full-sequence forwards, or a forward continuing a plain `DynamicCache`."""
    with attach(model, BiasSession(biases, retrieve)) as session:
        yield session
