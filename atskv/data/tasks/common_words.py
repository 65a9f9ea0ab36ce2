"""Common-word extraction (RULER, Hsieh et al., 2024, arXiv:2404.06654): a long numbered list of words in which a
few words occur many times and all others a few times; the answer is the frequent ones (an
aggregation task: the evidence is spread over the whole context, no single needle).

The words are pronounceable pseudo-words drawn from syllables (``kamuro``): unlimited distinct
words for any length, none favoured by a model's prior. The list is the whole context, so
``depth`` and ``filler`` are ignored. The length is fitted by the number of rare words.
"""

from __future__ import annotations

import random

from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import fit_to_length, fresh_item

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
_HEAD = (
    "Below is a numbered list of words. Some words occur many times, the others only a few times. "
    "Remember the ones that occur most often.\n"
)
_QUESTION = (
    "\nQuestion: Which {n} words occur most often in the list above?\n"
    "Answer: The {n} words that occur most often in the list are:"
)


def _word(rng: random.Random) -> str:
    return "".join(rng.choices(_SYLLABLES, k=rng.choice((2, 3))))


def common_words_example(
    tokenizer,
    n_tokens: int,
    depth: float,
    seed: int,
    filler: str | None = None,
    n_common: int = 10,
    common_repeats: int | None = None,
    rare_repeats: int | None = None,
) -> TaskExample:
    """``n_common`` words (RULER: 10) each occurring ``common_repeats`` times among rare words
    occurring ``rare_repeats`` times each; RULER's defaults are 30 and 3, or 6 and 1 below 4096
    tokens. The answers are the ``n_common`` frequent words."""
    if common_repeats is None:
        common_repeats = 6 if n_tokens < 4096 else 30
    if rare_repeats is None:
        rare_repeats = 1 if n_tokens < 4096 else 3
    if n_common < 1 or not common_repeats > rare_repeats >= 1:
        raise ValueError(
            "need n_common >= 1 and common_repeats > rare_repeats >= 1, "
            f"got {n_common}, {common_repeats}, {rare_repeats}"
        )
    rng, taken = random.Random(seed), set()
    common = [fresh_item(rng, _word, None, taken) for _ in range(n_common)]
    rare: list[str] = []  # drawn in order as the fitting asks for more, so rare[:k] depends on k only

    def build(k: int) -> str:
        rare.extend(fresh_item(rng, _word, None, taken) for _ in range(k - len(rare)))
        words = common * common_repeats + rare[:k] * rare_repeats
        random.Random(seed).shuffle(words)
        listing = " ".join(f"{i}. {word}" for i, word in enumerate(words, 1))
        return _HEAD + listing + _QUESTION.format(n=n_common)

    _, prompt, length = fit_to_length(tokenizer, n_tokens, build)
    return TaskExample(prompt, tuple(common), (), length)
