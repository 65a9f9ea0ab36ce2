"""The one error type for bad input: the CLI prints its message on one line and exits with code 2.

Raise `InputError` (a `ValueError`, so library callers that catch `ValueError` keep working) for
anything the user can fix: wrong paths, corrupt or mismatched files, budgets out of range, empty
corpora. Its message is the whole story: what was wrong and what to do.
"""


from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


class InputError(ValueError):
    """Bad input from the user; the message says what and how to fix it."""


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
