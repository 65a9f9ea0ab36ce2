"""Grouped-query attention on un-expanded KV: queries are viewed as `[B, Hkv, G, Tq, D]` and
broadcast against keys `[B, Hkv, 1, S, D]`, so no `repeat_kv` copy of the cache is ever made.

This is the plain-torch reference path of the hook (any device); fused kernels are checked
against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atskv.errors import InputError, is_int


def grouped_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, Hq, Tq, D]` -> `[B, Hkv, G, Tq, D]` (a view: query head j belongs to KV head j // G)."""
    b, hq, tq, d = query.shape
    return query.view(b, num_kv_heads, hq // num_kv_heads, tq, d)


def group_matmul(grouped: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """`grouped` `[B, Hkv, G, T, X]` times each KV head's `shared` `[B, Hkv, X, Y]` -> `[B, Hkv, G, T, Y]`,
    with the group folded into the rows: a broadcast over G (`shared.unsqueeze(2)`) would make
    `matmul` copy `shared` G times, the whole KV on every call."""
    b, h, g, t, x = grouped.shape
    return torch.matmul(grouped.reshape(b, h, g * t, x), shared).view(b, h, g, t, -1)


def grouped_probs(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention probabilities `[B, Hkv, G, Tq, S]` in float32 over the slots where `mask`
    (`[B, Hkv, Tq, S]`) is True. A row with no allowed slot (a pad query; a query whose selector
    wants no token) gets zeros, not NaN nor an average over slots it may not see, as the sparse
    decode kernel and `StreamedAttention` give. `bias` (`[B, Hkv, Tq, S]`), if given, is added to
    the scaled logits of every query head of the group (the influence label's per-token gates)."""
    probs = _softmax_or_uniform(query, keys, mask, scaling, bias)
    return probs.masked_fill(~mask.any(-1, keepdim=True).unsqueeze(2), 0.0)


def _softmax_or_uniform(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`grouped_probs`, except that a row with no allowed slot comes out uniform over every slot
    (the caller zeroes what it derives from such a row: cheaper than zeroing the probabilities)."""
    q = grouped_queries(query, keys.shape[1])
    logits = group_matmul(q, keys.transpose(-1, -2)).float() * scaling
    if bias is not None:
        logits = logits + bias.unsqueeze(2)
    logits = logits.masked_fill(~mask.unsqueeze(2), torch.finfo(torch.float32).min)
    return torch.softmax(logits, dim=-1)


def grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    *,
    want_mass: bool = False,
    query_chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked attention of `query` `[B, Hq, Tq, D]` over `keys`/`values` `[B, Hkv, S, D]`.

    Returns the output in the layout transformers expects after attention, `[B, Tq, Hq, D]`, and,
    if asked, the attention mass each slot received `[B, Hkv, S]` (summed over the group's query
    heads and the queries). A query with no allowed slot gets zeros and gives no mass
    (`grouped_probs`). Queries are processed in chunks to bound the `[.., Tq, S]` buffers.
    """
    b, hq, tq, _ = query.shape
    hkv = keys.shape[1]
    out = query.new_empty(b, hkv, hq // hkv, tq, values.shape[-1])
    mass = torch.zeros(b, hkv, keys.shape[2], dtype=torch.float32, device=keys.device) if want_mass else None
    for start in range(0, tq, query_chunk):
        stop = min(start + query_chunk, tq)
        probs = _softmax_or_uniform(query[:, :, start:stop], keys, mask[:, :, start:stop], scaling)
        valid_rows = mask[:, :, start:stop].any(-1, keepdim=True).unsqueeze(2)  # [B, Hkv, 1, c, 1]
        out[:, :, :, start:stop] = group_matmul(probs.to(values.dtype), values).masked_fill(~valid_rows, 0)
        if mass is not None:
            mass += (probs * valid_rows).sum(dim=(2, 3))
    return out.view(b, hq, tq, -1).transpose(1, 2), mass


class StreamedAttention:
    """`grouped_attention` of `query` `[B, Hq, Tq, D]` over KV that arrives in blocks: each block
    (`add`) is folded into a running softmax (max, denominator, weighted sum, all float32) and can
    be freed before the next is read, so the tiered cache streams parked tokens from the host
    through a fixed amount of GPU memory. `log_normaliser` after the first block is what a
    retrieval needs to compare query heads by probability; `result` gives the output and every
    block's attention mass, normalised by the softmax over all blocks."""

    def __init__(self, query: torch.Tensor, scaling: float):
        self.query, self.scaling = query, scaling
        self.peak = self.denominator = self.acc = None
        self._logits: list[torch.Tensor] = []

    def add(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Fold in a block: keys/values `[B, Hkv, S_i, D]`, `mask` `[B, Hkv, Tq, S_i]`."""
        q = grouped_queries(self.query, keys.shape[1])
        logits = (group_matmul(q, keys.transpose(-1, -2)).float() * self.scaling).masked_fill(
            ~mask.unsqueeze(2), -torch.inf
        )
        block_peak = logits.amax(-1, keepdim=True)
        if self.peak is None:
            self.peak = block_peak
            self.denominator = torch.zeros_like(block_peak)
            self.acc = torch.zeros(*block_peak.shape[:-1], values.shape[-1], dtype=torch.float32, device=values.device)
        peak = torch.maximum(self.peak, block_peak)
        shift = _finite(peak)  # no allowed slot yet: nothing to rescale
        rescale, weights = torch.exp(self.peak - shift), torch.exp(logits - shift)
        self.denominator = self.denominator * rescale + weights.sum(-1, keepdim=True)
        self.acc = self.acc * rescale + group_matmul(weights, values.float())
        self.peak = peak
        self._logits.append(logits)

    def log_normaliser(self) -> torch.Tensor:
        """`[B, Hkv, G, Tq]` log-sum-exp of the logits seen so far, per query head (-inf: none)."""
        return (self.peak + self.denominator.log())[..., 0]

    def result(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The output `[B, Tq, Hq, D]` and each block's mass `[B, Hkv, S_i]` (summed over the
        group's query heads and the queries); a query with no allowed slot in any block gets zeros."""
        b, hq, tq, _ = self.query.shape
        shift, total = _finite(self.peak), torch.where(self.denominator > 0, self.denominator, 1.0)
        out = (self.acc / total).to(self.query.dtype).view(b, hq, tq, -1).transpose(1, 2)
        return out, [(torch.exp(logits - shift) / total).sum(dim=(2, 3)) for logits in self._logits]


def _finite(peak: torch.Tensor) -> torch.Tensor:
    return torch.where(peak == -torch.inf, 0.0, peak)


def sdpa_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The same function as `grouped_attention` (without the mass), through PyTorch's fused SDPA
    with `enable_gqa`, so the KV is still never expanded; only the boolean mask is broadcast to
    the query heads. A row with no allowed slot gets zeros (it attends everywhere inside SDPA,
    which some backends would turn into NaN otherwise, and its output is then zeroed)."""
    b, hq, tq, _ = query.shape
    valid_rows = mask.any(-1, keepdim=True)  # [B, 1 or Hkv, Tq, 1]
    mask = mask | ~valid_rows
    group = hq // keys.shape[1]
    uniform = mask.shape[1] == 1 or bool((mask == mask[:, :1]).all())
    mask = mask[:, :1] if uniform else mask.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=group > 1
    )
    out = out.reshape(b, valid_rows.shape[1], -1, tq, out.shape[-1]).masked_fill(~valid_rows.unsqueeze(2), 0)
    return out.reshape(b, hq, tq, -1).transpose(1, 2)


def attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with equal query and KV heads (`[B, H, Tq, D]`, `[B, H, S, D]`) that also returns
    each query's log-sum-exp `[B, H, Tq]` (float32), so that attention over several key blocks can
    be merged exactly (`merge_attention`). `causal` needs Tq == S. PyTorch's flash kernels (CUDA
    in bf16/fp16, and the CPU one) where they apply, plain torch otherwise."""
    ops = torch.ops.aten
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        out, lse = ops._scaled_dot_product_flash_attention(query, keys, values, 0.0, causal, scale=scaling)[:2]
        return out, lse
    if query.device.type == "cpu":
        return ops._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, causal, scale=scaling)
    logits = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling
    if causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), -torch.inf)
    lse = logits.logsumexp(-1)
    return torch.matmul(torch.exp(logits - lse.unsqueeze(-1)).to(values.dtype), values), lse


def merge_attention(
    first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results `(out [.., Tq, D], lse [.., Tq])` over disjoint key blocks -> the
    result over their union (the same log-sum-exp merge flash-decoding uses between splits)."""
    (out1, lse1), (out2, lse2) = first, second
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse).unsqueeze(-1), torch.exp(lse2 - lse).unsqueeze(-1)
    return (out1.float() * w1 + out2.float() * w2).to(out1.dtype), lse


def prefix_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk's attention: queries `[B, Hq, C, D]` are the last C of the S = prefix + C keys
    `[B, Hkv, S, D]` and see every prefix key and, causally, the chunk's own. Two flash calls
    merged by log-sum-exp, with no `[C, S]` mask: over the prefix the GQA group is folded into the
    query rows (`[B, Hkv, G*C, D]`, no KV copy), over the chunk the C new keys are repeated to the
    query heads (C rows, not the cache). Returns `[B, Hq, C, D]` and the log-sum-exp `[B, Hq, C]`."""
    b, hq, c, d = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    chunk_k = keys[:, :, prefix:].repeat_interleave(group, dim=1)
    chunk_v = values[:, :, prefix:].repeat_interleave(group, dim=1)
    result = attention_lse(query, chunk_k, chunk_v, scaling, causal=True)
    if prefix == 0:
        return result
    folded = query.reshape(b, hkv, group * c, d)
    out, lse = attention_lse(folded, keys[:, :, :prefix], values[:, :, :prefix], scaling)
    return merge_attention((out.reshape(b, hq, c, -1), lse.reshape(b, hq, c)), result)


def sampled_queries(count: int, sample: int) -> slice:
    """Every `sample`-th of a prompt chunk's `count` queries, counted back from its last: the
    queries whose attention, times `sample`, estimates what the chunk's tokens receive
    (`prompt_sample`, an option of the selectors that read the attention received). atskv's
    runtimes prefill in chunks whose ends lie a multiple of their size before the prompt's end, so
    with a `sample` that divides the chunk size they sample the same queries; vLLM's chunks need
    not end so, and the plugin then samples others."""
    return slice((count - 1) % sample, None, sample)


def check_prompt_sample(sample) -> None:
    """`prompt_sample`: an `InputError` unless an int >= 1. 1 (the default) scores the prompt with
    every query; s > 1 with every s-th (`sampled_queries`), a prefill that much closer to one
    without the mass pass (a learned predictor then reads a coarser "attention received" than it
    was fit on: measure it)."""
    if not is_int(sample) or sample < 1:
        raise InputError(f"atskv: prompt_sample is a stride over the prompt's queries, an int >= 1 (1: all); "
                         f"got {sample!r}")  # fmt: skip


def attention_and_mass(query, keys, values, mask, scaling: float, sample: int = 1):
    """`grouped_attention` and the mass each slot received; from a chunk of several queries that
    mass comes from every `sample`-th of them (`sampled_queries`) times `sample`."""
    if sample == 1 or query.shape[2] == 1:
        return grouped_attention(query, keys, values, mask, scaling, want_mass=True)
    rows = sampled_queries(query.shape[2], sample)
    out, _ = grouped_attention(query, keys, values, mask, scaling)
    _, mass = grouped_attention(query[:, :, rows], keys, values, mask[:, :, rows], scaling, want_mass=True)
    return out, mass * sample


def received_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    max_elements: int = 1 << 27,
) -> torch.Tensor:
    """Attention mass each slot receives from `query` `[B, Hq, Tq, D]`, summed over the group's heads
    and the queries, `[B, Hkv, S]`, given each query's log-sum-exp over everything it sees (`lse`
    `[B, Hq, Tq]`) and which slots each query may see (`allowed(start, stop)` -> `[B, 1 or Hkv,
    stop - start, S]`). Queries are taken in blocks so no `[Tq, S]` float buffer is larger than
    `max_elements`: what H2O's accumulator needs from a long prompt without its attention matrix."""
    b, hq, tq, _ = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    mass = torch.zeros(b, hkv, s, dtype=torch.float32, device=keys.device)
    step = max(1, max_elements // max(1, b * hq * s))
    k = keys.transpose(-1, -2)
    lse = lse.masked_fill(lse == -torch.inf, torch.inf)  # a query that sees nothing gives nothing
    for start in range(0, tq, step):
        stop = min(start + step, tq)
        q = grouped_queries(query[:, :, start:stop], hkv)
        logits = group_matmul(q, k).float() * scaling
        probs = torch.exp(logits - lse[:, :, start:stop].view(b, hkv, -1, stop - start, 1))
        mass += torch.where(allowed(start, stop).unsqueeze(2), probs, 0.0).sum(dim=(2, 3))
    return mass


def masked_attention(query, keys, values, allowed: Callable[[int, int], torch.Tensor], scaling: float,
                     span: Callable[[int, int], slice] | None = None,
                     max_elements: int = 1 << 27) -> torch.Tensor:  # fmt: skip
    """`masked_attention_lse`'s output alone, through fused SDPA (`sdpa_attention`), for the layers
    whose received mass no selector reads (a sliding-window layer, a padded batch's unmanaged
    layers): no float32 `[n, S]` logits in torch (Gemma 3 270M, 2 x 4096 tokens on the CPU:
    its 15 sliding-window layers took 77% of the prefill that way)."""
    b, hq, tq, _ = query.shape
    out = query.new_empty(b, hq, tq, values.shape[-1])
    for start, stop, cols in _query_blocks(tq, b * hq * keys.shape[2], span, max_elements):
        out[:, :, start:stop] = sdpa_attention(query[:, :, start:stop], keys[:, :, cols], values[:, :, cols],
                                               allowed(start, stop)[..., cols], scaling).transpose(1, 2)  # fmt: skip
    return out


def masked_attention_lse(query, keys, values, allowed: Callable[[int, int], torch.Tensor], scaling: float,
                         span: Callable[[int, int], slice] | None = None, max_elements: int = 1 << 27):  # fmt: skip
    """Attention of `query` `[B, Hq, Tq, D]` over `keys` `[B, Hkv, S, D]` where `allowed(start, stop)`
    (`[B, 1, n, S]`) permits, a block of queries at a time (sliding windows, padded batches).
    `span(start, stop)`: the slots a block can be allowed at all, the only ones read (a causal
    prefix, a sliding window; none: every slot). Returns `[B, Hq, Tq, D]` and the log-sum-exp
    `[B, Hq, Tq]`; a query with nothing allowed gets zeros."""
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    out = query.new_empty(b, hq, tq, values.shape[-1])
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=query.device)
    k = keys.transpose(-1, -2)
    for start, stop, cols in _query_blocks(tq, b * hq * keys.shape[2], span, max_elements):
        q = query[:, :, start:stop].reshape(b, hkv, hq // hkv, stop - start, d)
        logits = group_matmul(q, k[..., cols]).float() * scaling
        logits = logits.masked_fill(~allowed(start, stop)[..., cols].unsqueeze(2), -torch.inf)
        block_lse = logits.logsumexp(-1)
        probs = torch.exp(logits - block_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
        block = group_matmul(probs.to(values.dtype), values[:, :, cols])
        out[:, :, start:stop] = block.reshape(b, hq, stop - start, -1)
        lse[:, :, start:stop] = block_lse.reshape(b, hq, stop - start)
    return out, lse


def causal_attention_from(query, keys, values, first: int, start: int, scaling: float):
    """A causal chunk's attention (`prefix_causal_attention`: the C queries are the last C of the
    S slots) for its queries from `first` over the slots from `start`, a left-padded row's real
    part; the pad queries before `first` get zeros and a log-sum-exp of -inf, as under a mask."""
    b, hq, c, _ = query.shape
    if (first, start) == (0, 0):
        return prefix_causal_attention(query, keys, values, keys.shape[2] - c, scaling)
    out = query.new_zeros(b, hq, c, values.shape[-1])
    lse = torch.full((b, hq, c), -torch.inf, dtype=torch.float32, device=query.device)
    if first < c:
        out[:, :, first:], lse[:, :, first:] = prefix_causal_attention(
            query[:, :, first:], keys[:, :, start:], values[:, :, start:], keys.shape[2] - start - (c - first), scaling
        )
    return out, lse


SPAN_BLOCK = 1024  # queries a block when a span bounds the keys: each block reads its queries' span, not the cache


def _query_blocks(tq: int, row_elements: int, span, max_elements: int):
    """`(start, stop, slots)` for each block of queries: at most `max_elements` logits a block
    over every slot (`row_elements` a query), or `SPAN_BLOCK` queries over their `span`."""
    step = max(1, max_elements // max(1, row_elements))
    if span is not None:
        step = min(step, SPAN_BLOCK)
    for start in range(0, tq, step):
        stop = min(start + step, tq)
        yield start, stop, span(start, stop) if span is not None else slice(None)
