"""How the plugin splits one of vLLM's batches (pure Python and torch: tested without vLLM).

vLLM puts the decode requests first when a builder asks for it (`reorder_batch_threshold = 1`), so
a batch is `decodes` one-token queries, then the prefill (or chunked-prefill) requests. The
decodes go through atskv's selection; the rest through FlashAttention with this share of the
metadata: its query offsets moved down by the decode tokens, its rows of lengths and block
table, and no ahead-of-time schedule (that one was planned for the whole batch). A selector that
scores the prompt gets each prefill request's rows of the batch (`prompt_rows`)."""

from __future__ import annotations

import dataclasses


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


def prompt_rows(query_start_loc_cpu, seq_lens_cpu, decodes: int, prefills: int) -> list[tuple[int, int, int, int]]:
    """(row, first token, end token, tokens so far) of each prefill request after the `decodes`
    one-token ones, as host ints (vLLM's host copies of the batch's offsets and lengths)."""
    starts, lengths = query_start_loc_cpu.tolist(), seq_lens_cpu.tolist()
    return [(r, starts[r], starts[r + 1], lengths[r]) for r in range(decodes, decodes + prefills)]
