"""What the command groups share: the registry's marker for commands that parse their own argv,
the checks made before any model loads, and loading a model with one line of progress."""

from __future__ import annotations

from collections.abc import Callable

from atskv.models import resolve_device


def passes_argv(command: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
    """Mark a command that takes the rest of the command line as it is (a LightningCLI parses it
    itself); `atskv.cli.main` hands it the arguments after its name instead of parsing them."""
    command.passes_argv = True
    return command


def check_selection(selectors: list[str], budget: int | float) -> None:
    """Refuse a bad budget or an unknown selector before any model is loaded."""
    from atskv.selectors import check_selector_names
    from atskv.selectors.base import check_budget

    check_budget(budget)
    check_selector_names(selectors)


def load(model: str, device: str, dtype: str, *, announce: bool = True):
    """`atskv.models.load_model` on the device and dtype the options name (auto: the GPU with
    bfloat16 when there is one); prints a line first unless `announce` is false."""
    from atskv.models import load_model

    device, torch_dtype = resolve_device(device, dtype)
    if announce:
        print(f"loading {model} on {device} ({str(torch_dtype).removeprefix('torch.')}) ...", flush=True)
    return load_model(model, dtype=torch_dtype, device=device)
