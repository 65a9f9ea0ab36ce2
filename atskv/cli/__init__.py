"""The `atskv` command line. Thin: each subcommand is a function in one of this package's group
modules whose signature is its command line (jsonargparse, so every option can also come from a
YAML file under `configs/` via `--config`); it checks its options and calls the library.

    run.py        demo, generate, selectors
    data.py       data fetch|list
    eval.py       eval recall|tasks|ppl|peer
    bench.py      bench attention|decode|serve|fetch
    predictor.py  collect, fit, finetune, export, ridge (fit and finetune: LightningCLIs)
    profile.py    profile kascade

`COMMANDS` is the registry: a name maps to a command or to a group (a dict of commands with its
`_help`). A command marked `passes_argv` (the LightningCLIs) gets the rest of the command line
as it is and parses it itself.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable

from jsonargparse import ArgumentParser, DefaultHelpFormatter, auto_cli

from atskv.cli import bench, data, predictor, profile, run
from atskv.cli import eval as evaluation
from atskv.errors import OneLineParseErrors

COMMANDS: dict[str, Callable | dict] = {
    **run.COMMANDS,
    "data": data.COMMANDS,
    "bench": bench.COMMANDS,
    **predictor.COMMANDS,
    "profile": profile.COMMANDS,
    "eval": evaluation.COMMANDS,
}


def passed_argv(commands: dict, argv: list[str]) -> tuple[Callable, list[str]] | None:
    """The `passes_argv` command that `argv` names, with the arguments after its name; None when
    it names an ordinary one (or none)."""
    entry, depth = commands, 0
    while isinstance(entry, dict) and depth < len(argv) and argv[depth] in entry and argv[depth] != "_help":
        entry, depth = entry[argv[depth]], depth + 1
    if callable(entry) and getattr(entry, "passes_argv", False):
        return entry, argv[depth:]
    return None


def for_help(commands: dict) -> dict:
    """The registry as jsonargparse gets it: a `passes_argv` command becomes a command without
    options and the same docstring (it only shows in the list of subcommands); every command's
    summary (its docstring's first paragraph) on one line, which is what the list shows."""

    def stand_in(command: Callable) -> Callable:
        def listed() -> None:
            raise AssertionError("main() hands this command its argv")

        listed.__doc__ = command.__doc__
        return listed

    def summarised(command: Callable) -> Callable:
        if not command.__doc__:
            return command
        summary, _, rest = inspect.cleandoc(command.__doc__).partition("\n\n")
        command.__doc__ = " ".join(summary.split()) + (f"\n\n{rest}" if rest else "")
        return command

    return {
        name: for_help(entry) if isinstance(entry, dict)
        else entry if name == "_help"
        else summarised(stand_in(entry) if getattr(entry, "passes_argv", False) else entry)
        for name, entry in commands.items()
    }  # fmt: skip


# what a command interrupted by Ctrl-C keeps, where it keeps anything
KEPT = {
    "collect": "the finished windows are kept: a rerun resumes from there",
    "fit": "checkpoints written so far are kept",
    "finetune": "checkpoints written so far are kept",
    "bench decode": "a rerun into the same --out measures only what is missing",
    "eval leaderboard": "a rerun into the same --out measures only what is missing",
}


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's, with a plain `Path` option's type shown as `Path`, not `<class 'Path'>`
    (a private method of jsonargparse's formatter: check on an upgrade)."""

    def _get_type_str(self, action) -> str | None:
        shown = super()._get_type_str(action)
        return shown and re.sub(r"<class '(\w+)'>", r"\1", shown)


class OneLineParser(OneLineParseErrors, ArgumentParser):
    """The commands' parser: a parse error is one line and exit code 2; help through `HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})


class Interrupted(BaseException):
    """Ctrl-C in the `atskv` process; not a KeyboardInterrupt, so that no library (Lightning
    catches those and exits with 1) turns it into something else on its way out."""


def main(argv: list[str] | None = None) -> None:
    """Run one command. Bad input is one line on stderr and exit code 2; Ctrl-C is one line and
    exit code 130, saying what the command keeps (`KEPT`: a rerun of `collect` resumes from its
    last shard, `bench decode` and `eval leaderboard` from their last row)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    owner = os.getpid()

    def interrupt(signum, frame):  # worker processes forked from here keep the usual behaviour
        raise Interrupted() if os.getpid() == owner else KeyboardInterrupt()

    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGINT, interrupt) if in_main_thread else None
    try:
        found = passed_argv(COMMANDS, argv)
        if found:
            command, rest = found
            command(rest)
        else:
            auto_cli(for_help(COMMANDS), args=argv, as_positional=True, prog="atskv", parser_class=OneLineParser)
    except (Interrupted, KeyboardInterrupt):
        kept = next((text for command, text in KEPT.items() if argv[: len(command.split())] == command.split()), None)
        print("atskv: interrupted" + (f"; {kept}" if kept else ""), file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, OSError, ImportError, TypeError) as error:
        print(f"atskv: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def one_line(error: BaseException) -> str:
    """An error's message on one line (the first of its lines; the type when it has none), with
    what an OS error was about: its file and what kind of error it is. A message that names atskv
    itself (the vLLM plugin's, read in vLLM's logs) does not name it twice after `atskv: error:`."""
    lines = str(error).strip().splitlines()
    message = lines[0].removeprefix("atskv: ") if lines else type(error).__name__
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and type(error).__name__ not in message:
        message = f"{type(error).__name__}: {message}"
    return message


__all__ = ["COMMANDS", "main"]
