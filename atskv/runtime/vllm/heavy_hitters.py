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
wide batch, vLLM's padded rows of length 0) goes to a spare last row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atskv.attention import prefix_causal_attention
from atskv.kernels.budget import kept_count, kept_tokens
from atskv.kernels.paged import physical_slots
from atskv.kernels.received_mass import prefix_received_mass
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.prompt_ranks import rank_newest_first


@dataclass
class KeptLists:
    """`[num_slots + 1, Hkv]` each (the last row a sink for masked writes): `prompt_mass` (float32)
    the mass of the prompt token at each slot, `kept` (int32) and `kept_value` (float32) at a
    request's j-th logical slot its j-th kept position and what eviction ranks it by (H2O: its
    accumulated mass; the learned selector: its score)."""

    prompt_mass: torch.Tensor
    kept: torch.Tensor
    kept_value: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, device) -> KeptLists:
        mass = torch.zeros(num_slots + 1, kv_heads, dtype=torch.float32, device=device)
        return cls(mass, torch.zeros(num_slots + 1, kv_heads, dtype=torch.int32, device=device), mass.clone())

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
        window = int((torch.tensor(count) * recent_fraction).long())  # the decode step's float32 rounding
        recent = torch.arange(length, device=values.device) > length - 1 - window
        order = rank_newest_first(torch.where(recent, torch.inf, values))[:, :count]  # [Hkv, count]
        at = chunk.slots(0, count)
        self.kept[at] = order.t().int()
        self.kept_value[at] = values.gather(1, order).t()

    def step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, budget: int | float,
             recent_fraction: float, new_value: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A decode step: the new token (position `seq_len - 1`, value `new_value`) enters each
        list, the lowest-valued one leaves it if the budget did not grow (the newest
        `recent_fraction` of the budget never does). Positions `[B, Hkv, width]` and counts
        `[B, Hkv]` to read (`width`: the list of a request as wide as the block table, plus its new
        token: the same for every step of a batch size, so one CUDA graph serves them)."""
        b, heads = block_table.shape[0], self.kept.shape[1]
        slots = block_table.shape[1] * block_size
        at, j = self._list_slots(block_table, seq_lens, block_size, min(slots, kept_count(budget, slots) + 1))
        context = seq_lens.long().view(b, 1, 1)
        held, count = kept_tokens(budget, (context - 1).clamp(min=0)), kept_tokens(budget, context)
        positions, value = self.kept[at].transpose(1, 2), self.kept_value[at].transpose(1, 2)  # [B, Hkv, width]
        newest = context - 1
        positions = torch.where(j == held, newest, positions)  # the new token's entry, after the held ones
        value = torch.where(j == held, new_value, value)
        listed = j <= held
        recent = positions > newest - (count * recent_fraction).long()
        score = torch.where(listed, torch.where(recent, torch.inf, value), torch.inf)
        lowest = listed & (score == score.amin(-1, keepdim=True))
        victim = torch.where(lowest, positions, torch.iinfo(torch.int32).max).argmin(-1, keepdim=True)
        target = torch.where(count > held, held, victim)  # [B, Hkv, 1]: where the new token goes
        positions = torch.where(j == target, newest, positions)
        kept = j < count
        flat = _by_head(at.unsqueeze(1).expand(-1, heads, -1).gather(2, target))  # a row's own slot, or the spare
        self.kept.view(-1).index_put_((flat,), newest.expand(-1, heads, -1).reshape(-1).int())
        self.kept_value.view(-1).index_put_((flat,), torch.full_like(flat, new_value, dtype=torch.float32))
        return torch.where(kept, positions, 0).int(), count.view(b, 1).expand(b, heads).int()

    def add_read_mass(self, mass: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      block_size: int) -> None:  # fmt: skip
        """After a step's read: the mass `[B, Hkv, width]` each listed token received, added to its value
        (entries past a list get what the read gave them, nothing that counts: an entry joins a
        list only as a new token, its mass reset)."""
        b, heads, width = mass.shape
        at = self._list_slots(block_table, seq_lens, block_size, width)[0]
        flat = _by_head(at.unsqueeze(1).expand(-1, heads, -1))
        self.kept_value.view(-1).index_put_((flat,), mass.reshape(-1), accumulate=True)

    def _list_slots(self, block_table, seq_lens, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical slots `[B, width]` of each request's first `width` logical slots (the spare row
        past its length) and the list index `[1, 1, width]`."""
        b = block_table.shape[0]
        j = torch.arange(width, device=block_table.device)
        at = physical_slots(j.view(1, 1, -1).expand(b, 1, -1), block_table, block_size).view(b, width).long()
        at = torch.where(j.view(1, -1) < seq_lens.long().view(b, 1), at, self.spare)
        return at, j.view(1, 1, -1)


def _by_head(slots: torch.Tensor) -> torch.Tensor:
    """Flat indices into a `[num_slots + 1, Hkv]` tensor of `slots` `[B, Hkv, K]` (each KV head's own
    column), in `slots`' order."""
    heads = slots.shape[1]
    return (slots * heads + torch.arange(heads, device=slots.device).view(1, -1, 1)).reshape(-1)


def chunk_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """`[Hkv, L]` float32: the attention mass a prefill chunk's queries `[n, Hq, D]` (positions
    `L - n .. L - 1`, causal) give each of the request's tokens so far, `keys` `[Hkv, L, D]`, summed
    over the queries and the group's heads: their log-sum-exps from a flash pass (the keys stand in
    for the values, which it does not need), then atskv's received-mass kernel."""
    n, length = queries.shape[0], keys.shape[1]
    q, k = queries.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0)
    _, lse = prefix_causal_attention(q, k, k, length - n, scaling)
    return prefix_received_mass(q, k, lse.float(), length - n, scaling)[0]
