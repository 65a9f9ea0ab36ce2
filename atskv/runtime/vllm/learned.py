"""The learned selector inside vLLM: an exported predictor scores each prompt's tokens per layer
and KV head from what an attention backend can compute, and each decode query reads the best
scored ones (a read restriction: the rest stays in vLLM's blocks).

What the backend sees of a token is its key and the queries that attend it, so the features are
the collection's (`atskv.predictor.features`) without the hidden state: the attention it received
from the prompt's queries (H2O's prompt mass, `atskv.runtime.vllm.heavy_hitters`, divided by the
group's heads and the queries that could see it), its position and age, its key's norm, and the
previous managed layer's attention (handed from layer to layer through the forward's shared
`step`). The hidden state (its projection and norm) and the token ids are not shown to an
attention backend, so the predictor must be fit without them (`atskv fit --model.reduced_width 0
--model.without '[hidden_norm, token_type]'`); one that reads them is refused. One fit without the
attention received too (`[attention, prev_attention]` added) spares the prompt that mass, a
second QK pass over it.

Each prefill chunk scores the request's tokens so far and keeps its top budget (the last chunk's
list stands, as the end of a dense prefill leaves it), the predictor folded once
(`atskv.kernels.listed_refresh.fold_mlp`) and run over the prompt in one kernel a layer
(`atskv.kernels.prompt_scores`); a decode step keeps the tokens generated
since (their score waits at +inf) and drops the lowest-scored prompt token when the budget did not
grow. Scores that never change leave in an order fixed at the ranking, so the list is stored in
that order and a step reads the newest of a queue, writing nothing (`QueuedLists`). That is
atskv's `learned` (with its `window_share`, without a threshold) with `refresh_every` 0, unless
`refresh_every` is set here too: then every that many
decode steps of a request its listed tokens are scored again from their current features
(`atskv.kernels.listed_refresh`: the attention received now includes the decode reads', so the
selector reads mass as H2O does), in one kernel a layer that exits at once for rows not due.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from atskv.attention import check_prompt_sample
from atskv.errors import InputError, is_int
from atskv.kernels.budget import kept_count
from atskv.kernels.kept_lists import by_head
from atskv.kernels.list_queue import queue_read
from atskv.kernels.listed_refresh import fold_mlp, refresh_listed_scores
from atskv.kernels.paged import physical_slots
from atskv.kernels.prompt_scores import paged_prompt_scores
from atskv.learned_options import check_refresh_every, check_window_share
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.heavy_hitters import KeptLists, chunk_mass, compacted_unread_blocks
from atskv.runtime.vllm.prompt_ranks import window_votes
from atskv.runtime.vllm.protocol import PagedSelector, once_a_forward

AT_ONCE_BYTES = 128 << 20  # the most one forward's queue reads of every layer may hold (CUDA graph memory)
UNSEEN = ("hidden", "hidden_norm", "token_type")  # inputs an attention backend cannot compute
RECEIVED = ("attention", "prev_attention")  # the inputs the prompt's received mass is computed for
WITHOUT = ("hidden_norm", "token_type")  # `RelevanceMLP(without=...)` for them, beside reduced_width 0


@functools.lru_cache(maxsize=4)
def engine_predictor(path: str):
    """The `LoadedPredictor` at `path`, loaded once per process (every layer's backend shares it);
    an `InputError` if it reads what an attention backend does not see. Imported here: the plugin
    imports no transformers unless a predictor is loaded (its export records a model geometry)."""
    from atskv.predictor.export import load_predictor

    loaded = load_predictor(path)
    if unseen := sorted(loaded.mlp.inputs() & set(UNSEEN)):
        raise InputError(
            f"atskv: the predictor at {path} reads {', '.join(unseen)}, which vLLM does not show an attention "
            f"backend; fit one without them (atskv fit --model.reduced_width 0 --model.without "
            f"'[{', '.join(WITHOUT)}]') and export it"
        )
    return loaded


@dataclass
class LearnedLists(KeptLists):
    """`KeptLists` plus what a refresh reads by physical slot: key norms, pins (`window_share`) and
    each request's prompt length (at its first position's slot); `prompt_mass` then also
    accumulates the decode reads' mass (the attention a token received so far)."""

    key_norm: torch.Tensor
    pinned: torch.Tensor
    prompt_len: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, device) -> LearnedLists:
        lists = KeptLists.empty(num_slots, kv_heads, device)
        return cls(lists.prompt_mass, lists.kept, lists.kept_value, lists.moved, torch.zeros_like(lists.prompt_mass),
                   torch.zeros(num_slots + 1, kv_heads, dtype=torch.bool, device=device),
                   torch.zeros(num_slots + 1, dtype=torch.int32, device=device))  # fmt: skip


@dataclass
class QueuedLists(KeptLists):
    """`KeptLists` whose order of eviction is fixed at the ranking (no refresh): each request's
    entries stored lowest (score, position) first and its ranked length and entry count (L0, n0)
    at its first slot, `ranked` `[num_slots + 1, 2]` (int32), so that a decode step reads the newest
    of a queue (`atskv.kernels.list_queue`) and writes nothing."""

    ranked: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, device) -> QueuedLists:
        lists = KeptLists.empty(num_slots, kv_heads, device)
        return cls(lists.prompt_mass, lists.kept, lists.kept_value, lists.moved, torch.zeros_like(lists.moved))

    def keep_queue(self, scores: torch.Tensor, chunk: PromptChunk) -> None:
        """`keep_top` with no recent window (compacted where the chunk is), then its entries (at
        the request's first slots either way) in the order they leave, and (L0, n0)."""
        self.keep_top(scores, chunk, recent_fraction=0.0)
        n0 = kept_count(chunk.budget, chunk.length)
        at = chunk.slots(0, n0)
        entries, values = self.kept[at], self.kept_value[at]  # [n0, Hkv]
        order = entries.argsort(dim=0)  # by position, then stably by score: the kernels' tie rule
        order = order.gather(0, values.gather(0, order).sort(dim=0, stable=True).indices)
        self.kept[at], self.kept_value[at] = entries.gather(0, order), values.gather(0, order)
        first = chunk.table_row[:1].long() * chunk.block_size
        self.ranked[:, 0].index_fill_(0, first, chunk.length)
        self.ranked[:, 1].index_fill_(0, first, n0)

    def read(self, block_table, seq_lens, block_size: int, budget: int | float, step: dict | None = None,
             later_states=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A decode step's positions `[B, Hkv, width]` and counts `[B, Hkv]` (`width`: what the
        widest request keeps, the same for every step of a batch size). Given the forward's `step`
        and `later_states` (a callable giving this layer's and the later layers' lists), the
        forward's first layer reads every one's queue in one kernel (`once_a_forward`) and the rest
        find theirs; where they cannot all be read at once (`reads_at_once`), each reads its own."""
        width = kept_count(budget, block_table.shape[1] * block_size)

        def every_layer():  # None where they cannot be read at once
            states = later_states()
            if not self.reads_at_once(states, block_table.shape[0] * width):
                return None
            return ({id(s): i for i, s in enumerate(states)},
                    *queue_read([s.kept for s in states], self.ranked, block_table, seq_lens, block_size, budget,
                                width))  # fmt: skip

        if step is not None and later_states is not None:  # no step: none to share the read with
            read = once_a_forward(step, ("queues", budget), self, every_layer)
            if read is not None and id(self) in read[0]:
                return read[1][read[0][id(self)]], read[2]
        return queue_read(self.kept, self.ranked, block_table, seq_lens, block_size, budget, width)

    def reads_at_once(self, states: list | None, entries: int) -> bool:
        """Whether the forward's queues are read in one kernel: `states` are lists like this one,
        this one first, and all their positions (`entries` a layer's, per KV head) fit `AT_ONCE_BYTES`."""
        return (
            bool(states)
            and states[0] is self
            and all(type(s) is QueuedLists and s.kept.shape == self.kept.shape for s in states)
            and len(states) * entries * self.kept.shape[1] * 4 <= AT_ONCE_BYTES
        )


@dataclass
class PagedLearned(PagedSelector):
    """atskv's learned selector over vLLM's paged cache (see the module docstring). `predictor`: the
    exported predictor's folder or file."""

    name: ClassVar[str] = "learned"
    keeps_state: ClassVar[bool] = True
    scores_prompt: ClassVar[bool] = True
    takes_prompt_lse: ClassVar[bool] = True
    picks_in_order: ClassVar[bool] = True  # with a refresh: each pick steps the lists a token on
    frees_blocks: ClassVar[bool] = True  # compacted as H2O's lists are; not with a refresh (it reads positions)
    predictor: str | None = None
    # as atskv's `learned`: the share of the budget pinned for the prompt tokens its last `window`
    # queries attend most (SnapKV's vote, max-pooled over `kernel`; the window itself first)
    window_share: float = 0.0
    window: int = 32
    kernel: int = 7
    refresh_every: int = 0  # > 0: rescore the listed tokens every that many decode steps (0: never)
    prompt_sample: int = 1  # score the prompt's attention received with every s-th query (`chunk_mass`)

    def __post_init__(self):
        if self.predictor is None:
            raise InputError('atskv: the learned selector needs its predictor: "options": {"predictor": PATH}')
        check_window_share(self.window_share)
        if not is_int(self.window) or self.window < 1:
            raise InputError(f"atskv: window is a count of the chunk's last queries >= 1; got {self.window!r}")
        check_refresh_every(self.refresh_every)
        check_prompt_sample(self.prompt_sample)
        self.loaded = engine_predictor(str(self.predictor))
        self.managed = {layer: i for i, layer in enumerate(self.loaded.header.managed_layers)}
        self.reads_mass = self.refresh_every > 0  # the refresh's attention feature includes the reads'
        # a predictor fit without the attention received needs no second QK pass over the prompt
        self.scores_mass = self.reads_mass or not self.loaded.mlp.inputs().isdisjoint(RECEIVED)
        self.takes_prompt_lse = self.scores_mass or self.window_share > 0  # the mass, or the window's votes
        self.frees_blocks = not self.refresh_every  # a refresh's features read the listed tokens' positions
        self.picks_in_order = bool(self.refresh_every)  # a queue's read set is a function of the length
        self._read = None  # the last pick's positions and counts, for `observe_read`

    @classmethod
    def freeing_rule(cls, options: dict):
        """H2O's rule with no recent window (the scheduler's process loads no predictor for it)."""
        return functools.partial(compacted_unread_blocks, recent_fraction=0.0)

    def new_state(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype, device):
        """The kept lists (with their scores) and the prompt's mass by physical slot; under tensor
        parallelism the predictor scores this GPU's `kv_heads` as the model's heads they are."""
        first, total = self.kv_shard or (0, kv_heads)
        if (heads := self.loaded.header.feature_spec.num_kv_heads) != total:
            raise InputError(f"atskv: the predictor scores {heads} KV heads, this model's layers have {total}")
        folded = fold_mlp(self.loaded.mlp.to(device))  # here, before any CUDA graph is captured
        self.folded = replace(folded, bias=folded.bias[:, first : first + kv_heads].contiguous())
        lists = LearnedLists if self.refresh_every else QueuedLists
        return lists.empty(num_blocks * block_size, kv_heads, device)

    def after_write(self, state, key, slot_mapping, block_size: int) -> None:
        """With a refresh: a written slot's key norm, its received mass and pin restarting there."""
        if not self.refresh_every:
            return
        at = torch.where(slot_mapping >= 0, slot_mapping, state.spare).long()
        state.key_norm[at] = key.float().norm(dim=-1)
        state.prompt_mass.index_fill_(0, at, 0.0)  # a fill, not `[at] = 0.0`: that copies a host scalar,
        state.pinned.index_fill_(0, at, False)  # which CUDA graph capture refuses

    def observe_prompt(self, state: KeptLists, chunk: PromptChunk) -> None:
        """One request's chunk: its mass added; at the prompt's last chunk (every chunk where that is
        unknown), its tokens so far scored with their features at its end and the list rebuilt."""
        if chunk.layer not in self.managed:
            raise InputError(f"atskv: layer {chunk.layer} reads sparsely but the predictor manages layers "
                             f"{list(self.managed)}; set dense_layers to match it")  # fmt: skip
        if self.scores_mass:
            mass = state.add_prompt_mass(chunk_mass(chunk, self.prompt_sample), chunk.queries.shape[0], chunk)
        if not chunk.last:  # a list ranked now would be ranked again before any decode reads it
            return
        length, device = chunk.length, chunk.key_slots.device
        heads, index = chunk.key_slots.shape[0], self.managed[chunk.layer]
        attention = prev = None  # the columns the predictor does not read (zeros)
        if self.scores_mass:  # the mean over the group's heads and the queries that could see each token
            position = torch.arange(length, device=device, dtype=torch.float32)
            attention = mass / (chunk.queries.shape[1] // heads) / (length - position)
            previous = chunk.step.get((self.name, chunk.row))  # the layer before's (layer, attention by position)
            if index > 0 and previous is not None and previous[0] < chunk.layer:
                prev = previous[1]
            chunk.step[(self.name, chunk.row)] = (chunk.layer, attention.mean(0))
        scores = paged_prompt_scores(attention, prev, chunk.key_slots, chunk.table_row, chunk.block_size, length,
                                     self.folded, index)  # fmt: skip
        if self.window_share > 0:
            pins = self.pinned(chunk)
            scores.scatter_(1, pins, torch.inf)
        if not self.refresh_every:
            state.keep_queue(scores, chunk)
            return
        slots = chunk.slots(0, length)  # what a refresh reads of this request: its prompt's length, its pins
        state.prompt_len[slots[:1]] = length
        state.pinned[slots] = False
        if self.window_share > 0:
            state.pinned[slots[pins], torch.arange(heads, device=device).view(-1, 1)] = True
        state.keep_top(scores, chunk, recent_fraction=0.0)

    def pinned(self, chunk: PromptChunk) -> torch.Tensor:
        """Positions `[Hkv, n]` of the `window_share` of the budget the chunk's last `window` queries
        attend most, the window's own tokens first (a chunk shorter than the window votes with its
        own queries)."""
        length = chunk.length
        w = min(self.window, chunk.queries.shape[0], length)
        votes = window_votes(chunk, w, self.kernel)
        votes[:, length - w :] = torch.inf
        return votes.topk(min(math.ceil(self.window_share * kept_count(chunk.budget, length)), length), dim=-1).indices

    def pick(self, query, kv_heads: int, state: KeptLists, block_table, seq_lens, block_size: int,
             budget: int | float, step: dict | None = None):  # fmt: skip
        if not self.refresh_every:
            return state.read(block_table, seq_lens, block_size, budget, step, self.later_states)
        step = {} if step is None else step
        slots = block_table.shape[1] * block_size
        index, previous = self.managed[self.layer], step.get((self.name, "received"))
        previous = previous[1] if previous is not None and index > 0 and previous[0] < self.layer else None
        refresh_listed_scores(state.kept, state.kept_value, state.prompt_mass, state.key_norm, previous,
                              state.pinned, state.prompt_len, block_table, seq_lens, block_size, budget,
                              self.refresh_every, query.shape[1] // kv_heads, self.folded, index,
                              min(slots, kept_count(budget, slots) + 1))  # fmt: skip
        step[(self.name, "received")] = (self.layer, state.prompt_mass)
        positions, counts = state.step(block_table, seq_lens, block_size, budget, 0.0, new_value=math.inf)
        self._read = (positions, counts)
        return positions, counts

    def observe_read(self, state: LearnedLists, mass, block_table, seq_lens, block_size: int) -> None:
        """With a refresh: the mass the read gave each listed token, added to what it received."""
        positions, counts = self._read
        listed = torch.arange(positions.shape[-1], device=mass.device) < counts.unsqueeze(-1)
        where = by_head(physical_slots(positions, block_table, block_size).long())
        state.prompt_mass.view(-1).index_put_((where,), torch.where(listed, mass, 0.0).reshape(-1), accumulate=True)
