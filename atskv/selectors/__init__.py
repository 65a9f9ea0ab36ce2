"""Selectors: one file each, one protocol (`atskv.selectors.base.Selector`), one registry line each.
A name `a+b` composes two registered ones: residency by `a`, query-aware choice by `b`
(`atskv.selectors.hybrid`)."""

from __future__ import annotations

from pathlib import Path

from atskv.errors import InputError, check_options
from atskv.selectors.base import LayerView, Selector
from atskv.selectors.dense import DenseSelector
from atskv.selectors.h2o import H2OSelector
from atskv.selectors.hybrid import HybridSelector, check_parts
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
    built on another one (SparK) may name it: `base="h2o"` with `base_options={...}` for it. A
    composition builds each part with the options given under the part's name:
    `make_selector("learned+sparq", learned={"predictor": PATH}, residency_budget=512)`."""
    check_selector_names([name])
    parts = name_parts(name)
    if len(parts) == 2:
        residency, attention = [make_selector(part, **kwargs.pop(part, {})) for part in parts]
        return HybridSelector(residency, attention, **kwargs)
    if isinstance(kwargs.get("base"), str):
        kwargs["base"] = make_selector(kwargs["base"], **kwargs.pop("base_options", {}))
    return SELECTORS[name](**kwargs)


def name_parts(name: str) -> list[str]:
    """The registered selectors a name is made of: itself, or the two parts of `a+b`."""
    return name.split("+")


def selectors_for_model(names: list[str], model_name: str, options: dict[str, dict] | None = None) -> list[Selector]:
    """Selector instances for one loaded model: a selector with per-model state (`Selector.per_model`:
    Kascade's profile written by `atskv profile kascade`, the learned selector's predictor, the
    user's `atskv export` else the one shipped for the model) finds it by the model's name
    (`Selector.for_model`); every other selector needs only its name. `options`:
    constructor arguments by selector name (`selector_options`), which win over those defaults,
    e.g. `{"learned": {"predictor": PATH, "threshold": 0.0}}`."""
    options = options or {}

    def with_defaults(name: str, given: dict) -> dict:
        cls = SELECTORS.get(name)  # None: a composition, whose parts' options hold their own
        if cls is not None and cls.per_model is not None and cls.per_model not in given:
            given[cls.per_model] = cls.for_model(model_name)
        return given

    built = []
    for name in names:
        given = dict(options.get(name, {}))
        parts = name_parts(name)
        if len(parts) == 2:  # a composition: each part's options sit under its name
            given |= {part: with_defaults(part, dict(given.get(part) or {})) for part in parts}
        if isinstance(given.get("base"), str):  # SparK over a selector that is made per model
            given["base_options"] = with_defaults(given["base"], dict(given.get("base_options") or {}))
        built.append(make_selector(name, **with_defaults(name, given)))
    return built


def selector_options(names: list[str], options: dict | None, predictor: str | Path | None = None) -> dict[str, dict]:
    """The `options` argument of `selectors_for_model` from a command line's `--selector_options`
    and `--predictor`: a dict keyed by selector names gives each its own options; any other dict
    goes to every selector in `names` (an `InputError` names a selector that has no such option);
    `predictor` is the learned selector's predictor file or folder."""
    options = dict(options or {})
    check_selector_names(names)
    if options and set(options) <= set(SELECTORS) | set(names):
        by_name = {name: dict(value or {}) for name, value in options.items()}
        if set(by_name) - set(names):
            raise InputError(f"options given for {sorted(set(by_name) - set(names))[0]!r}, which is not selected")
    else:
        by_name = {name: dict(options) for name in names} if options else {}
    for name, given in by_name.items():
        _check_options(name, given)
    if predictor is not None:
        with_learned = [name for name in names if "learned" in name_parts(name)]
        if not with_learned:
            raise InputError("--predictor is the learned selector's predictor: select `learned` too")
        if not Path(predictor).expanduser().exists():
            raise InputError(f"--predictor {predictor}: no such file or folder; `atskv export` writes one")
        for name in with_learned:
            given = by_name.setdefault(name, {})
            (given.setdefault("learned", {}) if name != "learned" else given)["predictor"] = predictor
    return by_name


def _check_options(name: str, given: dict) -> None:
    """Refuse an option `name`'s selector does not have; a composition's are its own fields and,
    under each part's name, that part's options."""
    from dataclasses import fields

    parts = name_parts(name)
    cls = HybridSelector if len(parts) == 2 else SELECTORS[name]
    known = {f.name for f in fields(cls) if f.init} - {"residency", "attention"}
    if len(parts) == 2:
        known |= set(parts)
        for part in parts:
            _check_options(part, dict(given.get(part) or {}))
    if "base" in known:  # SparK: its base by name, that base's options beside it
        known.add("base_options")
        if isinstance(given.get("base"), str):
            check_selector_names([given["base"]])
            _check_options(given["base"], dict(given.get("base_options") or {}))
    check_options(f"selector {name!r}", given, known)


def resolve_selector(selector: Selector | str, model) -> Selector:
    """The selector a session runs on `model`: a name is built as for the CLI
    (`selectors_for_model`, by the name `load_model` gave the model), so `atskv.sparse(model,
    "learned", 0.1)` finds the model's predictor; a learned selector, given or built, must have been
    trained for this model (`PredictorHeader.check_model`)."""
    from atskv.models.identity import model_name

    if isinstance(selector, str):
        check_selector_names([selector])
        name = model_name(model)
        per_model = [SELECTORS[part] for part in name_parts(selector) if SELECTORS[part].per_model is not None]
        if name is None and per_model:
            cls = per_model[0]
            raise InputError(
                f"the {cls.name} selector is made per model and this one has no name to find it by: "
                f"load the model with atskv.models.load_model, or pass {cls.__name__}({cls.per_model}=PATH)"
            )
        selector = selectors_for_model([selector], name)[0]
    selector.check_model(model)  # SparK asks its base, a composition its parts
    return selector


def check_selector_names(names: list[str]) -> None:
    """Refuse unknown selector names (before any model is loaded), listing the valid ones, and
    compositions whose parts cannot play their roles (`atskv.selectors.hybrid.check_parts`)."""
    for name in names:
        parts = name_parts(name)
        unknown = [part for part in parts if part not in SELECTORS]
        if unknown:
            raise ValueError(
                f"unknown selector {unknown[0]!r}; choose one of: {', '.join(sorted(SELECTORS))}, "
                "or compose two as residency+attention (e.g. learned+sparq)"
            )
        if len(parts) > 2:
            raise InputError(f"{name!r}: a composition has two parts, residency+attention (e.g. learned+sparq)")
        if len(parts) == 2:
            check_parts(*(SELECTORS[part] for part in parts))


__all__ = [
    "SELECTORS", "HybridSelector", "LayerView", "Selector", "check_selector_names", "make_selector", "name_parts",
    "resolve_selector", "selector_options", "selectors_for_model",
]
