"""The Hugging Face hook: an attention function registered in transformers' `AttentionInterface`
plus a slot cache, so that under `atskv.sparse(model, ...)` every `model(...)` and
`model.generate(...)` attends, in each managed layer and KV head, only to the tokens a selector
keeps within a budget.

Managed layers are the globally attending layers from index `dense_layers` on; the first layers
and sliding-window layers (Gemma 3) keep their own rule and run through SDPA as usual. Prefill is
dense and decode sparse by default; both are configurable. Selectors that evict (StreamingLLM,
SnapKV, H2O) drop what they do not keep from the cache, so the KV held really shrinks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from atskv.attention import attention_and_mass, sdpa_attention
from atskv.budget import check_budget
from atskv.models.cache_names import cache_argument, pop_cache
from atskv.models.geometry import attention_modules
from atskv.selectors import resolve_selector
from atskv.selectors.base import LayerView, Selector, select_top_budget, without_unwanted
from atskv.slot_cache import SlotLayer, SparseKVCache

ATTENTION_NAME = "atskv"
# the same attention function under a name with no mask function: transformers then builds no mask
# at all, for the static decode path (atskv.generate), which knows positions and padding itself
STATIC_ATTENTION_NAME = "atskv-static"
_SESSION_ATTR = "_atskv_session"


@dataclass(frozen=True)
class SparsityConfig:
    """Where sparsity applies. `budget`: tokens per KV head (int) or a fraction of the context."""

    budget: int | float
    dense_layers: int = 2
    sparse_prefill: bool = False
    sparse_decode: bool = True

    def __post_init__(self):
        object.__setattr__(self, "budget", check_budget(self.budget))  # frozen; a NumPy count as its int
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")


class SelectorSession:
    """What a selector's session holds in both runtimes: a model, a selector and where it applies
    (`SparsityConfig`), the layers it manages, the cache of the current forward and the running
    layer's attention input. `attach` routes a model's attention to a subclass's `attend`: this
    module's `SparseSession` (the reference), or the fast path's `StaticSession`, which shares
    nothing else of it (its cache, masks and steps are its own)."""

    def __init__(self, model, selector: Selector, config: SparsityConfig):
        self.model = model
        self.selector = selector
        self.config = config
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        self.managed_layers = frozenset(
            i for i, kind in enumerate(layer_types) if kind == "full_attention" and i >= config.dense_layers
        )
        self.cache = None  # the current forward's, from `bind`
        # the running layer's attention input, for selectors that set `needs_hidden` (filled by `attach`)
        self.hidden: dict[int, torch.Tensor] = {}
        self.token_ids: torch.Tensor | None = None

    def handles(self, layer_idx: int) -> bool:
        """Whether this layer's attention goes through `attend` (else transformers' SDPA)."""
        return layer_idx in self.managed_layers

    @property
    def needs_hidden(self) -> bool:
        """Whether `attach` keeps the managed layers' attention inputs in `hidden`."""
        return self.selector.needs_hidden


class SparseSession(SelectorSession):
    """The reference session: selection over a growing slot cache (`SparseKVCache`), by masks or
    index lists, with the selector observing and evicting as it goes."""

    attention_name = ATTENTION_NAME

    def new_cache(self) -> SparseKVCache:
        return SparseKVCache(self.model.config, self.managed_layers)

    def bind(self, cache) -> SparseKVCache:
        """Make `cache` the one attention reads from; `None` gets a fresh cache."""
        if cache is None:
            cache = self.new_cache()
        elif not isinstance(cache, SparseKVCache):
            raise TypeError(
                f"under atskv.sparse the cache must be a SparseKVCache (got {type(cache).__name__}); "
                "pass none, or `session.new_cache()` (as `cache=`; `past_key_values=` before transformers 5.24)"
            )
        self.cache = cache
        return cache

    def attend(self, module, query, keys, values, attention_mask, scaling: float) -> torch.Tensor:
        """Attention of one managed layer: select, attend, let the selector observe, evict."""
        layer = self.cache.layers[module.layer_idx]
        view = self.view(module.layer_idx, layer, query, keys, attention_mask, scaling)
        sparse = self.is_sparse_step(query)
        if sparse and query.shape[2] == 1 and self.uses_index_path():
            return self.attend_indexed(view, values)
        keep = self.keep(view, sparse)
        out = self.attend_kept(view, values, keep)
        retained = self.finish(view, keep, sparse)
        if retained is not None:
            layer.evict(layer.occupied & ~retained)
        return out

    # --- the steps of `attend`, shared with the recall probe (atskv.eval.recall) -------------
    def view(self, layer_idx: int, layer: SlotLayer, query, keys, attention_mask, scaling: float) -> LayerView:
        valid, context = _visible_slots(layer, attention_mask, query.shape[2])
        slot_pos = layer.slot_pos[..., : layer.length]
        return LayerView(
            layer_idx, query, keys, valid, slot_pos, context, scaling, self.config.budget, layer,
            self.hidden.get(layer_idx), self.token_ids,
        )

    def is_sparse_step(self, query: torch.Tensor) -> bool:
        sparse = self.config.sparse_decode if query.shape[2] == 1 else self.config.sparse_prefill
        return sparse and not self.selector.keeps_all

    def uses_index_path(self) -> bool:
        """Decode of a query-aware selector attends over gathered index lists (the sparse decode
        kernel) instead of masking the whole cache; evicting selectors already hold only their
        budget, and H2O needs the per-slot mass, so both keep the mask path."""
        s = self.selector
        return s.query_aware and not s.evicts and not s.needs_attention

    def keep(self, view: LayerView, sparse: bool) -> torch.Tensor:
        """Keep-mask `[B, Hkv, Tq, S]`: the selector's budget on sparse steps, every visible slot otherwise."""
        return self.keeps(view, sparse, [view.budget])[0]

    def keeps(self, view: LayerView, sparse: bool, budgets: list[int | float]) -> list[torch.Tensor]:
        """`keep` at each of `budgets` from one scoring of `view` (the recall probe measures a
        selector whose state the budget does not change at every budget at once)."""
        if not sparse:
            return [view.valid] * len(budgets)
        scores, unwanted = self.selector.scores(view), self.selector.unwanted(view)
        return [
            without_unwanted(select_top_budget(scores, view.valid, budget, view.slot_pos, view.context), unwanted)
            for budget in budgets
        ]

    def attend_kept(self, view: LayerView, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        keys = self.selector.attention_keys(view)
        if self.selector.needs_attention:
            out, mass = attention_and_mass(view.query, keys, values, keep, view.scaling, self.selector.prompt_sample)
            self.selector.observe(view, mass)
            return out
        return sdpa_attention(view.query, keys, values, keep, view.scaling)

    def attend_indexed(self, view: LayerView, values: torch.Tensor) -> torch.Tensor:
        """Decode step on the index path: top-budget slot ids per KV head, then the sparse kernel."""
        from atskv.kernels.sparse_decode import sparse_decode_attention

        indices, lengths = self.selector.decode_indices(view)
        keys = self.selector.attention_keys(view)
        out = sparse_decode_attention(view.query[:, :, 0], keys, values, indices, lengths, view.scaling)
        return out.unsqueeze(1)  # [B, 1, Hq, D], the layout transformers expects

    def finish(self, view: LayerView, keep: torch.Tensor, sparse: bool) -> torch.Tensor | None:
        """After attention: a dense step builds the selector's prompt state; an evicting selector
        returns the slots to retain `[B, Hkv, S]` (`Selector.retained`)."""
        if not sparse:
            self.selector.prefill(view)
        if not self.selector.evicts:
            return None
        return self.selector.retained(view, keep[:, :, -1] if sparse else None)


def _visible_slots(
    layer: SlotLayer, attention_mask: torch.Tensor | None, tq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`valid` `[B, Hkv, Tq, S]`: slot s holds a token that query q may see (causality + padding);
    `context` `[B, 1, Tq]`: how many tokens of the sequence query q may see, held or evicted.

    The model's mask speaks of logical positions; it is gathered at each slot's position."""
    slot_pos = layer.slot_pos[..., : layer.length]
    occupied = slot_pos >= 0
    if attention_mask is None and tq == 1:  # a decode step without padding sees every held token
        return occupied.unsqueeze(2), torch.full((1, 1, 1), layer.seen, device=slot_pos.device)
    if attention_mask is None:  # pure causal, no padding
        query_pos = torch.arange(layer.seen - tq, layer.seen, device=slot_pos.device)
        valid = occupied.unsqueeze(2) & (slot_pos.unsqueeze(2) <= query_pos.view(1, 1, tq, 1))
        return valid, (query_pos + 1).view(1, 1, tq)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # additive float mask: 0 where allowed
    b, h, s = slot_pos.shape
    logical = attention_mask.expand(b, 1, tq, attention_mask.shape[-1])
    idx = slot_pos.clamp(min=0).unsqueeze(2).expand(b, h, tq, s)
    valid = occupied.unsqueeze(2) & logical.expand(b, h, tq, -1).gather(-1, idx)
    # a pad query (the mask hides its own token) sees nothing here, so gives no attention mass
    own = torch.arange(layer.seen - tq, layer.seen, device=slot_pos.device).view(1, 1, tq, 1).expand(b, 1, tq, 1)
    return valid & logical.gather(-1, own), logical.sum(-1)


@torch.compiler.disable  # a compiled decoder layer calls it eagerly: selectors keep Python state
def atskv_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention function: managed layers go through the session, others to SDPA."""
    session: SelectorSession | None = getattr(module, _SESSION_ATTR, None)
    if session is None or not session.handles(module.layer_idx):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported on atskv-managed layers")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return session.attend(module, query, key, value, attention_mask, scaling), None


AttentionInterface.register(ATTENTION_NAME, atskv_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
AttentionInterface.register(STATIC_ATTENTION_NAME, atskv_attention_forward)


class Reenterable(contextlib.AbstractContextManager):
    """A context manager that can be entered again after it exits, each time through a fresh one
    from `make` (`contextlib.contextmanager`'s can be entered once: a second `with` raised an
    `AttributeError` from contextlib)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self._make, self._entered = make, []

    def __enter__(self):
        manager = self._make()
        value = manager.__enter__()
        self._entered.append(manager)
        return value

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)


def reenterable(function: Callable[..., Iterator]) -> Callable[..., Reenterable]:
    """`contextlib.contextmanager`, with a result that can be entered again (`Reenterable`): each
    `with` runs `function` anew with the same arguments (a new session on the model)."""
    once = contextlib.contextmanager(function)

    @functools.wraps(function)
    def manager(*args, **kwargs) -> Reenterable:
        return Reenterable(lambda: once(*args, **kwargs))

    return manager


@reenterable
def sparse(
    model,
    selector: Selector | str = "oracle",
    budget: int | float = 0.1,
    *,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    sparse_decode: bool = True,
) -> Iterator[SparseSession]:
    """Run `model(...)` and `model.generate(...)` with sparse attention inside the block.

    >>> with atskv.sparse(model, selector="snapkv", budget=256):
    ...     out = model.generate(**inputs, max_new_tokens=16)
    """
    selector = resolve_selector(selector, model)
    session = SparseSession(model, selector, SparsityConfig(budget, dense_layers, sparse_prefill, sparse_decode))
    with attach(model, session):
        yield session


@contextlib.contextmanager
def attach(model, session: SelectorSession) -> Iterator[SelectorSession]:
    """Route `model`'s attention and cache through `session` inside the block (what `sparse`
    does with a `SparseSession`; the recall probe attaches its own session subclass, the
    predictor's biased attention a session of its own: any object with `attention_name`,
    `handles`, `bind`, `attend` and `needs_hidden`, plus `hidden` when that is true)."""
    modules = attention_modules(model)
    if any(hasattr(m, _SESSION_ATTR) for m in modules):
        raise RuntimeError("this model is already under atskv.sparse; nesting sessions on one model is not supported")
    previous_impl = model.config._attn_implementation
    original_forward, original_generate = model.forward, model.generate
    shadowed = {k: model.__dict__[k] for k in ("forward", "generate") if k in model.__dict__}

    cache_arg = cache_argument(original_forward)

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        session.token_ids = kwargs.get("input_ids", args[0] if args else None)
        kwargs[cache_arg] = session.bind(pop_cache(kwargs))
        return original_forward(*args, **kwargs)

    @torch.compiler.disable
    def keep_hidden(module, args, kwargs):  # the attention module's input: what a learned selector reads
        # the running layer's alone: every layer's would keep a prompt chunk's normed inputs alive
        # for the whole forward (the 8B shape, chunks of 8K: 30 x 64 MiB a row)
        session.hidden.clear()
        session.hidden[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        kwargs[cache_arg] = session.bind(pop_cache(kwargs))
        return original_generate(*args, **kwargs)

    model.set_attn_implementation(session.attention_name)
    for m in modules:
        setattr(m, _SESSION_ATTR, session)
    hooks = []
    if session.needs_hidden:
        managed = [m for m in modules if m.layer_idx in session.managed_layers]
        hooks = [m.register_forward_pre_hook(keep_hidden, with_kwargs=True) for m in managed]
    model.forward, model.generate = forward, generate
    try:
        yield session
    finally:
        for hook in hooks:
            hook.remove()
        if hooks:
            session.hidden.clear()
        del model.forward, model.generate
        model.__dict__.update(shadowed)
        for m in modules:
            delattr(m, _SESSION_ATTR)
        model.set_attn_implementation(previous_impl)
