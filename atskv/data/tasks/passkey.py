"""Pass-key retrieval (Mohtashami & Jaggi, 2023, "Landmark Attention: Random-Access Infinite Context
Length for Transformers", arXiv:2305.16300): a random number stated once inside filler text, asked
for at the end."""

from __future__ import annotations

import random

from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import fresh_item, haystack_prompt

_INTRO = (
    "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_example(
    tokenizer,
    n_tokens: int,
    depth: float,
    seed: int,
    filler: str | None = None,
    digits: int = 5,
) -> TaskExample:
    """A random ``digits``-digit key stated once at ``depth`` of the filler; the prompt ends
    with "The pass key is" so that a base model completes it. ``filler``: haystack text (e.g.
    joined corpus documents) instead of generated sentences; a key found in it is redrawn.
    """
    if digits < 1:
        raise ValueError(f"digits must be positive, got {digits}")
    rng = random.Random(seed)
    key = fresh_item(rng, lambda r: str(r.randrange(10 ** (digits - 1), 10**digits)), filler, set())
    hay = haystack_prompt(tokenizer, n_tokens, seed, filler, _INTRO, [(depth, _NEEDLE.format(key=key))], _QUESTION)
    return TaskExample(hay.prompt, (key,), hay.needle_token_ranges, hay.n_tokens)
