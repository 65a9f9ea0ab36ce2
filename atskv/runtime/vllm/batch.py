"""How the plugin splits one of vLLM's batches (pure Python and torch: tested without vLLM).

vLLM puts the decode requests first when a builder asks for it (`reorder_batch_threshold = 1`), so
a batch is `decodes` one-token queries, then the prefill (or chunked-prefill) requests. The
decodes go through atskv's selection; the rest through FlashAttention with this share of the
metadata: its query offsets moved down by the decode tokens, its rows of lengths and block
table, and no ahead-of-time schedule (that one was planned for the whole batch). A selector that
scores the prompt gets each prefill request's prompt tokens of the batch; tokens past a
request's prompt (a recompute's outputs) are read as decodes are (`prefill_rows`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import torch

from atskv.kernels.paged import physical_slots
from atskv.kernels.received_mass import paged_received_mass, prefix_lse


def prefill_share(metadata, decodes: int):
    """FlashAttention metadata (a dataclass with vLLM's field names) for the requests after the
    first `decodes` one-token ones."""
    return dataclasses.replace(
        metadata,
        num_actual_tokens=metadata.num_actual_tokens - decodes,
        query_start_loc=metadata.query_start_loc[decodes:] - decodes,
        seq_lens=metadata.seq_lens[decodes:],
        block_table=metadata.block_table[decodes:],
        scheduler_metadata=None,
        max_num_splits=0,
    )


# A prompt's last token reaches the model as a one-token row where the chunk before it ended one
# short (vLLM runs such a row as a decode, in a CUDA graph where no Python runs): the chunk that
# reaches the prompt's last PROMPT_TAIL tokens ends it for the selectors that rank it, and a token
# after that chunk is read as decodes are (`prefill_rows`), whichever way it comes. Every other
# prompt token is attended by FlashAttention, as a dense prefill has it, and seen by the ranking
# (the question at a prompt's end included). vLLM's scheduler serves a request it cut short first
# in the next step, so two one-token rows in a row at a prompt's end would need a step to leave
# the same request one token of budget twice. (A tail of 64 read as decodes cost ~0.9 s of a
# mixed step at the 8B shape, one read a token and layer, and hid the question from the ranking.)
PROMPT_TAIL = 1


def prompt_end(prompt: int, tail: int = PROMPT_TAIL) -> int:
    """The position from which a chunk that reaches it ends its prompt (`PROMPT_TAIL`)."""
    return max(1, prompt - tail)


def prefill_rows(query_start_loc_cpu, seq_lens_cpu, decodes: int, prefills: int,
                 prompt_lens_cpu=None) -> tuple[list[tuple[int, int, int, int, bool]], list[tuple[int, int, int, int]]]:
    """Each prefill request's chunk after the `decodes` one-token ones, split where its prompt
    ends, as host ints (vLLM's host copies of the batch's offsets and lengths):
    - prompt rows, (row, first token, end token, tokens so far, last): its prompt tokens, for a
      selector that scores the prompt. With `prompt_lens_cpu` (each row's prompt length, where the
      worker hands them over: `AtskvWorker`), `last` marks the chunk that reaches the prompt's end
      (`prompt_end`); without them every chunk is all prompt and may be the last.
    - past rows, (row, first token, end token, first position): the tokens read as decodes are
      (known prompt lengths only): those after the chunk that ended its prompt (`PROMPT_TAIL`), and
      a preempted request's outputs, which vLLM recomputes in one prefill with its prompt. The
      outputs were decoded sparsely and are read so again (the selector's read set, in order): the
      recompute then attends as the first run did, and never over blocks freed since (`free_blocks`
      frees by the prompt's length, as vLLM's own R-SWA layers mask past the prompt in prefill
      too)."""
    starts, lengths = query_start_loc_cpu.tolist(), seq_lens_cpu.tolist()
    prompts = None if prompt_lens_cpu is None else prompt_lens_cpu.tolist()
    prompt, past = [], []
    for r in range(decodes, decodes + prefills):
        start, end, length = starts[r], starts[r + 1], lengths[r]
        first = length - (end - start)  # the chunk's first position
        if prompts is None:
            prompt.append((r, start, end, length, True))
            continue
        if first < prompt_end(prompts[r]):  # the chunk holds prompt tokens still to score
            stop = min(length, prompts[r])
            prompt.append((r, start, start + stop - first, stop, stop >= prompt_end(prompts[r])))
            first = stop
        if length > first:
            past.append((r, end - (length - first), end, first))
    return prompt, past


def unranked_prompts(seq_lens_cpu, prompt_lens_cpu, decodes: int) -> list[int]:
    """The one-token rows among the batch's first `decodes` that hold their prompt's second-to-last
    token: the chunk before stopped two short of the prompt's end and the last token can only come
    alone too, so no prefill chunk reaches `prompt_end` and a selector that ranks the prompt never
    ranks it. `PROMPT_TAIL` rests on vLLM never doing this (its scheduler serves a request it cut
    short first in the next step); the backend warns where it does."""
    lengths, prompts = seq_lens_cpu[:decodes].tolist(), prompt_lens_cpu[:decodes].tolist()
    return [r for r, (length, prompt) in enumerate(zip(lengths, prompts)) if length == prompt - 1]


def past_prompt_waves(rows: list[tuple[int, int, int, int]], in_order: bool,
                      wave: int) -> list[tuple[list[int], list[int], list[int]]]:  # fmt: skip
    """`prefill_rows`' past rows' tokens as the reads that take them: (batch rows, tokens, positions) a
    read. `in_order` (a selector whose pick moves its state a token on): each request's k-th token
    in the k-th read, so that every request's tokens go in order; otherwise up to `wave` at a time."""
    if in_order:
        longest = max((end - start for _, start, end, _ in rows), default=0)
        groups = [[(row, start + k, first + k) for row, start, end, first in rows if start + k < end]
                  for k in range(longest)]  # fmt: skip
    else:
        past = [(row, start + k, first + k) for row, start, end, first in rows for k in range(end - start)]
        groups = [past[i : i + wave] for i in range(0, len(past), wave)]
    return [tuple(list(column) for column in zip(*group)) for group in groups]


def past_reads(rows: list[tuple[int, int, int, int]], in_order: bool, wave: int, device: torch.device,
               seq_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`past_prompt_waves`' reads as tensors on `device`: (batch rows, tokens, sequence lengths
    to each token) a read, made once a forward for its layers in one copy from pinned memory. A
    tensor made from host lists copies from pageable memory, which waits for the GPU to drain its
    queue: a wave's three such copies in each layer left the GPU idle while the layer's Python
    went on (a prompt's tail of 50 tokens, read in order, took ~0.9 s of a step at the 8B shape)."""
    waves = past_prompt_waves(rows, in_order, wave)
    if not waves:
        return []
    host = torch.tensor([v for read in waves for column in read for v in column], dtype=torch.int64)
    flat = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    reads, at = [], 0
    for _, tokens, _ in waves:
        n = len(tokens)
        requests, tokens, positions = flat[at : at + 3 * n].view(3, n)
        reads.append((requests, tokens, (positions + 1).to(seq_dtype)))
        at += 3 * n
    return reads


class RunnerBatch:
    """What a metadata build may ask of the batch `runner` is building (an attention backend is
    shown neither): each row's prompt length (the request's own prompt: a recompute after
    preemption prefills its outputs too) and request id, and which requests the runner holds;
    None where they are not known (a warm-up's dummy batch). vLLM's second model runner
    (`v1/worker/gpu`, 0.26's default) makes a batch each step and keeps it nowhere; its model
    state's `prepare_attn`, which runs the builders, is handed it, so the batch is remembered
    there. Its first runner keeps one `input_batch` it updates in place."""

    def __init__(self, runner):
        self.runner = runner
        state = getattr(runner, "model_state", None)
        self.kept_nowhere, self.latest = state is not None, None
        if self.kept_nowhere:
            prepare = state.prepare_attn

            def remembering(input_batch, *args, **kwargs):
                self.latest = input_batch
                return prepare(input_batch, *args, **kwargs)

            state.prepare_attn = remembering

    def prompt_lengths(self) -> torch.Tensor | None:
        if not self.kept_nowhere:
            return self.runner.input_batch.num_prompt_tokens_cpu_tensor
        if not self.has_requests():
            return None
        return torch.from_numpy(self.runner.req_states.prompt_len.np[self.latest.idx_mapping_np])

    def requests(self) -> tuple[list[str], Collection[str]] | None:
        """Each row's request id, and the ids of the requests the runner holds."""
        if not self.kept_nowhere:
            batch = self.runner.input_batch
            return list(batch.req_ids), batch.req_id_to_index.keys()
        if not self.has_requests():
            return None
        return list(self.latest.req_ids), self.runner.req_states.req_id_to_index.keys()

    def has_requests(self) -> bool:
        """The second runner has handed over a batch, not a warm-up's dummy one (no request behind it)."""
        return self.latest is not None and bool(self.latest.prefill_len_np.any())


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """One prefill request's chunk as a selector that scores the prompt sees it, after the chunk's
    FlashAttention: its queries `[n, Hq, D]` (positions `length - n .. length - 1`), the layer's keys
    as `[Hkv, num_slots, D]` and the request's block table row `[W]`; `layer` the model's layer
    index, `row` the request's row in the batch and `step` a dict shared by the forward's layers
    (what one layer leaves for the next); `lse` `[Hq, n]` (float32, natural log), where the
    backend has them, the queries' log-sum-exps over the request's tokens so far from the chunk's
    own FlashAttention, which spares a selector's mass its own pass over the keys for them; `last`
    False when the chunk is known not to end the prompt: a selector that ranks the whole prompt
    then only adds what the chunk gives (its rank at an earlier chunk is never read); `compact`
    (`free_blocks`, at the chunk known to end the prompt) the kept tokens move to the request's
    first slots, their KV in `key_slots` and `value_slots` (`move_to_front`; `KeptLists.compact`,
    `PromptRanks.compact`), `on_move` told their positions first (a host tier marks them kept)."""

    queries: torch.Tensor
    key_slots: torch.Tensor
    table_row: torch.Tensor
    length: int
    block_size: int
    scaling: float
    budget: int | float
    layer: int = 0
    row: int = 0
    step: dict = dataclasses.field(default_factory=dict)
    lse: torch.Tensor | None = None
    last: bool = True
    value_slots: torch.Tensor | None = None
    compact: bool = False
    on_move: Callable[[torch.Tensor], None] | None = None

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """Physical slots (long) of the request's positions `start .. stop - 1`."""
        return self.slots_of(torch.arange(start, stop, device=self.table_row.device)).view(-1)

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots (long) of the request's `positions` (any shape)."""
        at = physical_slots(positions.reshape(1, 1, -1), self.table_row.view(1, -1), self.block_size)
        return at.view(positions.shape).long()

    def move_to_front(self, positions: torch.Tensor) -> None:
        """KV head h's j-th token of `positions` `[Hkv, n]` moved into the request's slot j of head
        h (`compact`: heads attend apart, keys carry their rotary positions); all are gathered
        before any is written, as a moved token may land on another's slot."""
        if self.on_move is not None:
            self.on_move(positions)
        heads = torch.arange(positions.shape[0], device=positions.device).view(-1, 1)
        source, target = self.slots_of(positions), self.slots(0, positions.shape[-1]).view(1, -1)
        for cache in (self.key_slots, self.value_slots):
            cache[heads, target] = cache[heads, source]

    def keys(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The request's keys `[Hkv, stop - start, D]` (to `length` by default)."""
        return self.key_slots[:, self.slots(start, self.length if stop is None else stop)]

    def received_mass(self, picked: slice) -> torch.Tensor:
        """`[Hkv, length]` float32: the attention the chunk's queries `picked` (a slice, any step)
        give each of the request's tokens so far, summed over them and the group's heads. The
        received-mass kernel reads the keys through the block table (`paged_received_mass`), given
        the queries' log-sum-exps: FlashAttention's where the backend kept them (`lse`), else a
        logits-only pass of their own over the keys gathered (`prefix_lse`; for the picked queries
        alone where they are consecutive, as a window is)."""
        n, length = self.queries.shape[0], self.length
        first, _, step = picked.indices(n)
        q = self.queries.transpose(0, 1).unsqueeze(0)
        if self.lse is not None:
            lse = self.lse[None, :, picked]
        elif step == 1:
            lse = prefix_lse(q[:, :, picked], self.keys().unsqueeze(0), length - n + first, self.scaling)
        else:
            lse = prefix_lse(q, self.keys().unsqueeze(0), length - n, self.scaling)[:, :, picked]
        mass = paged_received_mass(q[:, :, picked], self.key_slots, self.table_row, self.block_size, length, lse,
                                   length - n + first, self.scaling, step)  # fmt: skip
        return mass[0]
