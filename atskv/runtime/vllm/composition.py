"""Compositions inside vLLM, as atskv's `HybridSelector` composes them (`learned+sparq`,
`h2o+sparq`, `snapkv+sparq`, `streaming_llm+sparq`): the residency part keeps its tokens at the
residency budget (`residency_budget`; default `RESIDENCY_FACTOR` times the budget, atskv's rule),
the attention part chooses among them for each query at the budget. Both are read restrictions
here: what the residency saves is the attention part's work, SparQ scoring the residents' keys
rather than the whole context's, and with `free_blocks` the blocks the residents do not hold
(`freeing_rule`: the residency part's rule at the residency budget).

`build_paged_selector` builds a plugin selector by name, one or a composition, checking its
options (a composition's: each part's under the part's name, and `residency_budget`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch

from atskv.errors import InputError, check_options
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.protocol import PagedSelector, check_plugin_budget

RESIDENCY_FACTOR = 4  # atskv.selectors.hybrid's (that module imports transformers; a test keeps them equal)


def residency_budget(budget: int | float, given: int | float | None) -> int | float:
    """What the residency part keeps: `given`, else `RESIDENCY_FACTOR` times `budget` (a fraction at most 1)."""
    if given is not None:
        return given
    return min(1.0, budget * RESIDENCY_FACTOR) if isinstance(budget, float) else budget * RESIDENCY_FACTOR


@dataclass
class PagedComposition(PagedSelector):
    """`residency`: a selector that keeps one set of tokens (not query-aware); `attention`: one
    that `picks_among` given positions (SparQ)."""

    residency: PagedSelector
    attention: PagedSelector
    residency_budget: int | float | None = None

    def __post_init__(self):
        if self.residency.query_aware:
            raise InputError(f"atskv: {self.residency.name} chooses per query; a composition's first part keeps one "
                             "set of tokens (h2o, learned, snapkv, streaming_llm)")  # fmt: skip
        if not self.attention.picks_among:
            raise InputError(f"atskv: {self.attention.name} cannot choose among a composition's residents; "
                             "its second part is sparq")  # fmt: skip
        if self.residency_budget is not None:
            check_plugin_budget(self.residency_budget, "residency_budget")
        self.name = f"{self.residency.name}+{self.attention.name}"
        self.keeps_state, self.scores_prompt = self.residency.keeps_state, self.residency.scores_prompt
        self.takes_prompt_lse, self.picks_in_order = self.residency.takes_prompt_lse, self.residency.picks_in_order
        self.reads_mass, self.reads_keys, self.query_aware = self.residency.reads_mass, True, True
        self.frees_blocks = self.residency.frees_blocks  # the residents' rule, at the residency budget
        self._chosen = None  # the last pick's entries of the residents' list, for `observe_read`

    def new_state(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype, device):
        self.residency.kv_shard = self.kv_shard  # the learned part scores this GPU's heads as the model's
        return self.residency.new_state(num_blocks, block_size, kv_heads, head_size, dtype, device)

    def after_write(self, state, key, slot_mapping, block_size: int) -> None:
        self.residency.after_write(state, key, slot_mapping, block_size)

    def observe_prompt(self, state, chunk: PromptChunk) -> None:
        held = residency_budget(chunk.budget, self.residency_budget)
        self.residency.observe_prompt(state, dataclasses.replace(chunk, budget=held))

    def pick(self, query, kv_heads: int, state, block_table, seq_lens, block_size: int, budget: int | float,
             step: dict | None = None, *, keys: torch.Tensor, scaling: float):  # fmt: skip
        held = residency_budget(budget, self.residency_budget)
        self.residency.layer = self.attention.layer = self.layer
        self.residency.later_states = self.later_states
        residents, counts = self.residency.pick(query, kv_heads, state, block_table, seq_lens, block_size, held, step)
        chosen, lengths = self.attention.pick_among(query, residents, counts, block_table, seq_lens, block_size,
                                                    budget, keys=keys, scaling=scaling)  # fmt: skip
        self._chosen = (chosen.long(), lengths, residents.shape[-1])
        return residents.gather(2, chosen.long()), lengths

    def observe_read(self, state, mass, block_table, seq_lens, block_size: int) -> None:
        """The read's mass `[B, Hkv, K]` handed to the residency part by its own list entries."""
        chosen, lengths, width = self._chosen
        counted = torch.arange(chosen.shape[-1], device=mass.device) < lengths.unsqueeze(-1)
        by_entry = mass.new_zeros(*chosen.shape[:2], width).scatter_add_(2, chosen, torch.where(counted, mass, 0.0))
        self.residency.observe_read(state, by_entry, block_table, seq_lens, block_size)


def paged_selector_parts(name: str) -> list[str]:
    """The plugin's selectors `name` is made of (one, or a composition's two), or an `InputError`
    naming those it has; checks names only, builds nothing."""
    from atskv.runtime.vllm.selection import PAGED_SELECTORS

    parts = name.split("+")
    if len(parts) > 2 or not all(p in PAGED_SELECTORS for p in parts):
        raise InputError(f"atskv's vLLM plugin has no selector {name!r}; it has: {', '.join(sorted(PAGED_SELECTORS))} "
                         "and compositions <residency>+sparq (e.g. learned+sparq)")  # fmt: skip
    return parts


def freeing_rule(name: str, options: dict):
    """`unread_blocks(processed, prompt, budget, block_size)` of the plugin's selector `name` with
    `options` (`frees_blocks`), for vLLM's scheduler: a composition's is its residency part's at
    the residency budget (what the residents' lists hold; the attention part reads among them)."""
    from atskv.runtime.vllm.selection import PAGED_SELECTORS

    parts = paged_selector_parts(name)
    if len(parts) == 1:
        return PAGED_SELECTORS[name].freeing_rule(options)
    rule, given = PAGED_SELECTORS[parts[0]].freeing_rule(options.get(parts[0]) or {}), options.get("residency_budget")
    return lambda processed, prompt, budget, block_size: rule(processed, prompt, residency_budget(budget, given),
                                                              block_size)  # fmt: skip


def build_paged_selector(name: str, options: dict | None) -> PagedSelector:
    """The plugin's selector `name` (a registered one, or `<residency>+<attention>`) with `options`,
    or an `InputError` naming what is wrong (an unknown name or option, parts that cannot play
    their roles, the selector's own checks)."""
    from atskv.runtime.vllm.selection import PAGED_SELECTORS  # its registry imports this module's users

    options = dict(options or {})
    parts = paged_selector_parts(name)
    if len(parts) == 1:
        check_options(f"atskv's {name}", options, [f.name for f in fields(PAGED_SELECTORS[name])])
        return PAGED_SELECTORS[name](**options)
    check_options(f"atskv's {name}", options, [*parts, "residency_budget"])
    built = [build_paged_selector(p, options.get(p)) for p in parts]
    return PagedComposition(*built, residency_budget=options.get("residency_budget"))
