"""Variable tracking (RULER, Hsieh et al., 2024, arXiv:2404.06654): chains of assignments hidden in filler text,
``VAR QKZTW = 40213.`` then ``VAR MLOPA = VAR QKZTW.`` and so on; asked which variables hold
the value, the answer is every variable of its chain (multi-hop tracing).

Names are 5 random capital letters and values 5-digit numbers, as in RULER. ``depth`` places the
chain's first assignment; its later hops follow in order at seeded random depths between it and
the end. Further chains (``n_chains > 1``) with other values are distractors, spread anywhere.
"""

from __future__ import annotations

import random
import string

from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import fresh_item, haystack_prompt

_HEAD = (
    "Keep track of the variable assignments hidden in the text below. "
    "A variable assigned another variable gets its value.\n"
)
_QUESTION = (
    "\nQuestion: Which variables hold the value {value} in the text above?\n"
    "Answer: The {n} variables that hold the value {value} are:"
)


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _value(rng: random.Random) -> str:
    return str(rng.randrange(10**4, 10**5))


def _chain(rng, filler, taken: set[str], n_hops: int) -> tuple[str, list[str], list[str]]:
    """(value, variable names, assignment statements in order)."""
    value = fresh_item(rng, _value, filler, taken)
    names = [fresh_item(rng, _name, filler, taken) for _ in range(n_hops + 1)]
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return value, names, statements


def variable_tracking_example(
    tokenizer,
    n_tokens: int,
    depth: float,
    seed: int,
    filler: str | None = None,
    n_hops: int = 4,
    n_chains: int = 1,
) -> TaskExample:
    """A chain of ``n_hops`` assignments after the first (RULER: 4, so 5 variables) starting at
    ``depth``, plus ``n_chains - 1`` distractor chains; the answers are the chain's variables."""
    if n_hops < 0 or n_chains < 1:
        raise ValueError(f"need n_hops >= 0 and n_chains >= 1, got {n_hops} and {n_chains}")
    rng = random.Random(seed)
    taken: set[str] = set()
    value, names, statements = _chain(rng, filler, taken, n_hops)
    hops = [depth, *sorted(rng.uniform(depth, 1.0) for _ in range(n_hops))]
    needles = list(zip(hops, statements))
    for _ in range(n_chains - 1):
        other = _chain(rng, filler, taken, n_hops)[2]
        needles += zip(sorted(rng.random() for _ in other), other)
    question = _QUESTION.format(value=value, n=len(names))
    hay = haystack_prompt(tokenizer, n_tokens, seed, filler, _HEAD, needles, question)
    return TaskExample(hay.prompt, tuple(names), hay.needle_token_ranges[: len(statements)], hay.n_tokens)
