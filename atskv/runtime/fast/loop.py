"""`atskv.generate`: the fast path's greedy generation loop. The prompt in chunks that never build
a `[T, T]` buffer (`StaticSession`), then decode steps with static shapes and no host
synchronisation, captured once in a CUDA graph (`GraphedStep`) and replayed for every token."""

from __future__ import annotations

import math

import torch

from atskv.models.cache_names import with_cache
from atskv.runtime.fast.compiled import compiled_layers
from atskv.runtime.fast.graph import GraphedStep
from atskv.runtime.fast.host_pages import HostRetrieval
from atskv.runtime.fast.session import StaticSession
from atskv.runtime.fast.static_cache import StaticKVCache
from atskv.runtime.reference.sparse import SparsityConfig, attach
from atskv.selectors import resolve_selector
from atskv.selectors.base import LAST_QUERIES, Selector


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    selector: Selector | str = "dense",
    budget: int | float = 0.1,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    dense_layers: int = 2,
    prefill_chunk: int = 4096,
    cuda_graph: bool = True,
    eos_token_id: int | None = None,
    streamer=None,
    tier: HostRetrieval | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Greedy generation under a selector and budget on the fast path: `[B, T + new]` token ids.

    >>> out = atskv.generate(model, ids, "quest", budget=0.05, max_new_tokens=64)

    Same tokens as `with atskv.sparse(model, selector, budget): model.generate(ids, do_sample=False)`
    for a selector that has a fast path (`Selector.has_fast_path`); prompts are processed `prefill_chunk`
    tokens at a time.
    `streamer`: as transformers' (`put` gets the prompt, then each new token `[B, 1]`; `end`).
    `tier`: keep every token in pinned host memory as well and read the best parked pages back
    at each step (`HostRetrieval`); `budget` is then what stays on the GPU.
    `compile`: run the decode steps through `torch.compile`d decoder layers (`compiled_layers`):
    the model's own norms, rotary embedding and MLP glue fused, the step's many small torch
    kernels (the gain: docs/results.md, "Decode speed against plain transformers"); the first call
    in a process compiles, for seconds at a large model's shape. Rounding then
    differs from the eager reference in bf16, as any fused kernel's does."""
    selector = resolve_selector(selector, model)  # as atskv.sparse: a name finds the model's own predictor
    if max_new_tokens < 1 or prefill_chunk < LAST_QUERIES:
        raise ValueError(
            f"need max_new_tokens >= 1 and prefill_chunk >= {LAST_QUERIES}, got {max_new_tokens}, {prefill_chunk}"
        )
    b, t = input_ids.shape
    session = StaticSession(model, selector, SparsityConfig(budget, dense_layers), t, max_new_tokens, prefill_chunk,
                            tier, batch=b)  # fmt: skip
    with attach(model, session):
        return _generate(model, session, input_ids, attention_mask, max_new_tokens, prefill_chunk, cuda_graph,
                         eos_token_id, streamer, compile)  # fmt: skip


def prompt_chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """`(start, stop)` of each prompt chunk: a short first one, then full ones, so the last chunk
    (whose queries SnapKV-style selectors read, `LAST_QUERIES`) is a full one."""
    first = tokens - (math.ceil(tokens / chunk) - 1) * chunk
    starts = [0, *range(first, tokens, chunk)]
    return [(start, min(start + (first if start == 0 else chunk), tokens)) for start in starts]


def _prefill(model, session: StaticSession, ids, positions, real, chunk: int,
             row: int = 0) -> tuple[StaticKVCache, torch.Tensor]:  # fmt: skip
    """The prompt in chunks of `chunk` tokens (the last one full) into a new cache, finished for
    decoding; returns it and the last position's logits `[B, vocab]`. `row`: which row of the
    call `ids` is, when rows are prefilled one at a time (a host tier parks it there)."""
    t = ids.shape[1]
    session.real, session.pads, session.row = real, left_padding(real), row
    cache = session.new_cache()
    given = with_cache(model, cache)
    for start, stop in prompt_chunks(t, chunk):
        logits = model(input_ids=ids[:, start:stop], position_ids=positions[:, start:stop], **given, use_cache=True,
                       logits_to_keep=1).logits  # fmt: skip
    session.finish_prompt(real)
    session.real = session.pads = None
    return cache, logits[:, -1]


def left_padding(real: torch.Tensor | None) -> list[int] | None:
    """How many pad tokens lead each row of `real` `[B, T]`, when no pad follows a real token in
    any row (None: no mask, or pads inside a row). One host sync per prefill."""
    if real is None:
        return None
    pads = (~real).sum(-1)
    leading = torch.arange(real.shape[1], device=real.device) >= pads.unsqueeze(-1)
    return pads.tolist() if bool((real == leading).all()) else None


def _generate(model, session, input_ids, attention_mask, max_new_tokens, prefill_chunk, cuda_graph, eos_token_id,
              streamer, compile: bool):  # fmt: skip
    b, t = input_ids.shape
    emit = streamer.put if streamer is not None else lambda tokens: None
    emit(input_ids)
    device = input_ids.device
    real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
    if real is not None:
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(t, device=device).expand(b, t)
    if session.selector.evicts and b > 1:  # each row compressed before the next: the prompt KV of one row at a time
        rows = [_prefill(model, session, input_ids[i : i + 1], positions[i : i + 1],
                         None if real is None or bool(real[i].all()) else real[i : i + 1], prefill_chunk, i)
                for i in range(b)]  # fmt: skip
        cache, logits = StaticKVCache.stack([c for c, _ in rows]), torch.cat([lg for _, lg in rows])
    else:
        cache, logits = _prefill(model, session, input_ids, positions, real, prefill_chunk)
    token = logits.argmax(-1)
    emit(token.view(b, 1))
    ids_in = token.view(b, 1).clone()
    pos_in = positions[:, -1:] + 1

    counted = session.step_counters(cache)
    given = with_cache(model, cache)

    def step() -> torch.Tensor:
        return counted(lambda: model(input_ids=ids_in, position_ids=pos_in, **given, use_cache=True).logits[:, -1])

    run = GraphedStep(step, device, cuda_graph)
    out = [token]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    first_managed = min((i for i in session.managed_layers if session.is_managed(i)), default=None)
    with compiled_layers(model, compile):
        for _ in range(max_new_tokens - 1):
            if eos_token_id is not None:
                done |= token == eos_token_id
            for layer in cache.layers:  # host-side count of tokens written (the step writes one)
                layer.seen += 1
            variant = None if first_managed is None else session.selector.decode_variant(cache.layers[first_managed])
            token = run(variant).argmax(-1)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
            out.append(token)
            emit(token.view(b, 1))
            ids_in.copy_(token.view(b, 1))
            pos_in += 1
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1)
