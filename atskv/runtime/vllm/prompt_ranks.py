"""A prompt's tokens ranked once, kept beside vLLM's paged cache by physical slot: what a selector
that scores the prompt at prefill (SnapKV) reads at every decode step, without a request identity.

vLLM's attention metadata names no request, only its block table, and a decode step must run inside
a CUDA graph (no host sync, fixed shapes). So the ranking lives where the request's own tokens do:
the j-th best prompt position is stored at the request's j-th logical slot (its block table maps it
to a physical one, as it maps its keys), and where its observation window starts at its first slot.
Blocks a request gets are its own until it finishes (prefix caching, which shares them, is refused
with a prompt-scoring selector), and a block's next tenant overwrites what it reads before it reads
it: every prefill chunk ranks the request's tokens so far anew, the last chunk's ranking stands.
With `free_blocks` the best-ranked tokens are compacted into the request's first slots where the
prompt ends (`PromptRanks.compact`), and the blocks between them and the window go back to vLLM's
pool (`compacted_ranking_unread_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atskv.kernels.budget import kept_count, kept_tokens
from atskv.kernels.paged import physical_slots, request_slots
from atskv.runtime.vllm.batch import PromptChunk, prompt_end


@dataclass
class PromptRanks:
    """`ranked` `[num_slots, Hkv]` int32: at a request's j-th logical slot, its j-th best prompt
    position per KV head; `window_start` `[num_slots]` int32: at its first slot, the first position
    of its observation window (that and every later token is always read)."""

    ranked: torch.Tensor
    window_start: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, device) -> PromptRanks:
        return cls(torch.zeros(num_slots, kv_heads, dtype=torch.int32, device=device),
                   torch.zeros(num_slots, dtype=torch.int32, device=device))  # fmt: skip

    def store(self, table_row: torch.Tensor, block_size: int, order: torch.Tensor, window_start: int) -> None:
        """One request's ranking `order` `[Hkv, n]` (its `n` best positions before `window_start`,
        best first: `read_share`'s worth) into its first `n` slots."""
        self.ranked[request_slots(table_row, block_size, order.shape[1])] = order.t().int()
        # at the request's first slot; a fill (assigning a host int would copy it over: a host sync)
        self.window_start.index_fill_(0, table_row[:1].long() * block_size, window_start)

    def compact(self, chunk: PromptChunk, order: torch.Tensor) -> None:
        """`free_blocks`: the best-ranked prompt tokens any later query of the request reads
        (`order` `[Hkv, take]`, `read_share`'s), KV head h's j-th best moved into the request's
        slot j of head h, and the ranking then naming those slots (`ranked[j] = j`). Every token
        read later then lies in the request's first blocks, the window or after it
        (`compacted_ranking_unread_blocks`). Only where the prompt ends."""
        take = order.shape[1]
        if take == 0:
            return
        chunk.move_to_front(order)
        ranks = torch.arange(take, device=order.device, dtype=torch.int32)
        self.ranked[chunk.slots(0, take)] = ranks.view(-1, 1).expand(take, order.shape[0])

    def read(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, budget: int | float,
             width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Positions `[B, Hkv, width]` and counts `[B, Hkv]` each decode query reads: its budget's
        worth, the window and every later token first (the newest, if the budget is smaller), then
        the best-ranked prompt positions; SnapKV's kept set, as atskv's evicting `snapkv` keeps it
        (its ranking fixed, the prompt's share shrinks as tokens are generated: nested sets)."""
        b, heads = block_table.shape[0], self.ranked.shape[1]
        j = torch.arange(width, device=block_table.device)
        start = self.window_start[block_table[:, 0].long() * block_size].long().view(b, 1)  # at each first slot
        context = seq_lens.long().view(b, 1)
        count = kept_tokens(budget, context)
        take = (count - (context - start)).clamp(min=0).minimum(start)  # prompt positions read
        at = physical_slots(j.view(1, 1, -1).expand(b, 1, -1), block_table, block_size).view(b, width).long()
        ranked = self.ranked[at].transpose(1, 2)  # [B, Hkv, width]
        newest = context - count + j.view(1, -1)  # the rest: the newest count - take tokens, in order
        positions = torch.where((j < take).unsqueeze(1), ranked, newest.unsqueeze(1))
        positions = torch.where((j < count).unsqueeze(1), positions, 0).int()
        return positions, count.expand(b, heads).int()


def read_share(budget: int | float, length: int, window_start: int) -> int:
    """How many of a ranking of `length` tokens' positions before `window_start` any later query
    reads: the first's (at context `length + 1`), since the prompt's share of the budget only
    shrinks as tokens are generated (`PromptRanks.read`)."""
    return min(window_start, max(0, kept_count(budget, length + 1) - (length + 1 - window_start)))


def compacted_ranking_unread_blocks(processed: int, prompt: int, budget: int | float, block_size: int,
                                    window: int) -> range:  # fmt: skip
    """The logical blocks of a request no later query reads once its ranking is compacted
    (`PromptRanks.compact`): those after the moved tokens' (at most the budget at the first
    query after the prompt) and before its observation window (at most `window` before where the
    prompt was ranked, at most `PROMPT_TAIL` before its end), once the prompt is in."""
    if processed < prompt:
        return range(0)
    return range(-(-kept_count(budget, prompt + 1) // block_size), max(0, prompt_end(prompt) - window) // block_size)


def window_votes(chunk: PromptChunk, w: int, kernel: int) -> torch.Tensor:
    """SnapKV's votes `[Hkv, length]` (float32) for the `length` tokens of one request, from its
    chunk's last `w` queries (at positions `length - w .. length - 1`, causal): their attention
    summed over them and the group's heads (the received mass of those queries,
    `PromptChunk.received_mass`: the keys read in place), max-pooled over `kernel` neighbours."""
    n = chunk.queries.shape[0]
    votes = chunk.received_mass(slice(n - w, n))
    return F.max_pool1d(votes.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


def top_newest_first(votes: torch.Tensor, count: int) -> torch.Tensor:
    """Positions `[Hkv, count]` of the `count` best `votes` `[Hkv, n]`, best first; equal votes
    (max-pooling's plateaus) go to the newer token, as `atskv.selectors.base.select_top_budget`
    breaks them. A top-k of one int64 key a token, its vote's bits (made to order as the float
    does) above its position: where a list keeps 5% of a prompt, a sort of every token is wasted
    work (sorts took ~50 ms of a 32K batch-8 prefill in vLLM, H100)."""
    n = votes.shape[-1]
    bits = (votes.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 ties with 0.0, as the floats do
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' bits reversed: int order = float order
    keys = (ordered.long() << 32) | torch.arange(n, device=votes.device)
    return keys.topk(min(count, n), dim=-1).indices
