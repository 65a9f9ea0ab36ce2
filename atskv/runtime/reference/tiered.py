"""`atskv.tiered`: generation with the KV of managed layers split between the GPU and the host.

Under `atskv.sparse` a selector decides what attention reads, and an evicting selector drops
the rest for good. Under `atskv.tiered` nothing is dropped: the active tier (GPU slots) holds at
most `budget` tokens per managed layer, row and KV head, the rest is parked in host memory, and
parked tokens come back when a query needs them. The selector (any that ranks tokens: the
learned one, H2O, SnapKV, Quest, ...) only supplies relevance; the `SparsityManager` turns it
into demotions with its adaptive thresholds, momentum and hard cap.

One attention call of a managed layer (`TieredSession.attend`):
1. every step attends over the whole active tier (dense over what is resident; a composition's
   decode step over its attention part's pick, see below); every
   `retrieve_every` decode steps (default: every step) the index is searched with the group's
   queries and the `retrieve` best parked candidates (by the attention probability each query
   head would give them: its logit minus its log-normaliser over the active tier) are fetched
   and attended directly in that step together with the active tier, one block at a time
   through a running softmax, so a token that left the GPU is still read by the query that
   needs it (a needle asked about right after the prompt);
2. every `refresh_every` tokens (and at the end of the prompt) the layer is rebalanced: the
   manager demotes active tokens by the selector's scores (they leave for the host) and promotes
   the fetched candidates whose attention mass in that step clears its promotion threshold, a
   quantile of the mass the active tokens received (attention mass is the one relevance scale
   that active tokens and freshly fetched ones share); room for them under the cap is made
   first, so they displace the least relevant active tokens.
The hard cap leaves `refresh_every` slots of headroom, so the tokens written between two
refreshes never push the active tier past `budget`.

A selector that drops slots whatever its budget (`Selector.unwanted`: a learned selector with a
`threshold`) keeps here what it keeps under `atskv.sparse`: the manager's momentum votes on what
the selector wants instead of its quantile, so the tier holds what the predictor wants (a
fine-tuned predictor's learned share per layer and KV head), `budget` then being a cap;
sinks and recent tokens stay. New tokens start at momentum 1.0 and need several refreshes below the
threshold to leave; `policy={"momentum": 0}` makes the predictor's verdict take effect at the end of
the prompt.

A composition `residency+attention` (`learned+sparq`, `atskv.selectors.hybrid`) keeps the meaning
its two budgets have under `atskv.sparse` and `atskv.generate`: `budget` is the attention budget,
the active tokens each decode query reads, picked by the attention part as `atskv.sparse` picks
them (`SparseSession.keep`: the part sees the active tier packed in position order); the
composition's residency budget (`residency_budget`, default `RESIDENCY_FACTOR` times `budget`) is
the active tier's cap, ranked for demotion by the residency part's scores. What `atskv.sparse`
would hold and evict the rest of, the tiered store holds on the GPU and parks the rest of, so a
composition at one budget holds at most as many tokens on the GPU and reads as many of them per
query in every runtime, and here a parked token can still come back: the retrieved candidates are
attended beside the attention part's pick (ranked by the normaliser over that pick), and promotion
compares their mass with what the active tokens received in the step (0 where not picked); by
default a composition retrieves a third of its attention budget (`composition_retrieve`). Why
not `budget` as the GPU tier: `learned+sparq` at 0.05 would then read 5% of the context per query
under `atskv.sparse` and a quarter of that here.

Choices the ATSKV proposal leaves open: a fractional budget is a fraction of the prompt, fixed when
the prompt arrives (the GPU pool does not grow with the generated text; a composition's attention
budget, which sizes no pool, stays a fraction of each query's context as elsewhere); the host tier holds
`max_tokens` (default: prompt + 1024) and is allocated when the prompt arrives, before any token
moves; attention reads the cached keys (a selector's approximate keys, SparK's, are not used).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from atskv.attention import StreamedAttention, attention_and_mass, grouped_queries, sdpa_attention
from atskv.budget import check_budget
from atskv.errors import check_options
from atskv.runtime.reference.host_tier import HostTier
from atskv.runtime.reference.retrieval import INDEXES, make_index
from atskv.runtime.reference.sparse import SparseSession, SparsityConfig, attach, reenterable, sparse
from atskv.runtime.reference.sparsity import INITIAL_MOMENTUM, LayerPolicy, SparsityBudget, SparsityManager
from atskv.runtime.reference.tiered_cache import MOMENTUM, TieredKVCache, TieredLayer
from atskv.selectors import resolve_selector
from atskv.selectors.base import LayerView, Selector
from atskv.selectors.hybrid import RESIDENCY_FACTOR

_REFRESHED_AT, _PROMPT = "tiered_refreshed_at", "tiered_prompt_tokens"


@dataclass(frozen=True)
class TieringConfig:
    """The active-tier budget and how tokens move. `budget`: GPU tokens per managed layer, row
    and KV head (int), or a fraction of the prompt; `retrieve`: parked candidates fetched per
    retrieval (int, 0: retrieval off), or a fraction of the prompt, every `retrieve_every` decode
    steps (default 1/8 of the prompt through the exact index: on Gemma 3 at 32K with a 10%
    budget that kept perplexity within about 1% of dense at a decode step faster than dense; a
    composition's default is a third of its attention budget, `composition_retrieve`);
    `index`: "lsh", "faiss" or "exact", built with `index_options`; `read_chunk`: candidates
    attended per block (what retrieval holds on the GPU at once); `normalise_heads`: rank
    candidates by attention probability (each query head's logits minus its log-normaliser)
    rather than raw logit; `host_path`: a folder for memory-mapped host tiers instead of pinned
    memory; `max_tokens`: the longest sequence the host tier holds; `policy`: the manager's
    `LayerPolicy`, or a dict of its fields."""

    budget: int | float
    refresh_every: int = 16
    retrieve: int | float = 0.125
    retrieve_every: int = 1
    read_chunk: int = 1024
    normalise_heads: bool = True
    index: str = "exact"
    index_options: dict = field(default_factory=dict)
    host_path: str | Path | None = None
    max_tokens: int | None = None
    sinks: int = 4
    recent: int = 64
    policy: LayerPolicy = LayerPolicy()

    def __post_init__(self):
        object.__setattr__(self, "budget", check_budget(self.budget))  # frozen; a NumPy count as its int
        if isinstance(self.policy, dict):
            check_options("the tiering policy", self.policy, [f.name for f in fields(LayerPolicy)])
            object.__setattr__(self, "policy", LayerPolicy(**self.policy))  # frozen
        elif not isinstance(self.policy, LayerPolicy):
            raise TypeError(f"policy must be a LayerPolicy or a dict of its fields, got {type(self.policy).__name__}")
        if self.refresh_every < 1 or self.retrieve_every < 1 or self.retrieve < 0 or self.read_chunk < 1:
            raise ValueError(
                "need refresh_every >= 1, retrieve_every >= 1, retrieve >= 0 and read_chunk >= 1, got "
                f"{self.refresh_every}, {self.retrieve_every}, {self.retrieve}, {self.read_chunk}"
            )
        if isinstance(self.retrieve, float) and not 0 < self.retrieve < 1:
            # the budget's rule (int: tokens, float: a fraction strictly between 0 and 1)
            raise ValueError(f"a fractional retrieve must lie strictly between 0 and 1, got {self.retrieve}")
        if self.index not in INDEXES:
            raise ValueError(f"unknown index {self.index!r}; choose one of: {', '.join(sorted(INDEXES))}")
        if isinstance(self.budget, int):
            self.sparsity_budget(self.budget)  # a budget too small for sinks + recent fails here, before any work
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def retrieved_tokens(self, prompt_tokens: int) -> int:
        """Candidates per retrieval for a prompt of `prompt_tokens`."""
        if isinstance(self.retrieve, int):
            return self.retrieve
        return max(1, math.ceil(self.retrieve * prompt_tokens))

    def active_tokens(self, prompt_tokens: int) -> int:
        if isinstance(self.budget, int):
            return self.budget
        return max(1, math.ceil(self.budget * prompt_tokens))

    def sparsity_budget(self, active_tokens: int) -> SparsityBudget:
        """The manager's budget: the hard cap minus the headroom for the tokens of one refresh period."""
        cap = active_tokens - self.refresh_every
        need = self.sinks + self.recent + self.refresh_every
        if cap < max(1, self.sinks + self.recent):
            raise ValueError(
                f"a GPU budget of {active_tokens} tokens per KV head cannot hold the {self.sinks} sink + {self.recent} "
                f"recent tokens that stay active plus {self.refresh_every} tokens of headroom between refreshes: "
                f"it needs at least {need} (raise the budget, or lower sinks/recent/refresh_every)"
            )
        return SparsityBudget(max_active=cap, sinks=self.sinks, recent=self.recent)


def gpu_budget(selector: Selector, budget: int | float) -> int | float:
    """The active tier's budget when `selector` runs under `atskv.tiered` at `budget`: `budget`
    itself, or a composition's residency budget (`budget` is then what a query attends; module
    docstring). A composition that would keep every token resident is refused: nothing would be
    parked, and its attention part alone does the same."""
    held = selector.held_budget(budget)
    if held is None:
        raise ValueError(
            f"{selector.name} at budget {budget} keeps every token on the GPU (its residency budget, "
            f"{RESIDENCY_FACTOR} x {budget}, reaches the whole context): set residency_budget below the context, "
            f"or run {selector.roles()[1].name} alone"
        )
    return held


def composition_retrieve(budget: int | float) -> int | float:
    """A composition's default retrieval: a third of its attention budget, so that a quarter of
    what a query reads comes back from the host (the default for one selector, 1/8 of the prompt,
    would read far beyond the composition's budget). At 96 picked + 32 retrieved of 128 read,
    `learned+sparq` beat SparQ alone on Gemma 3 at 16K and SmolLM2 at 8K
    (docs/results/composition-retrieval-sotu)."""
    return max(1, budget // 3) if isinstance(budget, int) else budget / 3


class TieredSession(SparseSession):
    """A `SparseSession` whose managed layers keep a two-tier cache; see the module docstring.
    With a composition, `config.budget` is its attention budget and `tiering.budget` the active
    tier (`tiered` sets it to the composition's residency budget, `gpu_budget`)."""

    def __init__(self, model, selector: Selector, config: SparsityConfig, tiering: TieringConfig):
        if selector.keeps_all:
            raise ValueError(f"atskv.tiered needs a selector that ranks tokens; {selector.name!r} keeps everything")
        super().__init__(model, selector, config)
        self.tiering = tiering
        self.manager: SparsityManager | None = None
        # who ranks active tokens for demotion: the selector, or a composition's residency part
        self.ranker, chooser = selector.roles()
        self.composed = chooser is not None
        if self.composed:
            gpu_budget(selector, config.budget)  # refuses before any work, as `tiered` does

    def new_cache(self) -> TieredKVCache:
        self.manager = None  # sized from the next prompt
        return TieredKVCache(self.model.config, self.managed_layers, self._make_host, self._make_index)

    def bind(self, cache) -> TieredKVCache:
        if cache is not None and not isinstance(cache, TieredKVCache):
            raise TypeError(f"under atskv.tiered the cache must be a TieredKVCache (got {type(cache).__name__})")
        return super().bind(cache)

    # --- the tiers of one layer -----------------------------------------------------------------
    def _make_host(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> HostTier:
        b, h, prompt, _ = keys.shape
        if self.manager is None:
            active = self.tiering.active_tokens(prompt)
            self.manager = SparsityManager(self.tiering.policy, self.tiering.sparsity_budget(active))
        capacity = self.tiering.max_tokens or prompt + 1024
        path = self.tiering.host_path
        return HostTier(
            b,
            h,
            keys.shape[-1],
            values.shape[-1],
            capacity,
            keys.dtype,
            path=None if path is None else Path(path) / f"layer{layer_idx}.kv",
        )

    def _make_index(self, keys: torch.Tensor):
        if self.tiering.retrieve == 0:
            return None
        options = {"head_dim": keys.shape[-1], **self.tiering.index_options}
        if INDEXES[self.tiering.index].on_model_device:  # the others stay on the host with the parked keys
            options.setdefault("device", keys.device)
        return make_index(self.tiering.index, **options)

    # --- attention ------------------------------------------------------------------------------
    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        layer: TieredLayer = self.cache.layers[module.layer_idx]
        view = self.view(module.layer_idx, layer, query, keys, attention_mask, scaling)
        decode = query.shape[2] == 1
        since = layer.seen - layer.state.setdefault(_PROMPT, layer.seen)  # decode steps so far
        refresh = not decode or layer.seen - layer.state.get(_REFRESHED_AT, 0) >= self.tiering.refresh_every
        fetch = decode and (refresh or since % self.tiering.retrieve_every == 0)
        fetched = fetched_mass = None
        attended = self.attended(view, query)
        if fetch and layer.index is not None and layer.parked_tokens > 0:
            stream = StreamedAttention(query, scaling)
            stream.add(keys, values, attended)  # the active tier first: its normaliser ranks the query heads
            positions, fetched = self._retrieve(layer, view, stream.log_normaliser()[..., -1])
            for block in self._read_blocks(layer, positions, fetched):
                stream.add(*block)
            out, (mass, *fetched_masses) = stream.result()
            fetched_mass = torch.cat(fetched_masses, -1)
        elif self.selector.needs_attention:
            out, mass = attention_and_mass(query, keys, values, attended, scaling, self.selector.prompt_sample)
        else:
            out, mass = sdpa_attention(query, keys, values, attended, scaling), None
        if self.selector.needs_attention:
            self.selector.observe(view, mass)
        if not decode:
            self.selector.prefill(view)
        elif not refresh and self.ranker.needs_hidden:
            # the learned selector (alone or as a part) enters this step's tokens with their own
            # hidden states when it scores, as it does every step under atskv.sparse; between
            # refreshes it would not, and the next refresh would give them its step's (a refresh
            # step's rebalance scores below)
            self.ranker.scores(self._last(view))
        if refresh:
            moved = self.cache.stats.demoted_tokens + self.cache.stats.promoted_tokens
            self._rebalance(layer, view, mass, fetched, fetched_mass)
            if self.composed and self.cache.stats.demoted_tokens + self.cache.stats.promoted_tokens != moved:
                self._forget_layout(layer)
        return out

    def attended(self, view: LayerView, query: torch.Tensor) -> torch.Tensor:
        """The active slots each query attends `[B, Hkv, Tq, S]`: every one, or on a composition's
        decode step its attention part's pick (`SparseSession.keep`: the same choice as under
        `atskv.sparse`)."""
        if not (self.composed and query.shape[2] == 1):
            return view.valid
        held = view.valid[:, :, -1].sum(-1)
        if held.numel() and bool(held.amin() != held.amax()):
            # rows (and KV heads) hold different counts: a shorter row's new token lands inside the
            # packed pages, not after them
            self._forget_layout(view.layer)
        return self.keep(view, self.is_sparse_step(query))

    def _forget_layout(self, layer: TieredLayer) -> None:
        """Drop a composition's attention part's per-layer state (SparCas's compact keys): it
        describes the active tier, packed in position order, as it was when built, and assumes each
        row only grew at its end since (`atskv.selectors.hybrid`); it is rebuilt on the next query.
        (Quest's page bounds would follow a re-packed view by themselves, bounding again the pages
        whose slots changed; rebuilt, they are the same.)"""
        layer.state.pop(self.selector.attention.name, None)

    def _last(self, view: LayerView) -> LayerView:
        """`view` for the newest query, at the active tier's budget for a composition's residency part."""
        newest = slice(-1, None)
        last = replace(view, query=view.query[:, :, newest], visible=view.valid[:, :, newest],
                       context=view.context[:, :, newest])  # fmt: skip
        return replace(last, budget=self.tiering.budget) if self.composed else last

    def _retrieve(self, layer: TieredLayer, view: LayerView, log_normaliser: torch.Tensor):
        """Positions `[B, Hkv, n]` of the best parked candidates for this step's queries, on the
        host (to read them: one synchronisation, here) and on the device (-1: none). Query heads
        are compared after subtracting their log-normaliser over the active tier, i.e. by the
        attention probability a candidate would get (`KeyIndex.search`)."""
        queries = grouped_queries(view.query, view.keys.shape[1])[:, :, :, -1]  # [B, Hkv, G, D]
        offsets = log_normaliser / view.scaling if self.tiering.normalise_heads else None  # in q·k units
        n = self.tiering.retrieved_tokens(layer.state[_PROMPT])
        positions = layer.index.search(queries, n, offsets=offsets).cpu()
        return positions, positions.to(view.keys.device, non_blocking=True)

    def _read_blocks(self, layer: TieredLayer, positions: torch.Tensor, on_device: torch.Tensor):
        """The candidates' keys/values read from the host `read_chunk` tokens at a time (a
        generator: each block is attended before the next is read, so retrieval holds one block
        on the GPU at once)."""
        chunk = self.tiering.read_chunk
        for start in range(0, positions.shape[-1], chunk):
            keys, values = layer.read(positions[..., start : start + chunk])
            yield keys, values, (on_device[..., start : start + chunk] >= 0).unsqueeze(2)

    def _rebalance(self, layer: TieredLayer, view: LayerView, mass, fetched, fetched_mass) -> None:
        """Demote by the selector's scores (manager.decide), promote fetched candidates by mass:
        candidates that clear the promotion threshold get room under the cap first, so a needed
        parked token displaces the least relevant active one even when the tier is full."""
        active = layer.occupied
        last = self._last(view)
        scores = self.ranker.scores(last)[:, :, 0].float()
        unwanted = self.ranker.unwanted(last)  # read right after `scores`, on the same state
        scores = torch.nan_to_num(scores, posinf=torch.finfo(scores.dtype).max).masked_fill(~active, -math.inf)
        momentum = layer.slot_tensor(MOMENTUM, init=INITIAL_MOMENTUM)
        positions = layer.slot_pos[..., : layer.length]
        eligible = reserve = None
        if fetched is not None:
            _, tau_promote = self.manager.thresholds(view.layer_idx, mass, active, total=layer.seen)
            eligible = (fetched >= 0) & (fetched_mass > tau_promote)
            reserve = eligible.sum(-1)
        decision = self.manager.decide(
            view.layer_idx, scores, active, positions, momentum, layer.seen, total=layer.seen, reserve=reserve,
            unwanted=unwanted,
        )
        momentum.copy_(decision.momentum)
        layer.demote(decision.demote)
        if eligible is not None:
            chosen = self.manager.promote(
                fetched_mass, eligible, torch.full_like(tau_promote, -math.inf), decision.free
            )
            layer.promote(fetched.masked_fill(~chosen, -1))
        layer.state[_REFRESHED_AT] = layer.seen


@reenterable
def tiered(
    model,
    selector: Selector | str = "h2o",
    budget: int | float = 0.1,
    *,
    dense_layers: int = 2,
    **tiering,
) -> Iterator[TieredSession]:
    """Run `model(...)`/`model.generate(...)` with at most `budget` tokens of KV per managed layer
    and KV head on the GPU; the rest waits in host memory (keyword options: `TieringConfig`). A
    composition (`learned+sparq`) holds its residency budget on the GPU and attends `budget` of it
    (module docstring).

    >>> with atskv.tiered(model, selector="learned", budget=0.1, retrieve=64) as session:
    ...     out = model.generate(**inputs, max_new_tokens=64)
    """
    selector = resolve_selector(selector, model)
    session = TieredSession(model, selector, *tiered_configs(selector, budget, dense_layers, tiering))
    with attach(model, session):
        yield session


def tiered_configs(
    selector: Selector, budget: int | float, dense_layers: int, tiering: dict
) -> tuple[SparsityConfig, TieringConfig]:
    """What a `TieredSession` of `selector` at `budget` is built from: where sparsity applies
    (prefill dense, decode sparse) and the tiering options (`TieringConfig` fields) with the
    active tier at `gpu_budget`, and a composition's retrieval at `composition_retrieve` unless
    given. Bad options fail here, before any work."""
    config = SparsityConfig(budget, dense_layers, sparse_prefill=False, sparse_decode=True)
    active = gpu_budget(selector, check_budget(budget))
    check_options("tiering", tiering, [f.name for f in fields(TieringConfig) if f.name != "budget"])
    composed = selector.roles()[1] is not None
    if composed and "retrieve" not in tiering:
        tiering = {**tiering, "retrieve": composition_retrieve(budget)}
    try:
        return config, TieringConfig(active, **tiering)
    except ValueError as error:
        if not composed:
            raise
        raise ValueError(f"{selector.name} holds its residency budget {active} on the GPU: {error}") from None


def memory_session(
    model,
    selector: Selector | str,
    budget: int | float,
    *,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    tiering: dict | None = None,
) -> contextlib.AbstractContextManager[SparseSession]:
    """`atskv.sparse(...)`, or `atskv.tiered(...)` with the `tiering` options (`TieringConfig`
    fields) when given: what the evaluations run a selector under."""
    if tiering is None:
        return sparse(model, selector, budget, dense_layers=dense_layers, sparse_prefill=sparse_prefill)
    if sparse_prefill:
        raise ValueError("atskv.tiered prefills densely; sparse_prefill applies to atskv.sparse only")
    return tiered(model, selector, budget, dense_layers=dense_layers, **tiering)
