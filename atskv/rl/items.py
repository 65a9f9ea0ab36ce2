"""What a rollout runs on: a context of T tokens whose retention the policy decides at its last
token (t = T - 1), followed by a continuation of C tokens that is scored with what was kept.

Two sources: corpus windows (the continuation is the text that follows; performance -NLL) and
synthetic task prompts (the continuation is the answer; exact-match applies). Task prompts are
built as the collection builds them (`atskv.predictor.collect.task_prompt`), from a seed range
the caller picks: training from `TASK_SEED_BASE`, held-out evaluation elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

CORPUS = "corpus"


@dataclass
class RolloutItem:
    """One context and its continuation (mutable only so that Lightning can move `ids` to the device)."""

    ids: torch.Tensor  # [T + C] token ids: context, then continuation
    context: int  # T
    source: str  # CORPUS, or the task's name

    def __post_init__(self):
        if not 1 <= self.context <= self.ids.numel() - 2:
            raise ValueError(
                f"a rollout item needs a context of at least 1 token and a continuation of at least 2 "
                f"(one predicted before the decision's effect, one after); got {self.context} and "
                f"{self.ids.numel() - self.context}"
            )

    @property
    def is_task(self) -> bool:
        return self.source != CORPUS


def corpus_items(
    tokenizer, corpus: str, n_windows: int, context_tokens: int, continuation_tokens: int
) -> list[RolloutItem]:
    """`n_windows` windows of `context_tokens + continuation_tokens` spread evenly over `corpus`."""
    from atskv.data import corpus_windows

    windows = corpus_windows(tokenizer, corpus, context_tokens + continuation_tokens, n_windows)
    return [RolloutItem(w, context_tokens, CORPUS) for w in windows]


def task_items(tokenizer, tasks: Sequence[str], seeds: Iterable[int], n_tokens: int) -> list[RolloutItem]:
    """One prompt (about `n_tokens` long) per task and seed, its answer as the continuation."""
    from atskv.predictor.collect import task_prompt

    items = []
    for seed in seeds:
        for task in tasks:
            prompt, answer = task_prompt(tokenizer, task, n_tokens, seed)
            items.append(RolloutItem(torch.cat([prompt, answer]), prompt.numel(), task))
    return items
