"""Selectors: one file each, one protocol (`atskv.selectors.base.Selector`), one registry line each."""

from __future__ import annotations

from atskv.selectors.base import LayerView, Selector
from atskv.selectors.dense import DenseSelector
from atskv.selectors.h2o import H2OSelector
from atskv.selectors.kascade import KascadeSelector
from atskv.selectors.learned import LearnedSelector
from atskv.selectors.oracle import OracleSelector
from atskv.selectors.quest import QuestSelector
from atskv.selectors.snapkv import SnapKVSelector
from atskv.selectors.sparcas import SparCasSelector
from atskv.selectors.spark import SparKSelector
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
        KascadeSelector,
        SparKSelector,
        LearnedSelector,
    )
}


def make_selector(name: str, **kwargs) -> Selector:
    """Build a selector by registry name; unknown names get the list of valid ones. A selector
    built on another one (SparK) may name it: `base="h2o"` with `base_options={...}` for it."""
    try:
        cls = SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of: {', '.join(sorted(SELECTORS))}") from None
    if isinstance(kwargs.get("base"), str):
        kwargs["base"] = make_selector(kwargs["base"], **kwargs.pop("base_options", {}))
    return cls(**kwargs)


def selectors_for_model(names: list[str], model_name: str) -> list[Selector]:
    """Selector instances for one loaded model: Kascade reads that model's profile (written by
    `atskv profile kascade`) and the learned selector its predictor (the user's `atskv export`,
    else the one shipped for the model); every other selector needs only its name."""
    from atskv.predictor.export import find_predictor
    from atskv.selectors.kascade import default_profile_path

    per_model = {
        "kascade": lambda: {"profile": default_profile_path(model_name)},
        "learned": lambda: {"predictor": find_predictor(model_name)},
    }
    return [make_selector(name, **per_model.get(name, dict)()) for name in names]


def check_selector_names(names: list[str]) -> None:
    """Refuse unknown selector names (before any model is loaded), listing the valid ones."""
    unknown = [name for name in names if name not in SELECTORS]
    if unknown:
        raise ValueError(f"unknown selector {unknown[0]!r}; choose one of: {', '.join(sorted(SELECTORS))}")


__all__ = ["SELECTORS", "LayerView", "Selector", "check_selector_names", "make_selector", "selectors_for_model"]
