"""Reconstruction labels: how much the model needs each context token to repeat the context.

KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
NeurIPS 2025) scores a cached token by the attention it receives while the model, after an
instruction, re-reads the context it was given: a token that reconstructing the context needs is
one any later question may need, whatever the question. KVzip+ (kvpress's KVzap training script,
`kvpress/presses/kvzap/train.py`) weighs that attention by what the token adds to the layer's
output: for KV head g, context token i and the repeat pass's queries q and query heads h in g,

    score(g, i) = max over q, h of  a[h, q, i] * ||W_o^h v[g, i]|| / ||x_q||

with `a` the attention probability, `W_o^h` the output projection's block for query head h (its
columns h*D..(h+1)*D), `v` the value and `x_q` the attention input of query q. This is the
`kvzip` label of `atskv collect --label kvzip`; the features stay those of the plain causal pass at
the decision time t (the first t+1 tokens of the repeat pass are the context itself).

Choices where KVzip leaves one: the instruction is plain text (`REPEAT_PROMPT`), not a chat
template, as the collection's windows are plain text; the repeat is of tokens 0..t as they are
(no re-tokenisation), so repeated token i is the context's token i.
"""

from __future__ import annotations

import torch

from atskv.attention import grouped_probs, sdpa_attention
from atskv.predictor.attention_bias import allowed
from atskv.runtime.reference.sparse import ATTENTION_NAME, attach

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


def output_norms(values: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
    """`||W_o^h v[g, i]||` `[B, Hkv, G, N]` for values `[B, Hkv, N, D]` and the output projection's
    weight `[d_model, Hq * D]`: per query head, through the D x D Gram matrix of its block."""
    b, hkv, n, d = values.shape
    hq = o_weight.shape[1] // d
    block = o_weight.float().view(-1, hq, d)  # [d_model, Hq, D]
    gram = torch.einsum("mhd,mhe->hde", block, block).view(hkv, hq // hkv, d, d)
    v = values.float()
    return torch.einsum("bknd,kgde,bkne->bkgn", v, gram, v).clamp(min=0).sqrt()


def reconstruction_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    o_weight: torch.Tensor,
    hidden: torch.Tensor,
    context: int,
    query_chunk: int = 256,
) -> torch.Tensor:
    """KVzip+ scores `[B, Hkv, context]` of the first `context` slots (see the module docstring).

    `query` `[B, Hq, R, D]`: the repeat pass's queries; `keys`, `values` `[B, Hkv, S, D]`; `mask`
    `[B, 1, R, S]`: where each query may attend; `hidden` `[B, R, d_model]`: the queries' attention
    inputs. Queries are taken in chunks, so no `[R, S]` buffer per head is whole."""
    per_query = 1.0 / hidden.float().norm(dim=-1).clamp(min=1e-12)  # [B, R]
    best = None
    for s in range(0, query.shape[2], query_chunk):
        chunk = slice(s, s + query_chunk)
        probs = grouped_probs(query[:, :, chunk], keys, mask[:, :, chunk], scaling)  # [B, Hkv, G, c, S]
        weighted = (probs[..., :context] * per_query[:, None, None, chunk, None]).amax(dim=3)  # [B, Hkv, G, context]
        best = weighted if best is None else torch.maximum(best, weighted)
    return (best * output_norms(values[:, :, :context], o_weight)).amax(dim=2)


class RepeatSession:
    """Attends the managed layers causally through SDPA and keeps, per layer, the reconstruction
    scores of the first `context` tokens from the queries at `repeat_start` on."""

    attention_name = ATTENTION_NAME
    needs_hidden = True

    def __init__(self, layers: list[int], context: int, repeat_start: int):
        self.managed_layers = frozenset(layers)
        self.context, self.repeat_start = context, repeat_start
        self.hidden: dict[int, torch.Tensor] = {}
        self.token_ids = None
        self.scores: dict[int, torch.Tensor] = {}  # layer index -> [B, Hkv, context]

    def handles(self, layer_idx: int) -> bool:
        return layer_idx in self.managed_layers

    def bind(self, cache):
        return cache

    def attend(self, module, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
        tq, s = query.shape[2], key.shape[2]
        mask = allowed(attention_mask, tq, s, query.device).unsqueeze(1)  # [B or 1, 1, Tq, S]
        start = self.repeat_start - (s - tq)  # the repeat's first query among this call's
        self.scores[module.layer_idx] = reconstruction_scores(
            query[:, :, start:], key, value, mask[:, :, start:], scaling, module.o_proj.weight,
            self.hidden[module.layer_idx][:, start:], self.context,
        )
        return sdpa_attention(query, key, value, mask, scaling)


def repeat_scores(
    model, context: torch.Tensor, instruction: torch.Tensor, layers: list[int]
) -> dict[int, torch.Tensor]:
    """`{layer: [1, Hkv, n]}`: the reconstruction scores of the context ids `[n]` in `layers`, from
    one forward of context + instruction ids + context."""
    n = context.numel()
    ids = torch.cat([context, instruction.to(context.device), context]).view(1, -1)
    session = RepeatSession(layers, n, n + instruction.numel())
    with attach(model, session), torch.inference_mode():
        model(ids, use_cache=False)
    return session.scores
