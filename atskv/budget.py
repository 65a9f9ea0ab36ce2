"""What a budget means, for every runtime, selector, evaluation and the CLI: an int is tokens kept
per layer and KV head, a float in (0, 1) that fraction of the row's context, rounded up, at least 1,
never more than the context. `check_budget` refuses anything else before any work;
`resolve_budget` turns a checked budget into tokens per row (`atskv.kernels.budget` holds the same
rule for torch and for kernels that decide per row on the device)."""

from __future__ import annotations

import numbers

import torch

from atskv.errors import InputError
from atskv.kernels.budget import kept_tokens

BUDGET_RULE = (
    "a budget is an int, the tokens kept per layer and KV head (at least 1 token), or a float "
    "strictly between 0 and 1, that fraction of each row's context"
)


def resolve_budget(budget: int | float, context: torch.Tensor) -> torch.Tensor:
    """Tokens to keep per row (`check_budget`'s rule): an int is a token count, a float in (0, 1)
    that fraction of each row's own context length, rounded up (so a left-padded row gets the
    same budget as when run alone); never more than the context."""
    return kept_tokens(check_budget(budget), context)


def check_budget(budget: int | float) -> int | float:
    """The one meaning of a budget, for the hook, the tiered store, the evaluations and the CLI:
    an int is tokens (>= 1), a float strictly between 0 and 1 a fraction of the context. Anything
    else is an `InputError` naming the budget and the rule: 1.0 (a whole context or one token? for
    every token pass the context length as an int), 0, negatives, bools, strings. Checked before
    any work; returns the budget as a Python int or float (a NumPy count, `np.int64(32)`, is
    its int; `np.float32(0.1)` its float)."""
    if isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        budget = int(budget) if isinstance(budget, numbers.Integral) else float(budget)
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float))
        or (isinstance(budget, int) and budget < 1)
        or (isinstance(budget, float) and not 0.0 < budget < 1.0)
    ):
        one = isinstance(budget, float) and budget == 1.0
        keep_all = "; to keep every token, pass the context length as an int" if one else ""
        raise InputError(f"bad budget {budget!r}: {BUDGET_RULE}{keep_all}")
    return budget

