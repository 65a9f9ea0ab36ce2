"""Haystacks: filler text, fitting a prompt to a token length, and needles placed at depths.

A haystack prompt is ``head + filler with needles inserted + tail``. The filler is generated
from small word lists by default, so that no corpus is needed; corpus text can be passed
instead, which is closer to real use. Everything is a function of the seed, so the same example
can be rebuilt for every selector and every budget.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
# Every word generated filler can contain: what a drawn answer must not occur in.
_SYNTHETIC_VOCABULARY = " ".join([*_NOUNS, *_ADJECTIVES, *_VERBS, *_NAMES, *_PLACES, *_TEMPLATES])


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


def filler_text(spec: str) -> str | None:
    """Haystack text by name: "classic" (``CLASSIC_FILLER``), "varied" (``None``: generated
    sentences), or a corpus (name, folder or hf:...) whose documents are joined."""
    if spec == "classic":
        return CLASSIC_FILLER
    if spec == "varied":
        return None
    from atskv.data.readers import load_corpus

    return "\n\n".join(doc.text for doc in load_corpus(spec))


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


def fresh_item(rng: random.Random, draw: Callable[[random.Random], str], filler: str | None, taken: set[str]) -> str:
    """A newly drawn item (key, value, variable name) that is not in ``taken`` and nowhere in the
    filler text (the generated filler's vocabulary when ``filler`` is None), so that each answer
    occurs in the prompt only where the task puts it. It is added to ``taken``."""
    text = _SYNTHETIC_VOCABULARY if filler is None else filler
    for _ in range(100):
        item = draw(rng)
        if item not in taken and item not in text:
            taken.add(item)
            return item
    raise ValueError("could not draw a key or value that does not occur in the filler text")


# --- fitting to a token length ---------------------------------------------------------------

_MIN_FILLER_TOKENS = 16


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, verbose=False)["input_ids"])


def fit_to_length(tokenizer, n_tokens: int, build: Callable[[int], str]) -> tuple[int, str, int]:
    """The largest k whose ``build(k)`` has at most ``n_tokens`` tokens, assuming the count grows
    with k by at least a token per step (k: filler words, list entries, ...). Returns
    (k, prompt, its token count).

    Token counts are not additive (tokens merge across joins), so whole prompts are measured:
    an interpolation search, bisecting when one side keeps moving, which takes a handful of
    tokenizer calls at any length. ``build(0)`` is the task's template; a length that leaves it
    less than a sentence of room is refused.
    """

    def measure(k: int) -> tuple[int, str]:
        prompt = build(k)
        return count_tokens(tokenizer, prompt), prompt

    lo, best = 0, measure(0)
    minimum = best[0] + _MIN_FILLER_TOKENS
    if n_tokens < minimum:
        raise ValueError(
            f"n_tokens={n_tokens} is too small for this task's template: "
            f"it needs at least {minimum} tokens with this tokenizer"
        )
    hi = n_tokens - best[0] + 16  # a step is at least one token, so this is usually too many
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
    return lo, best[1], best[0]


def token_span(tokenizer, prompt: str, start: int, end: int) -> tuple[int, int]:
    """Token indices covering characters [start, end) of ``prompt``, counted by tokenizing the
    text before each end. Whitespace before a boundary is left out of the count because
    tokenizers attach a leading space to the next word."""
    return (
        count_tokens(tokenizer, prompt[:start].rstrip()),
        count_tokens(tokenizer, prompt[:end].rstrip()),
    )


# --- needles ---------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*\s*$")


def _insertion_point(pieces: list[str], k: int, depth: float, reach: int = 40) -> int:
    """Index in ``pieces[:k]`` closest to ``depth * k`` that starts a sentence (within ``reach``
    words), so that a needle never lands in the middle of a filler sentence. Monotone in
    ``depth``, so needles keep the order of their depths."""
    target = round(depth * k)
    for offset in range(reach + 1):
        for i in (target - offset, target + offset):
            if 0 <= i <= k and (i in (0, k) or _SENTENCE_END.search(pieces[i - 1])):
                return i
    return target


@dataclass(frozen=True)
class Haystack:
    """A fitted haystack prompt; ``needle_token_ranges`` follow the order the needles were given."""

    prompt: str
    n_tokens: int
    needle_token_ranges: tuple[tuple[int, int], ...]


def haystack_prompt(
    tokenizer,
    n_tokens: int,
    seed: int,
    filler: str | None,
    head: str,
    needles: Sequence[tuple[float, str]],
    tail: str,
) -> Haystack:
    """The longest prompt ``head + filler + tail`` of at most ``n_tokens`` tokens (short by less
    than a word or two) with each ``(depth, text)`` needle inserted at that fraction of the
    filler (0: right after the head, 1: right before the tail), moved to the nearest sentence
    start. Needles at the same point keep their given order. ``filler``: text to use as the
    haystack (wrapped around if too short) instead of generated sentences.
    """
    for depth, _ in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    pieces, words = _filler_pieces(seed, filler), []

    def layout(k: int) -> tuple[str, list[tuple[int, int]]]:
        """The prompt with k filler words, and each needle's character span (in given order)."""
        if len(words) < k:
            words.extend(itertools.islice(pieces, k - len(words)))
        parts, spans, done, at = [head], [None] * len(needles), 0, len(head)
        for i in order:
            depth, text = needles[i]
            cut = _insertion_point(words, k, depth)
            before = "".join(words[done:cut])
            at += len(before)
            spans[i] = (at, at + len(text))
            parts += [before, text, " "]
            at, done = at + len(text) + 1, cut
        parts.append("".join(words[done:k]))
        return "".join(parts).rstrip() + tail, spans

    k, prompt, length = fit_to_length(tokenizer, n_tokens, lambda k: layout(k)[0])
    ranges = tuple(token_span(tokenizer, prompt, start, end) for start, end in layout(k)[1])
    return Haystack(prompt, length, ranges)
