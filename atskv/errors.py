"""The one error type for bad input: the CLI prints its message on one line and exits with code 2.

Raise `InputError` (a `ValueError`, so library callers that catch `ValueError` keep working) for
anything the user can fix: wrong paths, corrupt or mismatched files, budgets out of range, empty
corpora. Its message is the whole story: what was wrong and what to do.
"""

import re
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


class InputError(ValueError):
    """Bad input from the user; the message says what and how to fix it."""


def is_int(value) -> bool:
    """Whether `value` is an int and not a bool (Python's `True` is an int, but a flag is no count):
    the one test behind every "an int >= N" option check."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(owner: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse an option `owner` does not have, in one line that lists the ones it has."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise InputError(f"{owner} has no option {unknown[0]!r}; its options: {', '.join(known)}")


def built_from_option(option: str, build: Callable[[], T]) -> T:
    """`build()`, with a `TypeError` or `ValueError` it raises (options the class does not take,
    values out of range) turned into one `InputError` line that names the command-line `option`."""
    try:
        return build()
    except (TypeError, ValueError) as error:
        raise InputError(f"{option}: {error}") from None


class OneLineParseErrors:
    """A jsonargparse parser mixin: a parse error (a value of the wrong type, an unknown option on
    the command line or in a `--config` file) is one line on stderr naming the option and what it
    accepts, and exit code 2, instead of the usage block and the type checker's report."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        command = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"atskv: error: {parse_error_line(message, parser._actions, command)}\n")
        self.exit(2)


def parse_error_line(message: str, actions, command: str) -> str:
    """jsonargparse's error `message` in one line: for a value that does not parse, the option,
    the type it accepts (from its action among `actions`) and the value given; otherwise the
    message's first line, with where to find the options when one is unknown."""
    lines = [line.strip() for line in message.strip().splitlines()]
    bad_value = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[0])
    if not bad_value:
        unknown = "unrecognized arguments" in lines[0] or "does not accept option" in lines[0]
        return lines[0] + (f"; see `{command} --help`" if unknown else "")
    key, detail = bad_value.groups()
    given = next((found.group(1) for line in lines if (found := re.search(r"(?:Got|Given) value: (.*)", line))), None)
    if given is None:
        return f"--{key}: {detail or lines[1]}"
    hint = next((getattr(a, "_typehint", None) for a in actions if a.dest == key), None)
    accepts = type_name(hint) if hint is not None else "another value"
    return f"--{key} takes {accepts}; got {given!r}"


def type_name(hint) -> str:
    """A type hint as a user reads it: `int | float`, `list[int]`, `Path | None`."""
    text = hint.__name__ if isinstance(hint, type) and not getattr(hint, "__args__", None) else str(hint)
    text = re.sub(r"\b(?:typing|pathlib|collections\.abc)\.", "", text).replace("NoneType", "None")
    return re.sub(r"^Optional\[(.*)\]$", r"\1 | None", text)
