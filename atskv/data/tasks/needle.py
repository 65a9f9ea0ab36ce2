"""Needle in a haystack, RULER's variants (Hsieh et al., 2024, arXiv:2404.06654): a single key, several keys of
which one is asked for (the others are distractors), several values of one key that must all
be produced.

Keys are adjective-noun pairs ("crimson-falcon") and values 7-digit numbers, as in RULER.
``depth`` places the needle of the asked key (its first value for several values); the other
needles sit at seeded random depths. The question repeats the key and ends with "... is" /
"... are" so that a base model continues with the value(s).
"""

from __future__ import annotations

import random

from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import fresh_item, haystack_prompt

# Disjoint from the generated filler's words.
_KEY_ADJECTIVES = (
    "amber brave clever crimson dusty eager fancy gentle hollow icy jolly keen lively misty noble "
    "olive proud rapid silver tidy vivid witty zesty frozen"
).split()
_KEY_NOUNS = (
    "badger cactus dolphin falcon giraffe hammer igloo jacket koala lemon magnet otter pepper "
    "quartz rocket saddle tiger violin walrus yacht zebra anchor beacon compass"
).split()


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _value(rng: random.Random) -> str:
    return str(rng.randrange(10**6, 10**7))


def _texts(n_keys: int, n_values: int) -> tuple[str, str, str]:
    """(head, needle, question) in the singular or the plural."""
    if n_values == 1:
        head = (
            "A special magic number is hidden in the text below. Memorize it: I will ask you for it afterwards.\n"
            if n_keys == 1
            else "Special magic numbers for several keys are hidden in the text below. Memorize them: "
            "I will ask you for one of them afterwards.\n"
        )
        needle = "The special magic number for {key} is {value}."
        question = (
            "\nWhat is the special magic number for {key} in the text above? The special magic number for {key} is"
        )
    else:
        head = (
            "Special magic numbers are hidden in the text below. Memorize them: "
            "I will ask you for all the numbers of one key afterwards.\n"
        )
        needle = "One of the special magic numbers for {key} is {value}."
        question = (
            "\nWhat are all the special magic numbers for {key} in the text above? "
            "The special magic numbers for {key} are"
        )
    return head, needle, question


def _needle_example(tokenizer, n_tokens, depth, seed, filler, n_keys: int, n_values: int) -> TaskExample:
    if n_keys < 1 or n_values < 1:
        raise ValueError(f"n_keys and n_values must be positive, got {n_keys} and {n_values}")
    rng = random.Random(seed)
    head, needle, question = _texts(n_keys, n_values)
    taken: set[str] = set()
    keys = [fresh_item(rng, _key, filler, taken) for _ in range(n_keys)]
    values = [fresh_item(rng, _value, filler, taken) for _ in range(n_values)]
    asked = [(depth if i == 0 else rng.random(), needle.format(key=keys[0], value=v)) for i, v in enumerate(values)]
    distractors = [
        (rng.random(), needle.format(key=k, value=fresh_item(rng, _value, filler, taken))) for k in keys[1:]
    ]
    hay = haystack_prompt(
        tokenizer, n_tokens, seed, filler, head, asked + distractors, question.format(key=keys[0])
    )
    return TaskExample(hay.prompt, tuple(values), hay.needle_token_ranges[: len(asked)], hay.n_tokens)


def needle_single_example(tokenizer, n_tokens: int, depth: float, seed: int, filler: str | None = None) -> TaskExample:
    """One key with one value at ``depth``; the answer is the value."""
    return _needle_example(tokenizer, n_tokens, depth, seed, filler, n_keys=1, n_values=1)


def needle_multikey_example(
    tokenizer, n_tokens: int, depth: float, seed: int, filler: str | None = None, n_keys: int = 4
) -> TaskExample:
    """``n_keys`` keys with a value each (RULER: 4); one is asked for, its needle at ``depth``."""
    return _needle_example(tokenizer, n_tokens, depth, seed, filler, n_keys=n_keys, n_values=1)


def needle_multivalue_example(
    tokenizer, n_tokens: int, depth: float, seed: int, filler: str | None = None, n_values: int = 4
) -> TaskExample:
    """One key with ``n_values`` values (RULER: 4), all to be produced; the score is the fraction
    found. The first value's needle sits at ``depth``."""
    return _needle_example(tokenizer, n_tokens, depth, seed, filler, n_keys=1, n_values=n_values)
