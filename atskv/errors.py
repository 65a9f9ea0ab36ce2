"""The one error type for bad input: the CLI prints its message on one line and exits with code 2.

Raise `InputError` (a `ValueError`, so library callers that catch `ValueError` keep working) for
anything the user can fix: wrong paths, corrupt or mismatched files, budgets out of range, empty
corpora. Its message is the whole story: what was wrong and what to do.
"""


from collections.abc import Iterable


class InputError(ValueError):
    """Bad input from the user; the message says what and how to fix it."""


def check_options(owner: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse an option `owner` does not have, in one line that lists the ones it has."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise InputError(f"{owner} has no option {unknown[0]!r}; its options: {', '.join(known)}")
