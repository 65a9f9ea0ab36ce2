"""Kept tokens and what eviction ranks them by, beside vLLM's paged cache by physical slot: an
evicting selector (H2O, the learned selector) run as a read restriction, with no request identity
and a decode step of fixed shapes (vLLM's CUDA graphs).

As `atskv.runtime.vllm.prompt_ranks` keeps a ranking, a request's kept list lives in its own slots:
its j-th kept position and that token's value (H2O: its accumulated attention mass; the learned
selector: its score) at its j-th logical slot (its block table maps it to a physical one). How many
it holds follows from its length alone (the budget at that context), so no count is stored. The
prompt's mass accumulates by position over the prefill chunks (each chunk's queries add what they
give every token so far, its own tokens start at 0), and each chunk rebuilds the list, so the last
chunk's stands, as a dense prefill's eviction leaves it. A decode step then holds one token more
than its budget at most: the new one enters the list, and when the budget did not grow the lowest
(value, position) leaves, its entry taking the new token; H2O then adds the mass the read gave
each kept token. Blocks a request gets are its own until it finishes (prefix caching is refused
with a selector that scores the prompt); every write of a row past its list (a short request in a
wide batch, vLLM's padded rows of length 0) goes to a spare last row. With `free_blocks` the list
is compacted where the prompt ends (`KeptLists.compact`): the kept tokens move into the request's
first slots, and the blocks between them and the recent window go back to vLLM's pool
(`compacted_unread_blocks`, a rule of the prompt's length that vLLM's scheduler applies); the
list's own entries then leave those blocks too (`moved`: another request may get them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.attention import sampled_queries
from atskv.kernels.budget import kept_count
from atskv.kernels.kept_lists import NOT_MOVED, add_list_values, kept_list_step
from atskv.runtime.vllm.batch import PromptChunk, prompt_end
from atskv.runtime.vllm.prompt_ranks import top_newest_first


@dataclass
class KeptLists:
    """`[num_slots + 1, Hkv]` each (the last row a sink for masked writes): `prompt_mass` (float32)
    the mass of the prompt token at each slot, `kept` (int32) and `kept_value` (float32) at a
    request's j-th logical slot its j-th kept position and what eviction ranks it by (H2O: its
    accumulated mass; the learned selector: its score); `moved` `[num_slots + 1, 2]` (int32) at a
    request's first slot, where a compacted list stores its entries (`compact`)."""

    prompt_mass: torch.Tensor
    kept: torch.Tensor
    kept_value: torch.Tensor
    moved: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, device) -> KeptLists:
        mass = torch.zeros(num_slots + 1, kv_heads, dtype=torch.float32, device=device)
        return cls(mass, torch.zeros(num_slots + 1, kv_heads, dtype=torch.int32, device=device), mass.clone(),
                   torch.zeros(num_slots + 1, 2, dtype=torch.int32, device=device))  # fmt: skip

    @property
    def spare(self) -> int:
        return self.kept.shape[0] - 1

    def add_prompt_mass(self, mass: torch.Tensor, new: int, chunk: PromptChunk) -> torch.Tensor:
        """One request's prefill chunk: `mass` `[Hkv, L]` its queries gave positions `0 .. L-1`, the
        last `new` of them written by this chunk, added to what earlier chunks gave; returns the
        total so far, `[Hkv, L]`."""
        at = chunk.slots(0, mass.shape[-1])
        so_far = self.prompt_mass[at].t()
        so_far[:, mass.shape[-1] - new :] = 0  # a fresh token: whatever an earlier tenant of its slot left
        so_far += mass
        self.prompt_mass[at] = so_far.t()
        return so_far

    def keep_top(self, values: torch.Tensor, chunk: PromptChunk, recent_fraction: float) -> None:
        """The request's list at length L from `values` `[Hkv, L]` (what eviction ranks by), as a
        dense prefill's eviction would leave it: the newest `recent_fraction` of the budget, then the
        highest values (ties to the newer token)."""
        length = values.shape[-1]
        count = kept_count(chunk.budget, length)
        window = recent_window(count, recent_fraction)
        recent = torch.arange(length, device=values.device) > length - 1 - window
        order = top_newest_first(torch.where(recent, torch.inf, values), count)  # [Hkv, count]
        at = chunk.slots(0, count)
        self.kept[at] = order.t().int()
        self.kept_value[at] = values.gather(1, order).t()
        self.store_moved(chunk, NOT_MOVED, 0)
        if chunk.compact:
            self.compact(chunk, order, window)

    def store_moved(self, chunk: PromptChunk, split: int, shift: int) -> None:
        """The request's list layout (`moved`) at its first slot, by fills (a host int copied over
        would sync)."""
        first = chunk.table_row[:1].long() * chunk.block_size
        self.moved[:, 0].index_fill_(0, first, split)
        self.moved[:, 1].index_fill_(0, first, shift)

    def compact(self, chunk: PromptChunk, order: torch.Tensor, window: int) -> None:
        """`free_blocks` for an evicting selector: the request's kept tokens outside the recent
        window (`order[:, window:]`, `[Hkv, n]` positions), in position order per KV head, move
        into its first `n` slots (KV head h's j-th into slot j of head h: heads attend apart, keys
        carry their rotary positions), and the list's first `n` entries name those slots. Its
        other entries (the window's, then the tokens that join it later) are stored from the
        window's first slot on (`moved`: split `n`, shift `L - count`). Every kept token and every
        entry then lies in the request's first blocks, its recent window or after it, so the
        blocks between hold nothing a later query reads or a list step writes
        (`compacted_unread_blocks`). Ties and recency compare slots as they compared positions:
        the moved tokens keep their order, all below the window's. Only at the prompt's end (a
        chunk after it would read the moved slots as positions); the prompt's per-slot mass is not
        moved (nothing reads it after the prompt)."""
        hitters, rank = order[:, window:].sort(dim=-1)
        heads, n = hitters.shape
        length, count = chunk.length, order.shape[1]
        listed = self.kept_value[chunk.slots(0, count)].t()  # [Hkv, count], in `order`'s order
        if n:
            chunk.move_to_front(hitters)
        front, recent = chunk.slots(0, n), chunk.slots(length - window, length)  # disjoint: count <= length
        self.kept[front] = torch.arange(n, device=hitters.device, dtype=torch.int32).view(-1, 1).expand(n, heads)
        self.kept_value[front] = listed[:, window:].gather(1, rank).t()
        self.kept[recent] = order[:, :window].t().int()
        self.kept_value[recent] = listed[:, :window].t()
        self.store_moved(chunk, n, length - count)

    def step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, budget: int | float,
             recent_fraction: float, new_value: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A decode step: the new token (position `seq_len - 1`, value `new_value`) enters each
        list, the lowest-valued one leaves it if the budget did not grow (the newest
        `recent_fraction` of the budget never does). Positions `[B, Hkv, width]` and counts
        `[B, Hkv]` to read (`width`: the list of a request as wide as the block table, plus its new
        token: the same for every step of a batch size, so one CUDA graph serves them); one kernel
        (`atskv.kernels.kept_lists`)."""
        slots = block_table.shape[1] * block_size
        width = min(slots, kept_count(budget, slots) + 1)
        return kept_list_step(self.kept, self.kept_value, block_table, seq_lens, block_size, budget, recent_fraction,
                              new_value, width, self.moved)  # fmt: skip

    def add_read_mass(self, mass: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      block_size: int) -> None:  # fmt: skip
        """After a step's read: the mass `[B, Hkv, width]` each listed token received, added to its value
        (entries past a list get what the read gave them, nothing that counts: an entry joins a
        list only as a new token, its value reset)."""
        add_list_values(self.kept_value, mass, block_table, seq_lens, block_size, self.moved)


def recent_window(count: int, recent_fraction: float) -> int:
    """The newest `recent_fraction` of a list of `count` (float32, as the decode step rounds it)."""
    return int((torch.tensor(count) * recent_fraction).long())


def compacted_unread_blocks(processed: int, prompt: int, budget: int | float, block_size: int,
                            recent_fraction: float) -> range:  # fmt: skip
    """The logical blocks of a request no later query reads once its kept lists are compacted
    (`KeptLists.compact`): those after its first `count - window` slots (where the moved tokens
    lie) and before its recent window, once the prompt is in. The list is ranked and compacted
    at the chunk that reaches the prompt's last `PROMPT_TAIL` tokens, at a length up to that much
    short of the prompt, so the window may start that much earlier; the moved tokens are fewer
    there, never more."""
    if processed < prompt:
        return range(0)
    count = kept_count(budget, prompt)
    window = recent_window(count, recent_fraction)
    return range(-(-(count - window) // block_size), max(0, prompt_end(prompt) - window) // block_size)


def chunk_mass(chunk: PromptChunk, sample: int = 1) -> torch.Tensor:
    """`[Hkv, L]` float32: the attention mass a prefill chunk's queries `[n, Hq, D]` (positions
    `L - n .. L - 1`, causal) give each of the request's `L` tokens so far, summed over the queries
    and the group's heads (`PromptChunk.received_mass`). `sample` s > 1 estimates it from every
    s-th query (the chunk's last among them) times s: the kernel's pass over the keys costs 1/s,
    and a token seen by fewer than s queries gets a coarse estimate
    (`atskv.attention.check_prompt_sample`)."""
    return chunk.received_mass(sampled_queries(chunk.queries.shape[0], sample)) * sample
