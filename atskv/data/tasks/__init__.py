"""Synthetic long-context tasks with exact answers, modelled on RULER (Hsieh et al., 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654) and
the pass-key test, built locally from a seed.

A task is one generator ``(tokenizer, n_tokens, depth, seed, filler=None) -> TaskExample`` in
its own file plus one line in ``TASKS``: the prompt has at most ``n_tokens`` tokens (short by a
few), ``depth`` in [0, 1] places the needle in the filler, ``filler`` is haystack text to use
instead of generated sentences, and prompts end so that a base model continues with the answer.
"""

from __future__ import annotations

from collections.abc import Callable

from atskv.data.tasks.common_words import common_words_example
from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import CLASSIC_FILLER, filler_text, synthetic_filler
from atskv.data.tasks.needle import needle_multikey_example, needle_multivalue_example, needle_single_example
from atskv.data.tasks.passkey import passkey_example
from atskv.data.tasks.qa import qa_example
from atskv.data.tasks.variable_tracking import variable_tracking_example

TASKS: dict[str, Callable[..., TaskExample]] = {
    "passkey": passkey_example,
    "needle_single": needle_single_example,
    "needle_multikey": needle_multikey_example,
    "needle_multivalue": needle_multivalue_example,
    "variable_tracking": variable_tracking_example,
    "common_words": common_words_example,
    "qa": qa_example,
}
"""Task name -> generator ``(tokenizer, n_tokens, depth, seed, filler=None, **task_options)``."""

DEPTH_FREE = frozenset({"common_words"})
"""Tasks whose generator ignores ``depth``: an evaluation builds them once per length and seed."""

__all__ = [
    "CLASSIC_FILLER",
    "DEPTH_FREE",
    "TASKS",
    "TaskExample",
    "common_words_example",
    "filler_text",
    "needle_multikey_example",
    "needle_multivalue_example",
    "needle_single_example",
    "passkey_example",
    "qa_example",
    "synthetic_filler",
    "variable_tracking_example",
]
