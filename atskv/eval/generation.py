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
from atskv.errors import is_int
from atskv.eval.method import HOOK, HOST, OWN, TIERED
from atskv.models.cache_names import with_cache
from atskv.runtime.fast.host_pages import HostRetrieval
from atskv.runtime.fast.loop import generate as generate_fast
from atskv.runtime.reference.tiered import memory_session
from atskv.selectors import Selector
from atskv.selectors.base import LAST_QUERIES
from atskv.slot_cache import kv_bytes


@dataclass(frozen=True)
class Runtime:
    """Where `generate_batch` runs a selector: one of `atskv.eval.method`'s atskv runtimes and its
    own options. HOOK: `atskv.sparse` under `model.generate`; TIERED: `atskv.tiered`, with the
    `tiering` options; OWN: the fast path, `atskv.generate` (its prefill is dense); HOST: the fast
    path with the host tier `host`. `sparse_prefill` is the reference runtimes' (HOOK, TIERED).
    An option the runtime does not take is refused here, once for every caller."""

    kind: str = HOOK
    sparse_prefill: bool = False
    tiering: dict | None = None
    host: HostRetrieval | None = None

    def __post_init__(self):
        if self.kind not in (HOOK, TIERED, OWN, HOST):
            raise ValueError(f"generate_batch runs on hook, tiered, the fast path ('') or host, not {self.kind!r}")
        if self.sparse_prefill and self.kind not in (HOOK, TIERED):
            raise ValueError("the fast path prefills densely: sparse prefill runs on the reference runtimes")
        if (self.tiering is not None) != (self.kind == TIERED):
            raise ValueError("the two-tier store's options go with the tiered runtime, and it needs them")
        if (self.host is not None) != (self.kind == HOST):
            raise ValueError("a host tier goes with the host runtime (the fast path's), and it needs one")

    @classmethod
    def reference(cls, sparse_prefill: bool = False, tiering: dict | None = None) -> Runtime:
        """The hook, or the two-tier store when `tiering` (its options) is given."""
        return cls(TIERED if tiering is not None else HOOK, sparse_prefill, tiering)


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


def generate_one(
    model,
    tokenizer,
    ids: torch.Tensor,
    *,
    selector: str | Selector | None = None,
    budget: int | float | None = None,
    dense_layers: int = 2,
    max_new_tokens: int = 16,
    example: TaskExample | None = None,
    runtime: Runtime | None = None,
) -> GenerationRun:
    """Greedy generation of one prompt `[1, T]` with dense KV (`selector=None`) or a selector on `runtime`."""
    return generate_batch(
        model, tokenizer, ids, selector=selector, budget=budget, dense_layers=dense_layers,
        max_new_tokens=max_new_tokens, examples=[example], runtime=runtime,
    )[0]  # fmt: skip


def generate_batch(
    model,
    tokenizer,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    selector: str | Selector | None = None,
    budget: int | float | None = None,
    dense_layers: int = 2,
    max_new_tokens: int = 16,
    examples: Sequence[TaskExample | None] | None = None,
    runtime: Runtime | None = None,
) -> list[GenerationRun]:
    """Greedy generation of a batch `[B, T]` (left-padded, see `pad_left`), one run per row, with
    dense KV (`selector=None`: transformers' own cache) or the selector on `runtime`. On the fast
    path the prompt goes in one chunk, as the reference prefills it: the same choices, bf16
    rounding aside.

    A row's text ends at its first end-of-sequence token. The timings are the batch's; `kv_bytes`
    is the row's share of the batch cache (padding included)."""
    runtime = runtime or Runtime()
    ids = ids.to(model.device)
    attention_mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(model.device)
    longest = int(attention_mask.sum(-1).max()) + max_new_tokens
    if selector is not None and is_int(budget) and budget >= longest:
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
        elif runtime.kind in (OWN, HOST):
            out = generate_fast(
                model, ids, selector, budget, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                dense_layers=dense_layers, prefill_chunk=max(ids.shape[1], LAST_QUERIES), streamer=clock,
                tier=runtime.host,
            )  # fmt: skip
            cache, label = None, f"{getattr(selector, 'name', selector)}@{budget}"
        else:
            with memory_session(
                model, selector, budget, dense_layers=dense_layers, sparse_prefill=runtime.sparse_prefill,
                tiering=runtime.tiering,
            ) as session:
                out = model.generate(ids, **kwargs)
                cache = session.cache
            label = f"{session.selector.name}@{budget}"
    first_token, last_token = clock.times[1], clock.times[-2]
    stops = eos_ids(model, tokenizer)
    runs = []
    for row, example in enumerate(examples or [None] * len(ids)):
        new = cut_at_eos(out[row, ids.shape[1] :].tolist(), stops)
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


def cut_at_eos(tokens: list[int], stops: set[int]) -> list[int]:
    """A generation's tokens up to and with its first end of sequence (`eos_ids`)."""
    ends = [i for i, token in enumerate(tokens) if token in stops]
    return tokens[: ends[0] + 1] if ends else tokens


def eos_ids(model, tokenizer) -> set[int]:
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
