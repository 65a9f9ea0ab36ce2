"""The learned selector's own options, checked where its module cannot be imported: atskv's
`LearnedSelector` (`atskv.selectors.learned`) and the vLLM plugin's `PagedLearned`
(`atskv.runtime.vllm.learned`, which imports no transformers) refuse them in the same words."""

from __future__ import annotations

from atskv.errors import InputError, is_int


def check_window_share(share) -> None:
    """An `InputError` unless `window_share` is a share of the budget (before a predictor is at hand)."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise InputError(f"atskv: window_share is a share of the budget, in [0, 1]; got {share!r}")


def check_refresh_every(steps) -> None:
    """An `InputError` unless `refresh_every` is a count of decode steps >= 0 (0: the prompt's
    scores stand, never refreshed after its end)."""
    if not is_int(steps) or steps < 0:
        raise InputError(f"atskv: refresh_every is a count of decode steps >= 0 (0: never after the prompt), "
                         f"got {steps!r}")  # fmt: skip
