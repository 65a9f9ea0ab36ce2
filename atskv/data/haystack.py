"""Synthetic long-context tasks with exact answers ("needle in a haystack"), built locally.

Each example is a prompt of a requested token length in which a short needle (a pass key, ...)
sits at a requested relative depth inside filler text, plus the answer and an exact scorer.
Everything is a function of the seed, so the same example can be rebuilt for every selector
and every budget. The filler is generated from small word lists by default, so that no corpus
is needed; corpus text can be passed instead, which is closer to real use.

A new task is one builder function returning a ``TaskExample`` plus one line in ``TASKS``;
builders share the leading arguments ``(tokenizer, n_tokens, depth, seed, filler)``.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["CLASSIC_FILLER", "TASKS", "TaskExample", "passkey_example", "synthetic_filler"]


@dataclass(frozen=True)
class TaskExample:
    """A prompt with an exact answer.

    ``n_tokens`` and ``needle_token_range`` (start, end exclusive; ``None`` for tasks without a
    single needle) index ``tokenizer(prompt).input_ids``, special tokens included, as a model
    sees the prompt.
    """

    prompt: str
    answer: str
    needle_token_range: tuple[int, int] | None
    n_tokens: int

    def score(self, generated_text: str) -> bool:
        """True when the answer appears in the generation as a whole word or number
        ("123456" does not count as finding "12345")."""
        return re.search(rf"(?<!\w){re.escape(self.answer)}(?!\w)", generated_text) is not None


# --- filler ----------------------------------------------------------------------------------

_NOUNS = (
    "river garden window lantern meadow harbor forest village mountain letter kettle orchard "
    "bridge cloud road"
).split()
_ADJECTIVES = "green quiet old bright small distant warm gray narrow golden calm busy".split()
_VERBS = "crosses follows watches reaches passes circles faces touches".split()
_NAMES = "Anna Tomas Mira Jonas Clara Peter Ines Oskar".split()
_PLACES = [
    "near the hill",
    "after the rain",
    "by the sea",
    "in the morning",
    "under the stars",
    "at noon",
    "before winter",
    "along the shore",
]
_TEMPLATES = [
    "The {adj} {noun} {verb} the {noun2} {place}.",
    "{name} sees a {adj} {noun} {place}.",
    "The {noun} is {adj} and the {noun2} is {adj2}.",
    "{name} walks to the {noun} {place}.",
    "Here we go, there and back again.",
]


def _synthetic_sentences(rng: random.Random) -> Iterator[str]:
    """Endless varied, digit-free sentences: meaningless to the task, but not one repeated line
    that a model (or a selector) could dismiss as a trivially compressible pattern."""
    while True:
        yield rng.choice(_TEMPLATES).format(
            adj=rng.choice(_ADJECTIVES),
            adj2=rng.choice(_ADJECTIVES),
            noun=rng.choice(_NOUNS),
            noun2=rng.choice(_NOUNS),
            verb=rng.choice(_VERBS),
            name=rng.choice(_NAMES),
            place=rng.choice(_PLACES),
        )


# The repetitive haystack of the original pass-key test (Mohtashami & Jaggi, 2023). Small models
# (SmolLM2-135M) find the key in it at 2K tokens where varied filler already defeats them.
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def synthetic_filler(n_words: int, seed: int) -> str:
    """At least ``n_words`` words of generated filler sentences, deterministic by seed."""
    words, sentences = 0, []
    for sentence in _synthetic_sentences(random.Random(seed)):
        if words >= n_words:
            break
        sentences.append(sentence)
        words += len(sentence.split())
    return " ".join(sentences)


def _filler_pieces(seed: int, filler: str | None) -> Iterator[str]:
    """Endless words of filler, each with its trailing whitespace (so the pieces join back into
    the original layout). Corpus text starts at a seeded word and wraps around."""
    if filler is None:
        return (
            word + " "
            for sentence in _synthetic_sentences(random.Random(seed))
            for word in sentence.split()
        )
    pieces = re.findall(r"\S+\s*", filler)
    if not pieces:
        raise ValueError("filler text is empty")
    pieces[-1] = pieces[-1].rstrip() + " "  # where the text wraps around
    start = random.Random(seed).randrange(len(pieces))
    return itertools.cycle(pieces[start:] + pieces[:start])


_MIN_FILLER_TOKENS = 16
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*\s*$")


def _insertion_point(pieces: list[str], k: int, depth: float, reach: int = 40) -> int:
    """Index in ``pieces[:k]`` closest to ``depth * k`` that starts a sentence (within ``reach``
    words), so that the needle never lands in the middle of a filler sentence."""
    target = round(depth * k)
    for offset in range(reach + 1):
        for i in (target - offset, target + offset):
            if 0 <= i <= k and (i in (0, k) or _SENTENCE_END.search(pieces[i - 1])):
                return i
    return target


def _count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, verbose=False)["input_ids"])


def _fit_haystack(
    tokenizer, n_tokens: int, depth: float, pieces: Iterator[str], build: Callable[[str, str], str]
) -> tuple[str, int, str]:
    """The longest prompt ``build(before, after)`` of at most ``n_tokens`` tokens, where
    ``before + after`` are the first k filler words, split near ``depth``.

    Token counts are not additive over words (tokens merge across the joins), so k is found by
    measuring whole prompts: an interpolation search, bisecting when one side keeps moving,
    which takes a handful of tokenizer calls at any length. Returns (prompt, its token count,
    before).
    """
    words: list[str] = []

    def measure(k: int) -> tuple[int, str, str]:
        if len(words) < k:
            words.extend(itertools.islice(pieces, k - len(words)))
        cut = _insertion_point(words, k, depth)
        before = "".join(words[:cut])
        prompt = build(before, "".join(words[cut:k]))
        return _count_tokens(tokenizer, prompt), prompt, before

    lo, best = 0, measure(0)
    hi = n_tokens - best[0] + 16  # a word is at least one token, so this is usually too many
    f_hi = measure(hi)[0]
    while f_hi <= n_tokens:  # ... unless the tokenizer merges whole words
        hi *= 2
        f_hi = measure(hi)[0]
    streak, last_side = 0, 0
    while hi - lo > 1 and best[0] < n_tokens:
        if streak < 2:
            k = lo + (n_tokens - best[0]) * (hi - lo) // (f_hi - best[0])
        else:
            k = (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
        trial = measure(k)
        side = 1 if trial[0] <= n_tokens else -1
        if side > 0:
            lo, best = k, trial
        else:
            hi, f_hi = k, trial[0]
        streak, last_side = (streak + 1 if side == last_side else 1), side
    return best[1], best[0], best[2]


def _check_length_and_depth(tokenizer, n_tokens: int, depth: float, template: str) -> None:
    """Reject a depth outside [0, 1] and a length that leaves the template (a task's prompt
    without filler) less than a sentence of filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    minimum = _count_tokens(tokenizer, template) + _MIN_FILLER_TOKENS
    if n_tokens < minimum:
        raise ValueError(
            f"n_tokens={n_tokens} is too small for this task's template: "
            f"it needs at least {minimum} tokens with this tokenizer"
        )


# --- tasks -----------------------------------------------------------------------------------

_PASSKEY_INTRO = (
    "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
_PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
_PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def _passkey_prompt(needle: str, before: str, after: str) -> str:
    return _PASSKEY_INTRO + (before + needle + after).rstrip() + _PASSKEY_QUESTION


def passkey_example(
    tokenizer,
    n_tokens: int,
    depth: float,
    seed: int,
    filler: str | None = None,
    digits: int = 5,
) -> TaskExample:
    """Classic pass-key retrieval: a random ``digits``-digit key stated once inside filler text,
    asked for at the end; the prompt ends with "The pass key is" so that a base model completes
    it.

    The prompt has at most ``n_tokens`` tokens and falls short by less than a word or two.
    ``depth`` places the needle at that fraction of the filler (0: right after the instructions,
    1: right before the question), moved to the nearest sentence start. ``filler`` is text to
    use as the haystack (e.g. joined corpus documents, wrapped around if too short) instead of
    generated sentences; a key that happens to occur in it is redrawn.
    """
    if digits < 1:
        raise ValueError(f"digits must be positive, got {digits}")
    template = _PASSKEY_INTRO + _PASSKEY_NEEDLE.format(key="7" * digits) + _PASSKEY_QUESTION
    _check_length_and_depth(tokenizer, n_tokens, depth, template)
    rng = random.Random(seed)
    for _ in range(100):
        key = str(rng.randrange(10 ** (digits - 1), 10**digits))
        needle = _PASSKEY_NEEDLE.format(key=key)
        prompt, length, before = _fit_haystack(
            tokenizer,
            n_tokens,
            depth,
            _filler_pieces(seed, filler),
            functools.partial(_passkey_prompt, needle),
        )
        if prompt.count(key) == 2:  # only in the needle
            break
    else:
        raise ValueError("could not draw a pass key that does not occur in the filler text")
    start = len(_PASSKEY_INTRO) + len(before)
    return TaskExample(
        prompt, key, _token_span(tokenizer, prompt, start, start + len(needle)), length
    )


def _token_span(tokenizer, prompt: str, start: int, end: int) -> tuple[int, int]:
    """Token indices covering characters [start, end) of ``prompt``, counted by tokenizing the
    text before each end. Whitespace before a boundary is left out of the count because
    tokenizers attach a leading space to the next word."""
    return (
        _count_tokens(tokenizer, prompt[:start].rstrip()),
        _count_tokens(tokenizer, prompt[:end].rstrip()),
    )


TASKS: dict[str, Callable[..., TaskExample]] = {
    "passkey": passkey_example,
}
"""Task name -> builder ``(tokenizer, n_tokens, depth, seed, filler=None, **task_options)``."""
