"""Which cached tokens a decode query reads, over vLLM's paged cache: one selector a class, each
declaring what it needs from the engine. `keeps_state`: state beside the cache by physical block or
slot (`new_state`), kept current from every KV write (`after_write`: Quest's key bounds), from each
prefill chunk's queries (`scores_prompt`, `observe_prompt`: SnapKV's prompt ranking, H2O's prompt
mass) or from the attention each decode read gives the tokens it reads (`reads_mass`,
`observe_read`: H2O's accumulated mass); one that reads keys to choose (`reads_keys`: SparQ's
approximate logits) gets the cache's keys by physical slot and the attention scale (`keys`,
`scaling`).

`pick(query [B, Hq, D], kv_heads, state (or None), block_table [B, W], seq_lens [B],
block_size, budget, step)` (`step`: a dict shared by one forward's layers, for what a selector
computes once per batch) returns each request's logical token positions `[B, Hkv, K]` (int32),
which the sparse decode kernel reads through the block table, and how many count per (request,
KV head) `[B, Hkv]`, with fixed shapes and no host sync, so a decode step runs inside vLLM's CUDA
graphs. A selector that `frees_blocks` also says, by a rule of a request's lengths alone, which
of its blocks no later query reads (`unread_blocks`: StreamingLLM's outside its sinks and
window; SnapKV's, H2O's and the learned selector's outside the slots their kept tokens were
compacted into at the prompt's end), so that vLLM's scheduler can hand them back to the pool
(`atskv.runtime.vllm.freeing`). Pure torch plus atskv's kernels:
tested on the CPU against the same selectors over an unpaged cache, without vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from atskv.attention import check_prompt_sample
from atskv.kernels.budget import kept_count
from atskv.kernels.paged import (
    empty_page_bounds,
    paged_page_scores,
    sink_recent_positions,
    update_page_bounds,
)
from atskv.kernels.quest_decode import quest_pick
from atskv.kernels.sparq_decode import channel_rank, sparq_decode_paged
from atskv.kernels.sparse_decode import sparse_decode_attention
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.heavy_hitters import KeptLists, chunk_mass, compacted_unread_blocks
from atskv.runtime.vllm.learned import PagedLearned
from atskv.runtime.vllm.prompt_ranks import (
    PromptRanks,
    compacted_ranking_unread_blocks,
    read_share,
    top_newest_first,
    window_votes,
)
from atskv.runtime.vllm.protocol import PagedSelector


@dataclass
class PagedQuest(PagedSelector):
    """Quest (Tang et al., 2024) with vLLM's cache blocks as its pages: the pages of highest key
    bound for this query, their newest tokens first, cut at the budget (`atskv.kernels.quest_decode`,
    as on atskv's fast path). Query-aware: nothing is evicted, every block stays reachable."""

    name: ClassVar[str] = "quest"
    keeps_state: ClassVar[bool] = True  # frees no block: any block may be the next query's best
    query_aware: ClassVar[bool] = True

    def new_state(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype, device):
        """The key bounds of every block (and a row for padding tokens' writes)."""
        return empty_page_bounds(num_blocks, kv_heads, head_size, dtype, device)

    def after_write(self, state, key, slot_mapping, block_size: int) -> None:
        update_page_bounds(*state, key, slot_mapping, block_size)

    def pick(self, query, kv_heads: int, state, block_table, seq_lens, block_size: int, budget: int | float,
             step: dict | None = None):  # fmt: skip
        width = block_table.shape[1]
        slots = width * block_size
        scores = paged_page_scores(query, *state, block_table, seq_lens, block_size)
        n_pages = min(width, math.ceil(kept_count(budget, slots) / block_size) + 2)  # the widest request's
        step = {} if step is None else step
        if "positions" not in step:  # the batch's usable slots, the same in every layer
            step["positions"] = usable_positions(seq_lens, slots)
        positions = step["positions"]
        return quest_pick(scores, positions.expand(-1, kv_heads, -1), budget, seq_lens, n_pages, block_size)


def usable_positions(seq_lens: torch.Tensor, slots: int) -> torch.Tensor:
    """`[B, 1, slots]` int32: each logical slot's position where the request holds a token, else -1
    (Quest's pick takes it as what may be read)."""
    at = torch.arange(slots, device=seq_lens.device, dtype=torch.int32)
    return torch.where(at < seq_lens.view(-1, 1), at, -1).unsqueeze(1)


@dataclass
class PagedSparQ(PagedSelector):
    """SparQ (Ribar et al., 2024) as atskv's `sparq` chooses: each query head's approximate logits
    on its r largest |q| channels (r = `rank_fraction` of the head size), pooled over the GQA group,
    then the exact top budget (`recent`: the newest positions first). Query-aware, nothing evicted.
    The channels are read from vLLM's cache in place (`atskv.kernels.sparq_decode.sparq_decode_paged`):
    no channel-major copy (it would cost half the KV cache again, outside vLLM's budget), so a step
    reads all of the keys (whole rows, coalesced), as dense attention does, and its win is the values."""

    name: ClassVar[str] = "sparq"
    reads_keys: ClassVar[bool] = True
    query_aware: ClassVar[bool] = True
    picks_among: ClassVar[bool] = True
    rank_fraction: float = 1 / 8
    recent: int = 0

    def pick(self, query, kv_heads: int, state, block_table, seq_lens, block_size: int, budget: int | float,
             step: dict | None = None, *, keys: torch.Tensor, scaling: float):  # fmt: skip
        slots = block_table.shape[1] * block_size
        step = {} if step is None else step
        if "positions" not in step:
            step["positions"] = usable_positions(seq_lens, slots)
        return sparq_decode_paged(query, keys, block_table, block_size, step["positions"], seq_lens, scaling,
                                  self.rank(query.shape[-1]), budget, kept_count(budget, slots),
                                  recent=self.recent)  # fmt: skip

    def pick_among(self, query, positions, counts, block_table, seq_lens, block_size: int, budget: int | float, *,
                   keys: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """SparQ's choice among each row's first `counts` `positions` `[B, Hkv, K]` (a composition's
        residents; the budget's base is still the request's length): the chosen entries' indices
        into `positions` and how many count. `recent` is not applied here (the residents carry
        their own window)."""
        listed = torch.arange(positions.shape[-1], device=positions.device) < counts.unsqueeze(-1)
        k = min(positions.shape[-1], kept_count(budget, block_table.shape[1] * block_size))
        return sparq_decode_paged(query, keys, block_table, block_size, torch.where(listed, positions, -1), seq_lens,
                                  scaling, self.rank(query.shape[-1]), budget, k)  # fmt: skip

    def rank(self, head_size: int) -> int:
        return channel_rank(head_size, self.rank_fraction)


@dataclass
class PagedStreamingLLM(PagedSelector):
    """StreamingLLM (Xiao et al., 2024): the first `sinks` tokens and the most recent ones, up to
    the budget, as atskv's `streaming_llm` keeps them; here a read restriction (the rest stays in
    vLLM's blocks)."""

    name: ClassVar[str] = "streaming_llm"
    frees_blocks: ClassVar[bool] = True
    sinks: int = 4

    def pick(self, query, kv_heads: int, state, block_table, seq_lens, block_size: int, budget: int | float,
             step: dict | None = None):  # fmt: skip
        width = kept_count(budget, block_table.shape[1] * block_size)  # what the widest request keeps
        return sink_recent_positions(seq_lens, budget, self.sinks, width, kv_heads)

    def unread_blocks(self, processed: int, prompt: int, budget: int | float, block_size: int) -> range:
        """The logical blocks of a request no query after its first `processed` tokens reads: those
        wholly between the sinks and the recent window, once the prompt is in (its prefill is
        vLLM's, dense). The window's start never moves back as the request grows, so what is freed
        stays unread; one token of margin covers the kernel's float32 budget rounding."""
        if processed < prompt:
            return range(0)
        context = processed + 1  # the next query's, the shortest any later query has
        kept = kept_count(budget, context)
        window_start = context - kept + min(kept, self.sinks) - 1
        return range(-(-self.sinks // block_size), max(0, window_start) // block_size)


@dataclass
class PagedSnapKV(PagedSelector):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
    arXiv:2404.14469), as atskv's `snapkv` scores and keeps: the attention of the prompt's last
    `window` queries, summed over them and the group's heads and max-pooled over `kernel` tokens,
    ranks the tokens before them; a decode query reads the window, every generated token and the
    best-ranked prompt tokens, up to its budget (here a read restriction: the rest stays in vLLM's
    blocks, or with `free_blocks` goes back to its pool once the best are compacted). Each prefill
    chunk ranks the request's tokens so far from its own last queries, so the prompt's last chunk
    decides; a last chunk shorter than `window` votes with its own queries only.
    Defaults from the paper's code: window 32, kernel 7."""

    name: ClassVar[str] = "snapkv"
    keeps_state: ClassVar[bool] = True
    scores_prompt: ClassVar[bool] = True
    takes_prompt_lse: ClassVar[bool] = True  # the window's votes: its queries' received mass (`window_votes`)
    frees_blocks: ClassVar[bool] = True  # its best-ranked tokens compacted at the prompt's end (`PromptRanks.compact`)
    window: int = 32
    kernel: int = 7

    def new_state(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype, device):
        """The prompt ranking by physical slot: 4 bytes a token per KV head (its KV: 2 x head_size x 2)."""
        return PromptRanks.empty(num_blocks * block_size, kv_heads, device)

    def observe_prompt(self, state: PromptRanks, chunk: PromptChunk) -> None:
        """One request's chunk: its last `window` queries vote for its tokens so far (nothing at a
        chunk known not to end the prompt: the last one's ranking replaces it)."""
        if not chunk.last:
            return
        length = chunk.length
        w = min(self.window, chunk.queries.shape[0], length)
        votes = window_votes(chunk, w, self.kernel)
        order = top_newest_first(votes[:, : length - w], read_share(chunk.budget, length, length - w))
        state.store(chunk.table_row, chunk.block_size, order, length - w)
        if chunk.compact:
            state.compact(chunk, order)

    def pick(self, query, kv_heads: int, state: PromptRanks, block_table, seq_lens, block_size: int,
             budget: int | float, step: dict | None = None):  # fmt: skip
        width = kept_count(budget, block_table.shape[1] * block_size)  # what the widest request reads
        return state.read(block_table, seq_lens, block_size, budget, width)

    def unread_blocks(self, processed: int, prompt: int, budget: int | float, block_size: int) -> range:
        return compacted_ranking_unread_blocks(processed, prompt, budget, block_size, self.window)


@dataclass
class PagedH2O(PagedSelector):
    """H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", arXiv:2306.14048), as atskv's `h2o` keeps: the prompt's attention mass from
    all its queries, then each decode query's on what it reads, accumulated per token and KV head;
    the newest `recent_fraction` of the budget and the heaviest hitters are kept, and a token once
    dropped is never read again (here a read restriction: its KV stays in vLLM's blocks). Default
    from the paper: half the budget recent (`atskv.runtime.vllm.heavy_hitters`)."""

    name: ClassVar[str] = "h2o"
    keeps_state: ClassVar[bool] = True
    scores_prompt: ClassVar[bool] = True
    takes_prompt_lse: ClassVar[bool] = True
    reads_mass: ClassVar[bool] = True
    picks_in_order: ClassVar[bool] = True
    frees_blocks: ClassVar[bool] = True  # its kept tokens compacted at the prompt's end (`KeptLists.compact`)
    recent_fraction: float = 0.5
    prompt_sample: int = 1  # score the prompt with every s-th query (`chunk_mass`)

    def __post_init__(self):
        check_prompt_sample(self.prompt_sample)

    def new_state(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype, device):
        """The kept lists and the prompt's mass by physical slot: 12 bytes a token per KV head."""
        return KeptLists.empty(num_blocks * block_size, kv_heads, device)

    def observe_prompt(self, state: KeptLists, chunk: PromptChunk) -> None:
        """One request's chunk: its queries' mass on every token so far, added; the list rebuilt
        (at the prompt's last chunk, where that is known)."""
        mass = state.add_prompt_mass(chunk_mass(chunk, self.prompt_sample), chunk.queries.shape[0], chunk)
        if chunk.last:
            state.keep_top(mass, chunk, self.recent_fraction)

    def pick(self, query, kv_heads: int, state: KeptLists, block_table, seq_lens, block_size: int,
             budget: int | float, step: dict | None = None):  # fmt: skip
        return state.step(block_table, seq_lens, block_size, budget, self.recent_fraction, new_value=0.0)

    def observe_read(self, state: KeptLists, mass, block_table, seq_lens, block_size: int) -> None:
        state.add_read_mass(mass, block_table, seq_lens, block_size)

    def unread_blocks(self, processed: int, prompt: int, budget: int | float, block_size: int) -> range:
        return compacted_unread_blocks(processed, prompt, budget, block_size, self.recent_fraction)


PAGED_SELECTORS = {cls.name: cls for cls in (PagedQuest, PagedSparQ, PagedStreamingLLM, PagedSnapKV, PagedH2O,
                                                PagedLearned)}


def slot_view(cache: torch.Tensor, requests: int) -> torch.Tensor:
    """A paged cache `[num_blocks, block_size, Hkv, D]` (any strides that merge blocks and tokens) as
    the sparse decode kernel's `[B, Hkv, num_slots, D]`, in place: every request sees all slots."""
    blocks, size, heads, dim = cache.shape
    if cache.stride(0) != size * cache.stride(1):
        raise ValueError(
            "atskv's vLLM plugin reads the KV cache by slot and needs vLLM's NHD layout "
            f"(blocks, tokens, heads, dim); got strides {cache.stride()}: unset VLLM_KV_CACHE_LAYOUT"
        )
    slots = cache.as_strided((blocks * size, heads, dim), (cache.stride(1), cache.stride(2), cache.stride(3)))
    return slots.transpose(0, 1).unsqueeze(0).expand(requests, heads, blocks * size, dim)


def paged_sparse_decode(query, key_cache, value_cache, positions, lengths, block_table, scale: float, out=None,
                        want_mass: bool = False):  # fmt: skip
    """Each request's decode query `[B, Hq, D]` over its picked token `positions` in the paged caches
    `[num_blocks, block_size, Hkv, D]`: `[B, Hq, D]` (into `out` when given); with `want_mass`, and
    the probability each position received, summed over the group's heads, `[B, Hkv, K]`."""
    b = query.shape[0]
    keys, values = slot_view(key_cache, b), slot_view(value_cache, b)
    return sparse_decode_attention(query, keys, values, positions, lengths, scale, block_table=block_table,
                                   block_size=key_cache.shape[1], out=out, want_mass=want_mass)  # fmt: skip
