"""What the command groups share: the registry's marker for commands that parse their own argv,
the checks made before any model loads, and loading a model with one line of progress."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable

from atskv.models import resolve_device


def passes_argv(command: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
    """Mark a command that takes the rest of the command line as it is (a LightningCLI parses it
    itself); `atskv.cli.main` hands it the arguments after its name instead of parsing them."""
    command.passes_argv = True
    return command


SELECTOR_HELP = {
    "{PREDICTOR_HELP}": "the learned selector's predictor (file or folder); default: the model's "
    "(`atskv export`, else the shipped one)",
    "{OPTIONS_HELP}": "selector options, for every selector ('{threshold: 0.0, refresh_every: 8}') or "
    "by name ('{learned: {threshold: 0.0}, h2o: {...}}')",
}


def selector_help(*commands: Callable) -> None:
    """Write the help of the options every selector-running command shares (`predictor`,
    `selector_options`) into the commands' docstrings, where they say {PREDICTOR_HELP} and {OPTIONS_HELP}."""
    for command in commands:
        for mark, text in SELECTOR_HELP.items():
            command.__doc__ = command.__doc__.replace(mark, text)


def load_with_selectors(model: str, device: str, dtype: str, selectors: list[str], budgets: list[int | float],
                        predictor, selector_options: dict | None):  # fmt: skip
    """The model and its selectors, for a command that runs selectors: names, budgets and options
    are checked before anything loads; the learned selector reads `predictor` (default: the model's)."""
    from atskv.selectors import selector_options as by_name
    from atskv.selectors import selectors_for_model

    for budget in budgets:
        check_selection(selectors, budget)
    options = by_name(selectors, selector_options, predictor)
    loaded = load(model, device, dtype)
    return loaded, selectors_for_model(selectors, loaded.name, options)


def check_selection(selectors: list[str], budget: int | float) -> None:
    """Refuse a bad budget or an unknown selector before any model is loaded."""
    from atskv.budget import check_budget
    from atskv.selectors import check_selector_names

    check_budget(budget)
    check_selector_names(selectors)


def load(model: str, device: str, dtype: str, *, announce: bool = True):
    """`atskv.models.load_model` on the device and dtype the options name (auto: the GPU with
    bfloat16 when there is one); says so on stderr first unless `announce` is false."""
    from atskv.models import load_model

    device, torch_dtype = resolve_device(device, dtype)
    if announce:
        dtype_name = str(torch_dtype).removeprefix("torch.")
        print(f"loading {model} on {device} ({dtype_name}) ...", file=sys.stderr, flush=True)
    return load_model(model, dtype=torch_dtype, device=device)


def quiet_lightning() -> None:
    """Lightning's messages once each, through the command's own log format: Lightning adds its
    own console handler to the `lightning` logger, which also passes every record on to the root
    logger the CLI configured (two lines per event); drop that handler, the advertising tip, a note
    about its own checkpoint loading and a deprecation warning of Lightning's own code."""
    import lightning  # noqa: F401 (its import adds the handler)

    logging.getLogger("lightning").handlers.clear()
    noise = ("Tip: For seamless cloud logging", "`weights_only` was not set")
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: not any(text in record.getMessage() for text in noise))
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
