"""Selectors: one file each, one protocol (`atskv.selectors.base.Selector`), one registry line each."""

from __future__ import annotations

from pathlib import Path

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


def selectors_for_model(names: list[str], model_name: str, options: dict[str, dict] | None = None) -> list[Selector]:
    """Selector instances for one loaded model: Kascade reads that model's profile (written by
    `atskv profile kascade`) and the learned selector its predictor (the user's `atskv export`,
    else the one shipped for the model); every other selector needs only its name. `options`:
    constructor arguments by selector name (`selector_options`), which win over those defaults,
    e.g. `{"learned": {"predictor": PATH, "threshold": 0.0}}`."""
    from atskv.selectors.kascade import default_profile_path

    options = options or {}
    per_model = {  # the argument each needs, and where it is found by default
        "kascade": ("profile", lambda: default_profile_path(model_name)),
        "learned": ("predictor", lambda: _predictor_for(model_name)),
    }
    built = []
    for name in names:
        given = dict(options.get(name, {}))
        if name in per_model and per_model[name][0] not in given:
            given[per_model[name][0]] = per_model[name][1]()
        built.append(make_selector(name, **given))
    return built


def selector_options(names: list[str], options: dict | None, predictor: str | Path | None = None) -> dict[str, dict]:
    """The `options` argument of `selectors_for_model` from a command line's `--selector_options`
    and `--predictor`: a dict keyed by selector names gives each its own options; any other dict
    goes to every selector in `names` (an `InputError` names a selector that has no such option);
    `predictor` is the learned selector's predictor file or folder."""
    from dataclasses import fields

    options = dict(options or {})
    check_selector_names(names)
    if options and set(options) <= set(SELECTORS):
        by_name = {name: dict(value or {}) for name, value in options.items()}
        if set(by_name) - set(names):
            raise InputError(f"options given for {sorted(set(by_name) - set(names))[0]!r}, which is not selected")
    else:
        by_name = {name: dict(options) for name in names} if options else {}
    for name, given in by_name.items():
        known = {f.name for f in fields(SELECTORS[name]) if f.init}
        if set(given) - known:
            unknown = sorted(set(given) - known)[0]
            raise InputError(f"selector {name!r} has no option {unknown!r}; its options: {', '.join(sorted(known))}")
    if predictor is not None:
        if "learned" not in names:
            raise InputError("--predictor is the learned selector's predictor: select `learned` too")
        if not Path(predictor).expanduser().exists():
            raise InputError(f"--predictor {predictor}: no such file or folder; `atskv export` writes one")
        by_name.setdefault("learned", {})["predictor"] = predictor
    return by_name


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
    "selector_options", "selectors_for_model",
]
