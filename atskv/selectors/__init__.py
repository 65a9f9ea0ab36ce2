"""Selectors: one file each, one protocol (`atskv.selectors.base.Selector`), one registry line each."""

from __future__ import annotations

from atskv.selectors.base import LayerView, Selector
from atskv.selectors.dense import DenseSelector
from atskv.selectors.h2o import H2OSelector
from atskv.selectors.oracle import OracleSelector
from atskv.selectors.quest import QuestSelector
from atskv.selectors.snapkv import SnapKVSelector
from atskv.selectors.sparcas import SparCasSelector
from atskv.selectors.sparq import SparQSelector
from atskv.selectors.streaming_llm import StreamingLLMSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls
    for cls in (
        DenseSelector,
        OracleSelector,
        StreamingLLMSelector,
        SnapKVSelector,
        H2OSelector,
        QuestSelector,
        SparQSelector,
        SparCasSelector,
    )
}


def make_selector(name: str, **kwargs) -> Selector:
    """Build a selector by registry name; unknown names get the list of valid ones."""
    try:
        cls = SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of: {', '.join(sorted(SELECTORS))}") from None
    return cls(**kwargs)


__all__ = ["SELECTORS", "LayerView", "Selector", "make_selector"]
