"""The fast path's session (`StaticSession`, run by `atskv.generate`): the same selection as the
reference session `SparseSession`, over a static cache with no host synchronisation per step.

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

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from atskv.attention import (
    causal_attention_from,
    grouped_attention,
    masked_attention,
    masked_attention_lse,
    received_mass,
    sampled_queries,
)
from atskv.budget import resolve_budget
from atskv.kernels.backend import aligned_slots
from atskv.kernels.evict import evict_lowest
from atskv.kernels.received_mass import prefix_received_mass
from atskv.kernels.sparse_decode import sparse_decode_attention
from atskv.runtime.fast.host_pages import HostPages, HostRetrieval
from atskv.runtime.fast.static_cache import StaticKVCache, StaticSlotLayer
from atskv.runtime.reference.sparse import STATIC_ATTENTION_NAME, SelectorSession, SparsityConfig
from atskv.selectors.base import LAST_QUERIES, LayerView, Selector
from atskv.slot_cache import slot_index


class StaticSession(SelectorSession):
    """The selection of a `SparseSession` over a `StaticKVCache`, for one `generate` call; see the
    module docstring."""

    attention_name = STATIC_ATTENTION_NAME

    def __init__(
        self, model, selector: Selector, config: SparsityConfig, prompt_tokens: int, max_new_tokens: int,
        prefill_chunk: int, tier: HostRetrieval | None = None, batch: int = 1,
    ):  # fmt: skip
        if not selector.has_fast_path():
            raise ValueError(
                f"selector {selector.name!r} has no fast decode path yet (`Selector.has_fast_path`; `atskv "
                "selectors` lists those that have); use `atskv.sparse` with `model.generate` (the reference path)"
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
        self.keeper, self.chooser = selector.roles()
        # None: a composition's residency keeps every token (its budget reached the context), as the reference's does
        self.keep_budget = selector.held_budget(config.budget) or self.longest
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

        def allowed_at(positions) -> torch.Tensor:  # [B, 1, n, S]: the chunk's queries at `positions` [n]
            qp = positions.view(1, 1, -1, 1)
            ok = (slot_pos[:, :1].unsqueeze(2) <= qp) & (slot_pos[:, :1].unsqueeze(2) >= 0)
            if layer.window is not None:
                ok = ok & (slot_pos[:, :1].unsqueeze(2) > qp - layer.window)
            if self.real is not None:  # a pad neither is seen nor sees (it gives no attention mass)
                ok = ok & self.real.gather(1, slot_pos[:, 0].clamp(min=0)).view(-1, 1, 1, stop)
                ok = ok & self.real[:, positions].view(-1, 1, positions.shape[0], 1)
            return ok

        def allowed(start: int, end: int) -> torch.Tensor:
            return allowed_at(q_pos[start:end])

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
                sample = self.selector.prompt_sample
                if causal is not None:
                    mass = _per_row(causal, lambda rows, part: causal_mass_from(
                        query[rows], keys[rows], lse[rows], *part, scaling, sample))  # fmt: skip
                else:
                    picked = sampled_queries(c, sample)
                    at = q_pos[picked]
                    mass = received_mass(query[:, :, picked], keys, lse[:, :, picked],
                                         lambda start, end: allowed_at(at[start:end]), scaling) * sample  # fmt: skip
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
        write slot on. (Per layer, these were three more launches in every step.)"""
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


def causal_mass_from(query, keys, lse, first: int, start: int, scaling: float, sample: int = 1) -> torch.Tensor:
    """The mass `[B, Hkv, S]` each slot receives from `causal_attention_from`'s queries (the pad
    slots before `start` none); with `sample` s > 1 from every s-th, as `sampled_queries` picks
    them, times s."""
    c = query.shape[2]
    first += (c - 1 - first) % sample if first < c else 0
    if first >= c:
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
    mass = prefix_received_mass(query[:, :, first::sample], keys[:, :, start:], lse[:, :, first::sample],
                                keys.shape[2] - start - (c - first), scaling, sample)  # fmt: skip
    return torch.nn.functional.pad(mass * sample, (start, 0))


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
