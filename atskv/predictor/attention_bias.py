"""Biased attention: an attention function that adds per-token bias tensors to the attention
logits of the queries after a decision time t, so that gradients can be taken through them
(influence labels, `atskv.predictor.labels`) or tokens dropped exactly (the policy rollouts,
`atskv.rl.rollout`). The hook's fused paths give neither."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from atskv.hook.gqa import grouped_probs

BIASED_ATTENTION = "atskv_influence"
_BIAS_ATTR = "_atskv_influence_bias"


def biased_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The biased attention function (influence labels here, policy rollouts in `atskv.rl`):
    layers carrying bias tensors attend eagerly with `bias[b, h, i]` added to the logits of
    every query after t on token i <= t (all query heads of KV head h); other layers run SDPA.
    Full-sequence forwards, or forwards continuing a plain `DynamicCache` (queries are the last
    Tq positions)."""
    biases = getattr(module, _BIAS_ATTR, None)
    if biases is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the influence collection")
    b, s = key.shape[0], key.shape[2]
    tq = query.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is None:
        mask = torch.ones(tq, s, dtype=torch.bool, device=query.device).tril(s - tq)
    else:
        mask = attention_mask[:, 0, :, :s]
        mask = mask if mask.dtype == torch.bool else mask == 0  # additive float mask: 0 where allowed
    queries = torch.arange(s - tq, s, device=query.device)
    bias = sum(
        F.pad(g, (0, s - t - 1))[:, :, None, :] * (queries > t).to(g.dtype)[:, None] for t, g in biases
    )  # [B, Hkv, Tq, S]
    probs = grouped_probs(query, key, mask.view(-1, 1, tq, s), scaling, bias=bias)
    out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))
    return out.view(b, -1, tq, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(BIASED_ATTENTION, biased_attention_forward)
AttentionMaskInterface.register(BIASED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def attention_biases(model, biases: dict[int, list[tuple[int, torch.Tensor]]]) -> Iterator[None]:
    """Inside the block `model` attends through `biased_attention_forward`: layer l adds every
    `(t, bias [B, Hkv, t+1])` of `biases[l]` to the logits of its queries after t; the other
    layers run SDPA. Full-sequence forwards, or a forward continuing a plain `DynamicCache`."""
    from atskv.hook.sparse import attention_modules

    modules = [m for m in attention_modules(model) if m.layer_idx in biases]
    previous = model.config._attn_implementation
    model.set_attn_implementation(BIASED_ATTENTION)
    for m in modules:
        setattr(m, _BIAS_ATTR, biases[m.layer_idx])
    try:
        yield
    finally:
        for m in modules:
            delattr(m, _BIAS_ATTR)
        model.set_attn_implementation(previous)
