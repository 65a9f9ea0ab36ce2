"""Selectors: one file each, one protocol (`atskv.selectors.base.Selector`), one registry line each."""

from __future__ import annotations

from atskv.errors import InputError
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
    from atskv.selectors.kascade import default_profile_path

    per_model = {
        "kascade": lambda: {"profile": default_profile_path(model_name)},
        "learned": lambda: {"predictor": _predictor_for(model_name)},
    }
    return [make_selector(name, **per_model.get(name, dict)()) for name in names]


def resolve_selector(selector: Selector | str, model) -> Selector:
    """The selector a session runs on `model`: a name is built as for the CLI
    (`selectors_for_model`, by the name `load_model` gave the model), so `atskv.sparse(model,
    "learned", 0.1)` finds the model's predictor; a learned selector, given or built, must have been
    trained for this model (`PredictorHeader.check_model`)."""
    from atskv.models.identity import model_name

    if isinstance(selector, str):
        check_selector_names([selector])
        name = model_name(model)
        if name is None and selector in ("learned", "kascade"):
            what = "LearnedSelector(predictor=PATH)" if selector == "learned" else "KascadeSelector(profile=PATH)"
            raise InputError(
                f"the {selector} selector is made per model and this one has no name to find it by: "
                f"load the model with atskv.models.load_model, or pass {what}"
            )
        selector = selectors_for_model([selector], name)[0]
    for part in (selector, getattr(selector, "base", None)):  # SparK runs another selector
        if isinstance(part, LearnedSelector):
            part.check_model(model)
    return selector


def _predictor_for(model_name: str):
    """The predictor folder for a model (`find_predictor`), or an `InputError` saying how to get one."""
    from atskv.predictor.export import find_predictor

    folder = find_predictor(model_name)
    if not (folder / "predictor.safetensors").is_file():
        raise InputError(
            f"no predictor for {model_name!r}: none ships with atskv and none was exported to {folder}; "
            "run `atskv collect`, `atskv fit` and `atskv export` for this model, or pass LearnedSelector(predictor=PATH)"
        )
    return folder


def check_selector_names(names: list[str]) -> None:
    """Refuse unknown selector names (before any model is loaded), listing the valid ones."""
    unknown = [name for name in names if name not in SELECTORS]
    if unknown:
        raise ValueError(f"unknown selector {unknown[0]!r}; choose one of: {', '.join(sorted(SELECTORS))}")


__all__ = [
    "SELECTORS", "LayerView", "Selector", "check_selector_names", "make_selector", "resolve_selector",
    "selectors_for_model",
]
