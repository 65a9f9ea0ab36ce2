"""The names transformers gives a model's cache: 5.24 renamed `past_key_values` to `cache` in
`forward`, `generate` and the outputs (the old names still work there, with a deprecation
warning); the earlier versions atskv supports know only the old one. Every call site passes and
reads the cache through these, so neither version warns or fails."""

from __future__ import annotations

import inspect


def cache_argument(forward) -> str:
    """The keyword `forward` (a model's forward or generate) takes its cache under."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """`{name: cache}` for `model(...)` or `model.generate(...)`."""
    return {cache_argument(model.forward): cache}


def returned_cache(output):
    """The cache a forward's output carries."""
    return output.cache if "cache" in getattr(type(output), "__dataclass_fields__", {}) else output.past_key_values


def pop_cache(kwargs: dict):
    """Remove and return the cache a caller passed under either name (None: none)."""
    cache = kwargs.pop("cache", None)
    old = kwargs.pop("past_key_values", None)
    return cache if cache is not None else old
