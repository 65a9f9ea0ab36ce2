"""What every synthetic task produces: a prompt, its exact answers and an exact scorer."""

from __future__ import annotations

import re
from dataclasses import dataclass


def word_pattern(word: str) -> re.Pattern[str]:
    """``word`` as a whole word or number: "12345" is not found in "123456", "ABCDE" not in
    "ABCDEF"."""
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)")


@dataclass(frozen=True)
class TaskExample:
    """A prompt with the answers a generation must contain.

    ``needle_token_ranges`` are the (start, end exclusive) token spans of the statements the
    answers come from (distractors excluded; the first is the one placed at the requested
    depth; empty for tasks without needles). They and ``n_tokens`` index
    ``tokenizer(prompt).input_ids``, special tokens included, as a model sees the prompt.
    """

    prompt: str
    answers: tuple[str, ...]
    needle_token_ranges: tuple[tuple[int, int], ...]
    n_tokens: int

    @property
    def answer(self) -> str:
        """The answers as one line, for display."""
        return ", ".join(self.answers)

    def score(self, generated_text: str) -> float:
        """The fraction of the answers that appear in the generation as whole words or numbers
        (so 0 or 1 for a single answer). Case matters: answers are copied from the prompt."""
        found = sum(word_pattern(a).search(generated_text) is not None for a in self.answers)
        return found / len(self.answers)
