"""Generate with dense KV and with selectors at a budget, measuring what a user compares:
the answer, the KV bytes the cache actually holds, and the speed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from atskv.data import TaskExample
from atskv.models.cache_names import with_cache
from atskv.runtime.fast.host_pages import HostRetrieval
from atskv.runtime.fast.loop import generate as generate_fast
from atskv.runtime.reference.tiered import memory_session
from atskv.selectors import Selector
from atskv.selectors.base import LAST_QUERIES
from atskv.slot_cache import kv_bytes


@dataclass(frozen=True)
class GenerationRun:
    """One generation: `label` names the setting (`dense`, or `selector@budget`)."""

    label: str
    text: str
    score: float | None  # TaskExample.score of the text: the fraction of the answers found
    kv_bytes: int | None  # None on the fast path (its static cache is sized before the prompt)
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float  # prompt in, first token out
    decode_seconds: float  # the remaining tokens

    @property
    def correct(self) -> bool | None:
        """Every answer found."""
        return None if self.score is None else self.score == 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")


class TokenClock(BaseStreamer):
    """Timestamps each `put` of `generate` after a device sync: first the prompt, then every new
    token, and `end` once more."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.put(None)

    def decode_gaps(self) -> list[float]:
        """Seconds between consecutive new tokens (the decode steps after the first token)."""
        tokens = self.times[1:-1]
        return [b - a for a, b in zip(tokens, tokens[1:])]


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pad_left(tokenizer, sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[B, T]` and attention mask of 1-D sequences of different lengths, left-padded so
    that every row ends where generation continues (the hook supports left padding)."""
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), _pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :], mask[row, width - len(seq) :] = seq, 1
    return ids, mask


def generate(
    model,
    tokenizer,
    ids: torch.Tensor,
    *,
    selector: str | Selector | None = None,
    budget: int | float | None = None,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    max_new_tokens: int = 16,
    example: TaskExample | None = None,
    tiering: dict | None = None,
) -> GenerationRun:
    """Greedy generation of one prompt `[1, T]` with dense KV (`selector=None`) or under `atskv.sparse`."""
    return generate_batch(
        model,
        tokenizer,
        ids,
        selector=selector,
        budget=budget,
        dense_layers=dense_layers,
        sparse_prefill=sparse_prefill,
        max_new_tokens=max_new_tokens,
        examples=[example],
        tiering=tiering,
    )[0]


def generate_batch(
    model,
    tokenizer,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    selector: str | Selector | None = None,
    budget: int | float | None = None,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    max_new_tokens: int = 16,
    examples: Sequence[TaskExample | None] | None = None,
    tiering: dict | None = None,
    fast: bool = False,
    host: HostRetrieval | None = None,
) -> list[GenerationRun]:
    """Greedy generation of a batch `[B, T]` (left-padded, see `pad_left`), one run per row, under
    `atskv.sparse`, or `atskv.tiered` with the `tiering` options when given; with `fast`, a
    selector runs on `atskv.generate`'s fast path instead (the prompt in one chunk, as the
    reference prefills it: the same choices, bf16 rounding aside), with the host tier `host`
    when given.

    A row's text ends at its first end-of-sequence token. The timings are the batch's; `kv_bytes`
    is the row's share of the batch cache (padding included)."""
    ids = ids.to(model.device)
    attention_mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(model.device)
    longest = int(attention_mask.sum(-1).max()) + max_new_tokens
    if selector is not None and isinstance(budget, int) and not isinstance(budget, bool) and budget >= longest:
        raise ValueError(
            f"budget {budget} is not smaller than the whole context ({longest} tokens: prompt plus "
            f"{max_new_tokens} new), so nothing would ever be dropped; choose a smaller budget or a fraction"
        )
    kwargs = dict(
        attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=_pad_id(tokenizer)
    )
    clock = TokenClock(model.device)
    kwargs["streamer"] = clock
    start = time.perf_counter()
    with torch.inference_mode():
        if selector is None:
            cache = DynamicCache(config=model.config)
            out = model.generate(ids, **with_cache(model, cache), **kwargs)
            label = "dense"
        elif fast:
            if sparse_prefill or tiering is not None:
                raise ValueError("the fast path prefills densely and has no tiered store here; use fast=False")
            out = generate_fast(
                model, ids, selector, budget, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                dense_layers=dense_layers, prefill_chunk=max(ids.shape[1], LAST_QUERIES), streamer=clock, tier=host,
            )  # fmt: skip
            cache, label = None, f"{getattr(selector, 'name', selector)}@{budget}"
        else:
            if host is not None:
                raise ValueError("a host tier runs on the fast path: use fast=True")
            with memory_session(
                model, selector, budget, dense_layers=dense_layers, sparse_prefill=sparse_prefill, tiering=tiering
            ) as session:
                out = model.generate(ids, **kwargs)
                cache = session.cache
            label = f"{session.selector.name}@{budget}"
    first_token, last_token = clock.times[1], clock.times[-2]
    stops = _eos_ids(model, tokenizer)
    runs = []
    for row, example in enumerate(examples or [None] * len(ids)):
        new = out[row, ids.shape[1] :].tolist()
        ends = [i for i, token in enumerate(new) if token in stops]
        new = new[: ends[0] + 1] if ends else new
        text = tokenizer.decode(new, skip_special_tokens=True)
        runs.append(
            GenerationRun(
                label=label,
                text=text,
                score=example.score(text) if example is not None else None,
                kv_bytes=None if cache is None else kv_bytes(cache) // len(ids),
                prompt_tokens=int(attention_mask[row].sum()),
                new_tokens=len(new),
                prefill_seconds=first_token - start,
                decode_seconds=last_token - first_token,
            )
        )
    return runs


def _eos_ids(model, tokenizer) -> set[int]:
    """Tokens that end a generation: the model's generation config and the tokenizer may each name some."""
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {token for token in (*eos, tokenizer.eos_token_id) if token is not None}


def markdown_table(runs: list[GenerationRun]) -> str:
    """The comparison as a markdown table; KV is also shown relative to the dense run if present."""
    dense = next((r for r in runs if r.label == "dense"), None)
    lines = [
        "| setting | answer correct | KV held | vs dense | prefill s | decode tokens/s | output |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ratio = f"{r.kv_bytes / dense.kv_bytes:.1%}" if dense else "-"
        correct = "-" if r.correct is None else ("yes" if r.correct else "no")
        text = r.text.strip().replace("\n", " ").replace("|", "\\|")[:32]
        lines.append(
            f"| {r.label} | {correct} | {r.kv_bytes / 2**20:.2f} MiB | {ratio} | {r.prefill_seconds:.2f} "
            f"| {r.decode_tokens_per_s:.1f} | {text} |"
        )
    return "\n".join(lines)
