"""`atskv.generate`: the fast path. A chunked prefill that never builds a `[T, T]` buffer, then
decode steps with static shapes and no host synchronisation, captured once in a CUDA graph and
replayed for every token.

Why a second session beside `SparseSession` (which stays the reference): the reference cache
grows and compacts, its masks are `[B, Hkv, Tq, S]`, and it asks the host how many slots each
row holds; all of that is right for studying selectors and wrong for speed. Here:
- every layer's KV sits in a `StaticKVCache` sized once (prompt + new tokens; an evicting
  selector's managed layers shrink to its budget + 1 after the prompt; sliding-window layers to
  their window), and the model runs with an attention name that has no mask function, so
  transformers builds no mask at all: this session knows positions and padding itself;
- prompt chunks attend with flash kernels and a log-sum-exp merge (`prefix_causal_attention`),
  or through a positional mask for sliding-window layers and padded batches; H2O-style
  selectors get the mass each token received from the log-sum-exps, a block of queries at a time;
- a decode step of a layer that keeps everything (dense layers, non-managed layers) and of a
  query-aware selector is one sparse decode kernel over index lists (identity lists for dense);
  an evicting selector drops its lowest-scoring token when its budget is full and writes the
  next token into that slot (with a budget that is a cap, the learned selector's threshold, it
  also drops every held token it no longer wants, several at once after a refresh; the next
  token then takes the first free slot). The top-k size is the budget of the longest context the call can
  reach, the per-row budget a device tensor, so every step is the same graph.
- a composition (`learned+sparq`, `atskv.selectors.hybrid`) is an evicting layer at its
  residency budget whose step attends what the query-aware part picks among the held tokens,
  then evicts (Quest's pages need position-ordered slots: not on the fast path).

Same selection as the reference session: `tests/test_decode.py` checks token-identical greedy
output on random models for every supported selector, and that a decode step makes no host
synchronisation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from atskv.attention import group_matmul, grouped_attention, prefix_causal_attention, received_mass, sdpa_attention
from atskv.budget import resolve_budget
from atskv.hook.sparse import STATIC_ATTENTION_NAME, SparseSession, SparsityConfig, attach
from atskv.kernels.backend import aligned_slots
from atskv.kernels.evict import evict_lowest
from atskv.kernels.received_mass import prefix_received_mass
from atskv.kernels.sparse_decode import sparse_decode_attention
from atskv.memory.host_pages import HostPages, HostRetrieval
from atskv.memory.slot_cache import slot_index
from atskv.memory.static_cache import StaticKVCache, StaticSlotLayer
from atskv.models.cache_names import with_cache
from atskv.models.geometry import decoder_layers
from atskv.selectors import resolve_selector
from atskv.selectors.base import LAST_QUERIES, LayerView, Selector
from atskv.selectors.hybrid import HybridSelector
from atskv.selectors.spark import SparKSelector

# selectors whose decode state is written by the hook alone (slot tensors, in place) or by a
# `static_write`; the others still need host-side bookkeeping per step
FAST_SELECTORS = (
    "dense", "oracle", "quest", "sparq", "sparcas", "streaming_llm", "snapkv", "h2o", "learned", "spark", "kascade",
)  # fmt: skip
# ... but not as a composition's part: Quest's pages need position-ordered slots, the reference's
# composition makes SparCas choose new dimensions after each eviction, and it attends on the cached
# keys, not on SparK's recovered ones
ALONE_ONLY = ("quest", "sparcas", "spark", "kascade")


def has_fast_path(selector: Selector) -> bool:
    """Whether `StaticSession` makes the reference's choices for `selector`: its parts (a
    composition's two, SparK and its base) in `FAST_SELECTORS`. SparK over a base that keeps every
    token is refused: on the reference path every step is then a dense one, which prunes every
    token again. A budget that is a cap (the learned selector's `threshold`, `Selector.unwanted`)
    is kept as the reference keeps it (`kernels.evict`)."""
    parts = [selector]
    if isinstance(selector, HybridSelector):
        parts = [selector.residency, selector.attention]
        if any(p.name in ALONE_ONLY for p in parts):
            return False
    elif isinstance(selector, SparKSelector):
        if selector.keeps_all:
            return False
        parts.append(selector.base)
    return all(p.name in FAST_SELECTORS for p in parts)


class StaticSession(SparseSession):
    """A `SparseSession` over a `StaticKVCache` for one `generate` call; see the module docstring."""

    attention_name = STATIC_ATTENTION_NAME

    def __init__(
        self, model, selector: Selector, config: SparsityConfig, prompt_tokens: int, max_new_tokens: int,
        prefill_chunk: int, tier: HostRetrieval | None = None, batch: int = 1,
    ):  # fmt: skip
        if not has_fast_path(selector):
            raise ValueError(
                f"selector {selector.name!r} has no fast decode path yet; use one of {', '.join(FAST_SELECTORS)}, "
                "or `atskv.sparse` with `model.generate` (the reference path)"
            )
        if tier is not None and not selector.evicts:
            raise ValueError(
                f"a host tier needs an evicting selector to choose what stays on the GPU (h2o, snapkv, "
                f"streaming_llm, learned), not {selector.name!r}"
            )
        if config.sparse_prefill:
            raise ValueError("the fast path prefills densely; sparse_prefill needs the reference path (atskv.sparse)")
        super().__init__(model, selector, config)
        self.prompt_tokens, self.max_new_tokens, self.prefill_chunk = prompt_tokens, max_new_tokens, prefill_chunk
        self.longest = prompt_tokens + max_new_tokens
        # who decides what the GPU holds, at which budget, and (a hybrid) who chooses what a query reads
        self.keeper, self.keep_budget, self.chooser = selector, config.budget, None
        if isinstance(selector, HybridSelector):
            self.keeper, self.chooser = selector.residency, selector.attention
            # None: the residency keeps every token (its budget reached the context), as the reference's does
            self.keep_budget = selector.budgets(config.budget).residency or self.longest
        self.budget_cap = int(resolve_budget(self.keep_budget, torch.tensor([self.longest])))
        self.real: torch.Tensor | None = None  # [B, T] bool: the prompt's non-padding tokens
        self.pads: list[int] | None = None  # every row's pads leading: how many, per row (`left_padding`)
        self._identity: dict[tuple, torch.Tensor] = {}
        self.tier = tier
        self.hosts: dict[int, HostPages] = {}  # managed layer -> its host tier (with `tier`)
        self.batch, self.row = batch, 0  # rows of the call, and the one being prefilled (one at a time)

    def handles(self, layer_idx: int) -> bool:
        return True  # every layer's cache is static

    def evicting(self, layer_idx: int) -> bool:
        return self.selector.evicts and self.is_managed(layer_idx)

    def is_managed(self, layer_idx: int) -> bool:
        return layer_idx in self.managed_layers and not self.selector.keeps_all and self.config.sparse_decode

    def new_cache(self) -> StaticKVCache:
        def capacity(layer_idx: int, window: int | None) -> int:
            if window is not None:
                return min(self.longest, window - 1 + self.prefill_chunk)
            if self.evicting(layer_idx):  # the prompt, and room for new tokens up to the budget (+ 1)
                return max(self.prompt_tokens, min(self.budget_cap + 1, self.longest))
            # per-slot rows (`slot_pos`, selector state) aligned for the kernels; the slots past
            # `longest` stay free
            return aligned_slots(self.longest)

        return StaticKVCache(self.model.config, capacity)

    def bind(self, cache) -> StaticKVCache:
        if not isinstance(cache, StaticKVCache):
            raise TypeError("atskv.generate runs on its own StaticKVCache")
        self.cache = cache
        return cache

    # --- one attention call ----------------------------------------------------------------------
    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        layer: StaticSlotLayer = self.cache.layers[module.layer_idx]
        if layer.decoding:
            return self.decode_step(module.layer_idx, layer, query, scaling)
        return self.prompt_chunk(module.layer_idx, layer, query, scaling)

    def prompt_chunk(self, layer_idx: int, layer: StaticSlotLayer, query, scaling: float) -> torch.Tensor:
        """A prompt chunk of `C` queries whose K/V were just appended: attention over every earlier
        prompt token, and the selector state a dense prefill would leave."""
        c = query.shape[2]
        stop = layer.filled
        keys, values, slot_pos = layer.keys[:, :, :stop], layer.values[:, :, :stop], layer.slot_pos[:, :, :stop]
        q_pos = torch.arange(layer.seen - c, layer.seen, device=query.device)

        def allowed(start: int, end: int) -> torch.Tensor:  # [B, 1, end - start, S]
            qp = q_pos[start:end].view(1, 1, -1, 1)
            ok = (slot_pos[:, :1].unsqueeze(2) <= qp) & (slot_pos[:, :1].unsqueeze(2) >= 0)
            if layer.window is not None:
                ok = ok & (slot_pos[:, :1].unsqueeze(2) > qp - layer.window)
            if self.real is not None:
                ok = ok & self.real.gather(1, slot_pos[:, 0].clamp(min=0)).view(-1, 1, 1, stop)
            return ok

        def span(start: int, end: int) -> slice:  # prompt slots hold positions in order: query i at slot stop - c + i
            first = stop - c + start - layer.window + 1 if layer.window is not None else 0
            return slice(max(0, first), stop - c + end)

        causal = self._causal_parts(layer, stop, c)
        if causal is not None:
            out, lse = _per_row(causal, lambda rows, part: causal_attention_from(
                query[rows], keys[rows], values[rows], *part, scaling))  # fmt: skip
        elif self.is_managed(layer_idx) and self.selector.needs_attention:  # its mass needs the log-sum-exps
            out, lse = masked_attention_lse(query, keys, values, allowed, scaling, span)
        else:
            out = masked_attention(query, keys, values, allowed, scaling, span)
        if self.is_managed(layer_idx):
            view = self._prompt_view(layer_idx, layer, query, scaling)
            self.selector.static_write(view)
            if self.selector.needs_attention:
                if causal is not None:
                    mass = _per_row(causal, lambda rows, part: causal_mass_from(
                        query[rows], keys[rows], lse[rows], *part, scaling))  # fmt: skip
                else:
                    mass = received_mass(query, keys, lse, allowed, scaling)
                self.selector.observe(view, torch.nn.functional.pad(mass, (0, layer.capacity - stop)))
            if layer.seen == self.prompt_tokens:
                self.selector.prefill(self._last_queries_view(view, allowed))
        return out.transpose(1, 2)

    def _causal_parts(self, layer: StaticSlotLayer, stop: int, c: int) -> list[tuple[int, int]] | None:
        """Where a global layer's chunk needs no mask: per row, `(first query, first slot)` of its
        real part (its slots 0 .. stop - 1 hold positions 0 .. stop - 1): all of it unpadded; from
        its first real token in a left-padded batch (`pads`), whether the row is prefilled alone or
        with the others. None: a sliding window or pads inside a row, the masked path."""
        if layer.window is not None or (self.real is not None and self.pads is None):
            return None
        pads = self.pads or [0]
        return [(min(c, max(0, pad - (stop - c))), pad) for pad in (min(p, stop) for p in pads)]

    def _prompt_view(self, layer_idx, layer, query, scaling) -> LayerView:
        """The whole slot buffer as a selector sees it during the prompt (free slots invalid)."""
        context = torch.full((1, 1, 1), layer.seen, device=query.device)
        return LayerView(
            layer_idx, query, layer.keys, (layer.slot_pos >= 0).unsqueeze(2), layer.slot_pos, context, scaling,
            self.config.budget, layer, self.hidden.get(layer_idx), self.token_ids,
        )  # fmt: skip

    def _last_queries_view(self, view: LayerView, allowed) -> LayerView:
        """What a selector's `prefill` reads: the prompt's last `LAST_QUERIES` queries (SnapKV's
        observation window; the last prompt chunk is a full one) with their causal visibility,
        not a `[T, T]` mask."""
        tq = view.query.shape[2]
        w = min(LAST_QUERIES, tq)
        valid = allowed(tq - w, tq).expand(-1, view.keys.shape[1], -1, -1)
        valid = torch.nn.functional.pad(valid, (0, view.keys.shape[2] - valid.shape[-1]))
        context = self.real.sum(-1).view(-1, 1, 1) if self.real is not None else view.context
        return LayerView(
            view.layer_idx, view.query[:, :, -w:], view.keys, valid, view.slot_pos, context, view.scaling,
            view.budget, view.layer, view.hidden, view.token_ids,
        )  # fmt: skip

    def finish_prompt(self, real: torch.Tensor | None) -> None:
        """After the last prompt chunk: each row's real tokens to the front, then an evicting
        selector keeps what the reference's dense step retains (its top budget, minus what it does
        not want at all) and its layers shrink to budget + 1 slots, the one spare taking each new
        token."""
        self.cache.finish_prompt(real)
        for idx, layer in enumerate(self.cache.layers):
            if not self.evicting(idx):
                continue
            view = self.decode_view(idx, layer, None, 1.0)
            if self.tier is not None:
                self._park(idx, layer)
            keep = self.keeper.retained(replace(view, budget=self.keep_budget), None)
            layer.evict(layer.slot_pos.ge(0) & ~keep)
            layer.shrink(min(layer.capacity, self.budget_cap + 1))
            if self.tier is not None:
                self.hosts[idx].mark_resident(self.row, layer.slot_pos[0])

    def _park(self, layer_idx: int, layer: StaticSlotLayer) -> None:
        """Copy the row just prefilled (real tokens at the front) to its layer's host tier."""
        if layer.keys.shape[0] != 1:
            raise ValueError("a host tier prefills one row at a time")
        if layer_idx not in self.hosts:
            _, h, _, d = layer.keys.shape
            read = self.tier.pages(self.prompt_tokens)
            self.hosts[layer_idx] = HostPages(self.batch, h, self.longest, d, layer.keys.dtype, layer.keys.device,
                                              self.tier.page_size, read, math.ceil(read * self.tier.cache),
                                              self.tier.summary)  # fmt: skip
        count, first = int(layer.context[0]), int(layer.slot_pos[0, 0, 0])
        self.hosts[layer_idx].park(self.row, layer.keys, layer.values, first, count)

    # --- one decode step: static shapes, no host sync -------------------------------------------
    def decode_view(self, layer_idx: int, layer: StaticSlotLayer, query, scaling: float) -> LayerView:
        return LayerView(
            layer_idx, query, layer.keys, None, layer.slot_pos, layer.context.view(-1, 1, 1), scaling,
            self.config.budget, layer, self.hidden.get(layer_idx), self.token_ids, longest=self.longest,
        )  # fmt: skip

    def decode_step(self, layer_idx: int, layer: StaticSlotLayer, query, scaling: float) -> torch.Tensor:
        q = query[:, :, 0]
        if self.evicting(layer_idx):
            return self._evicting_step(layer_idx, layer, query, scaling)
        if self.is_managed(layer_idx):
            view = self.decode_view(layer_idx, layer, query, scaling)
            self.selector.static_write(view)
            indices, lengths = self.selector.decode_indices(view)
        else:  # keeps everything: the held slots are a prefix of the buffer (a ring for sliding layers)
            indices = self._identity_indices(layer)
            lengths = (layer.slot_pos >= 0).sum(-1)
        out = sparse_decode_attention(q, layer.keys, layer.values, indices, lengths, scaling)
        if layer.window is not None:  # the oldest slot (a free one first) takes the next token
            layer.write_slot.copy_(layer.slot_pos.argmin(-1))
        return out.unsqueeze(1)

    def step_counters(self, cache: StaticKVCache) -> Callable[[Callable[[], torch.Tensor]], torch.Tensor]:
        """`run(forward)`: one decode step around `forward` with the cache's device counters moved
        in two launches for the whole model: before it, the shared position and context count the
        new token; after it, each layer that appends (keeps every token, no window) moves its
        write slot on. (Per layer, these were three kernels of a ~20 us step.)"""
        appending = [layer.write_slot for idx, layer in enumerate(cache.layers)
                     if layer.window is None and not self.evicting(idx)]  # fmt: skip

        def run(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
            cache.start_step()
            out = forward()
            if appending:
                torch._foreach_add_(appending, 1)
            return out

        return run

    def _evicting_step(self, layer_idx: int, layer: StaticSlotLayer, query, scaling: float) -> torch.Tensor:
        """Keep the budget: when the row holds more than its budget, the lowest-scoring token
        (the oldest among equals, as the reference's ranking) is dropped before the attention, and
        its slot takes the next token; so are the tokens the keeper does not want (a threshold:
        the reference attends its top budget minus those). A hybrid attends what its attention part picks among every
        held token and evicts afterwards, by the residency scores that include this step's
        attention (as the reference's `retained`)."""
        view = self.decode_view(layer_idx, layer, query, scaling)
        self.selector.static_write(view)
        host = self.hosts.get(layer_idx)  # with a host tier
        if host is not None:  # the new token's host copy
            new = layer.write_slot.unsqueeze(-1)
            host.append(*(t.gather(2, slot_index(new, t)) for t in (layer.keys, layer.values)))
        if self.chooser is None:
            self._evict(view, layer, host)
        if host is None:
            out, mass = self._attend_held(view, layer, query, scaling)
        else:
            out, mass = self._attend_with_host(view, layer, query, scaling, host)
        if mass is not None:
            self.selector.observe(view, mass)
        if self.chooser is not None:
            self._evict(view, layer, host)
        return out

    def _evict(self, view: LayerView, layer: StaticSlotLayer, host: HostPages | None) -> None:
        """Each over-budget row drops its lowest-scoring token by the keeper's scores, every row the
        held tokens the keeper does not want (`Selector.unwanted`: a threshold), and the next token
        takes a freed slot (`kernels.evict`); with a host tier the dropped tokens are flagged parked."""
        scores, recent = self.keeper.eviction_scores(replace(view, budget=self.keep_budget))
        unwanted = self.keeper.unwanted(view)
        if host is not None and unwanted is not None:  # before the kernel frees their slots
            host.release(layer.slot_pos, unwanted)
        freed = evict_lowest(scores, layer.slot_pos, layer.context, self.keep_budget, layer.write_slot, unwanted,
                             recent)  # fmt: skip
        if host is not None:
            host.release(freed.unsqueeze(-1), freed.unsqueeze(-1) >= 0)

    def _attend_held(self, view: LayerView, layer: StaticSlotLayer, query, scaling: float):
        """The sparse decode kernel over every held slot (an identity list skipping free slots) or
        over a hybrid's pick. When the selector observes the mass each slot received, the kernel
        adds it to the keeper's accumulator (`Selector.mass_accumulator`), or without one returns
        it for `observe`."""
        accumulator = self.keeper.mass_accumulator(view) if self.selector.needs_attention else None
        want = self.selector.needs_attention and accumulator is None
        if self.chooser is None:
            indices, lengths = self._identity_indices(layer), None
        else:
            indices, lengths = self.chooser.decode_indices(view)
        result = sparse_decode_attention(query[:, :, 0], layer.keys, layer.values, indices, lengths, scaling,
                                         held=layer.slot_pos, want_mass=want, add_mass_to=accumulator)  # fmt: skip
        out, mass = result if want else (result, None)
        if mass is not None and self.chooser is not None:  # per index position -> per slot
            mass = torch.zeros(layer.slot_pos.shape, device=mass.device).scatter_add_(-1, indices.long(), mass)
        return out.unsqueeze(1), mass

    def _attend_with_host(self, view: LayerView, layer: StaticSlotLayer, query, scaling: float, host: HostPages):
        """Attention over the held slots (or a hybrid's pick) and the parked tokens this query
        rates highest, read back from the host."""
        attend = self._chosen(view) if self.chooser is not None else layer.slot_pos >= 0
        fetched_keys, fetched_values, fetched = host.fetch(query[:, :, 0])
        keys, values = torch.cat([layer.keys, fetched_keys], 2), torch.cat([layer.values, fetched_values], 2)
        attend = torch.cat([attend, fetched], -1)
        out, mass = grouped_attention(query, keys, values, attend.unsqueeze(2), scaling,
                                      want_mass=self.selector.needs_attention)  # fmt: skip
        return out, None if mass is None else mass[..., : layer.capacity]

    def _chosen(self, view: LayerView) -> torch.Tensor:
        """A hybrid's attention part: the slots `[B, Hkv, S]` it picks among the held ones."""
        indices, lengths = self.chooser.decode_indices(view)
        counted = torch.arange(indices.shape[-1], device=indices.device) < lengths.unsqueeze(-1)
        picked = torch.zeros(view.slot_pos.shape, dtype=torch.int32, device=indices.device)
        return picked.scatter_add_(-1, indices.long(), counted.int()) > 0

    def _identity_indices(self, layer: StaticSlotLayer) -> torch.Tensor:
        b, h, s = layer.slot_pos.shape
        key = (b, h, s, layer.slot_pos.device)
        if key not in self._identity:
            self._identity[key] = torch.arange(s, dtype=torch.int32, device=layer.slot_pos.device).expand(b, h, s)
        return self._identity[key]


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


def causal_mass_from(query, keys, lse, first: int, start: int, scaling: float) -> torch.Tensor:
    """The mass `[B, Hkv, S]` each slot receives from `causal_attention_from`'s queries (the pad
    slots before `start` none)."""
    c = query.shape[2]
    if first >= c:
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
    mass = prefix_received_mass(query[:, :, first:], keys[:, :, start:], lse[:, :, first:],
                                keys.shape[2] - start - (c - first), scaling)  # fmt: skip
    return torch.nn.functional.pad(mass, (start, 0))


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


class GraphedStep:
    """`step()` per variant (`__call__(variant)`): run eagerly the first time (a real decode step
    that also warms up kernels and allocators), captured in a CUDA graph the second time, replayed
    from then on; the variants' graphs share one memory pool. Off CUDA, or with `enabled=False`,
    every call runs eagerly."""

    def __init__(self, step: Callable[[], torch.Tensor], device: torch.device, enabled: bool = True):
        self.step, self.device = step, device
        self.enabled = enabled and device.type == "cuda"
        self.calls: dict[object, int] = {}
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, variant: object = None) -> torch.Tensor:
        self.calls[variant] = self.calls.get(variant, 0) + 1
        if not self.enabled:
            return self.step()
        if variant in self.graphs:
            graph, output = self.graphs[variant]
            graph.replay()
            return output
        if self.calls[variant] == 1:  # warm-up: a side stream, as CUDA graph capture wants
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                out = self.step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.step()
        self.pool = graph.pool()
        self.graphs[variant] = (graph, output)
        graph.replay()
        return output


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    selector: Selector | str = "dense",
    budget: int | float = 0.1,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    dense_layers: int = 2,
    prefill_chunk: int = 4096,
    cuda_graph: bool = True,
    eos_token_id: int | None = None,
    streamer=None,
    tier: HostRetrieval | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Greedy generation under a selector and budget on the fast path: `[B, T + new]` token ids.

    >>> out = atskv.generate(model, ids, "quest", budget=0.05, max_new_tokens=64)

    Same tokens as `with atskv.sparse(model, selector, budget): model.generate(ids, do_sample=False)`
    for the selectors in `FAST_SELECTORS`; prompts are processed `prefill_chunk` tokens at a time.
    `streamer`: as transformers' (`put` gets the prompt, then each new token `[B, 1]`; `end`).
    `tier`: keep every token in pinned host memory as well and read the best parked pages back
    at each step (`HostRetrieval`); `budget` is then what stays on the GPU.
    `compile`: run the decode steps through `torch.compile`d decoder layers (`compiled_layers`):
    the model's own norms, rotary embedding and MLP glue fused (8B shape, 32K: 7.6 -> 6.0 ms per
    step on an H200); the first call in a process compiles, ~15 s at that shape. Rounding then
    differs from the eager reference in bf16, as any fused kernel's does."""
    selector = resolve_selector(selector, model)  # as atskv.sparse: a name finds the model's own predictor
    if max_new_tokens < 1 or prefill_chunk < LAST_QUERIES:
        raise ValueError(
            f"need max_new_tokens >= 1 and prefill_chunk >= {LAST_QUERIES}, got {max_new_tokens}, {prefill_chunk}"
        )
    b, t = input_ids.shape
    session = StaticSession(model, selector, SparsityConfig(budget, dense_layers), t, max_new_tokens, prefill_chunk,
                            tier, batch=b)  # fmt: skip
    with attach(model, session):
        return _generate(model, session, input_ids, attention_mask, max_new_tokens, prefill_chunk, cuda_graph,
                         eos_token_id, streamer, compile)  # fmt: skip


@contextlib.contextmanager
def compiled_layers(model, enabled: bool = True) -> Iterator[None]:
    """Inside the block, each decoder layer runs `torch.compile`d, with atskv's cache write and
    attention left out of the compiled graphs (they are `torch.compiler.disable`d: the selectors
    keep Python state). What is compiled is the model's own per-layer work, which eager runs as
    ~35 small kernels per layer (norms, rotary, residuals, the MLP's activation) between the
    projections. No CUDA graphs of its own: `GraphedStep` captures the compiled step. Every
    layer is its own compiled entry (its index is a constant), so the recompile limit is raised
    to the layer count for the block."""
    if not enabled:
        yield
        return
    layers = decoder_layers(model)
    own = [layer.__dict__.get("forward") for layer in layers]
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers))
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, 8 * limit)):
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)
        try:
            yield
        finally:
            for layer, forward in zip(layers, own):
                del layer.forward
                if forward is not None:
                    layer.forward = forward


def prompt_chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """`(start, stop)` of each prompt chunk: a short first one, then full ones, so the last chunk
    (whose queries SnapKV-style selectors read, `LAST_QUERIES`) is a full one."""
    first = tokens - (math.ceil(tokens / chunk) - 1) * chunk
    starts = [0, *range(first, tokens, chunk)]
    return [(start, min(start + (first if start == 0 else chunk), tokens)) for start in starts]


def _prefill(model, session: StaticSession, ids, positions, real, chunk: int,
             row: int = 0) -> tuple[StaticKVCache, torch.Tensor]:  # fmt: skip
    """The prompt in chunks of `chunk` tokens (the last one full) into a new cache, finished for
    decoding; returns it and the last position's logits `[B, vocab]`. `row`: which row of the
    call `ids` is, when rows are prefilled one at a time (a host tier parks it there)."""
    t = ids.shape[1]
    session.real, session.pads, session.row = real, left_padding(real), row
    cache = session.new_cache()
    given = with_cache(model, cache)
    for start, stop in prompt_chunks(t, chunk):
        logits = model(input_ids=ids[:, start:stop], position_ids=positions[:, start:stop], **given, use_cache=True,
                       logits_to_keep=1).logits  # fmt: skip
    session.finish_prompt(real)
    session.real = session.pads = None
    return cache, logits[:, -1]


def left_padding(real: torch.Tensor | None) -> list[int] | None:
    """How many pad tokens lead each row of `real` `[B, T]`, when no pad follows a real token in
    any row (None: no mask, or pads inside a row). One host sync per prefill."""
    if real is None:
        return None
    pads = (~real).sum(-1)
    leading = torch.arange(real.shape[1], device=real.device) >= pads.unsqueeze(-1)
    return pads.tolist() if bool((real == leading).all()) else None


def _per_row(parts: list[tuple[int, int]], attend: Callable):
    """`attend(rows, part)` (a tensor or a tuple of them) over the batch: in one call where every
    row has the same real part (`_causal_parts`), else row by row (each from its own first real
    token), concatenated."""
    if all(part == parts[0] for part in parts):
        return attend(slice(None), parts[0])
    rows = [attend(slice(r, r + 1), part) for r, part in enumerate(parts)]
    if isinstance(rows[0], torch.Tensor):
        return torch.cat(rows)
    return tuple(torch.cat(pieces) for pieces in zip(*rows))


def _generate(model, session, input_ids, attention_mask, max_new_tokens, prefill_chunk, cuda_graph, eos_token_id,
              streamer, compile: bool):  # fmt: skip
    b, t = input_ids.shape
    emit = streamer.put if streamer is not None else lambda tokens: None
    emit(input_ids)
    device = input_ids.device
    real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
    if real is not None:
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(t, device=device).expand(b, t)
    if session.selector.evicts and b > 1:  # each row compressed before the next: the prompt KV of one row at a time
        rows = [_prefill(model, session, input_ids[i : i + 1], positions[i : i + 1],
                         None if real is None or bool(real[i].all()) else real[i : i + 1], prefill_chunk, i)
                for i in range(b)]  # fmt: skip
        cache, logits = StaticKVCache.stack([c for c, _ in rows]), torch.cat([lg for _, lg in rows])
    else:
        cache, logits = _prefill(model, session, input_ids, positions, real, prefill_chunk)
    token = logits.argmax(-1)
    emit(token.view(b, 1))
    ids_in = token.view(b, 1).clone()
    pos_in = positions[:, -1:] + 1

    counted = session.step_counters(cache)
    given = with_cache(model, cache)

    def step() -> torch.Tensor:
        return counted(lambda: model(input_ids=ids_in, position_ids=pos_in, **given, use_cache=True).logits[:, -1])

    run = GraphedStep(step, device, cuda_graph)
    out = [token]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    first_managed = min((i for i in session.managed_layers if session.is_managed(i)), default=None)
    with compiled_layers(model, compile):
        for _ in range(max_new_tokens - 1):
            if eos_token_id is not None:
                done |= token == eos_token_id
            for layer in cache.layers:  # host-side count of tokens written (the step writes one)
                layer.seen += 1
            variant = None if first_managed is None else session.selector.decode_variant(cache.layers[first_managed])
            token = run(variant).argmax(-1)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
            out.append(token)
            emit(token.view(b, 1))
            ids_in.copy_(token.view(b, 1))
            pos_in += 1
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1)
