"""Where vLLM's own scheduler cuts prompts (replayed on the CPU, `atskv.eval.vllm_chunks`; vLLM
needed, skipped where it is not installed), and that the plugin's builder then ranks every prompt
once, at the chunk that holds its last token (`PROMPT_TAIL`), reading none of its tokens as
decodes; after a preemption, only the recomputed outputs are read as decodes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from atskv.eval.vllm_chunks import prompt_chunks, ranked_short, replay_steps  # noqa: E402
from atskv.runtime.vllm.batch import prefill_rows, unranked_prompts  # noqa: E402

# the Gemma 3 quality run's first 28 prompts (4,096 tokens but a few of 4,095), at an H100's chunk
RUN = [4096, 4096, 4095, 4096, 4095, 4095, 4095, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4095,
       4096, 4096, 4096, 4096, 4095, 4095, 4095, 4095, 4096, 4095]  # fmt: skip


def builder_inputs(step):
    """A step's rows as the plugin's builder gets them: one-token rows first (vLLM reorders the batch
    for `reorder_batch_threshold` 1), vLLM's host copies of the offsets and lengths, the prompts'."""
    rows = sorted(step, key=lambda r: r.tokens > 1)
    decodes = sum(r.tokens == 1 for r in rows)
    starts = torch.tensor([0, *itertools.accumulate(r.tokens for r in rows)], dtype=torch.int32)
    seq_lens = torch.tensor([r.first + r.tokens for r in rows], dtype=torch.int32)
    prompts = torch.tensor([r.prompt for r in rows], dtype=torch.int32)
    return rows, starts, seq_lens, decodes, len(rows) - decodes, prompts


@pytest.mark.parametrize("lengths, chunk", [
    (RUN, 16384),  # a prompt a step cut a few tokens short of its end
    ([4096] * 6 + [3000, 5000, 1, 2, 17], 2048),  # prompts over several chunks, and shorter than a chunk
    ([100 + 37 * i for i in range(40)], 512),
    ([32768] * 8, 16384),  # the speed benchmark's 32K x 8, whose tails were read as decodes (~0.9 s a mixed step)
])  # fmt: skip
def test_every_prompt_is_ranked_once_at_the_chunk_holding_its_last_token(lengths, chunk):
    ranked = Counter()
    for step in replay_steps(lengths, 20, chunk, 32):
        rows, starts, seq_lens, decodes, prefills, prompts = builder_inputs(step)
        prompt_rows, past = prefill_rows(starts, seq_lens, decodes, prefills, prompts)
        assert not past, "no preemption: no token read as a decode is"
        assert not unranked_prompts(seq_lens, prompts, decodes)
        for row, _, _, so_far, last in prompt_rows:
            if last:
                ranked[rows[row].request] += 1
                assert so_far >= rows[row].prompt - 1, "its end (the last token may come alone, as a decode)"
    assert ranked == {i: 1 for i, n in enumerate(lengths) if n > 1}, "a one-token prompt: a decode row, nothing to rank"


def test_the_run_cut_prompts_within_their_last_64_tokens():
    """What the 64-token tail got wrong: the chunk reaching a prompt's last 64 tokens, a few short
    of its end (by the tokens the decoding requests took from the step), ranked it."""
    short = ranked_short(prompt_chunks(replay_steps(RUN, 20, 16384, 32)), RUN, 64)
    assert len(short) >= 3 and max(short.values()) < 64
    assert not ranked_short(prompt_chunks(replay_steps(RUN, 20, 16384, 32)), RUN, 1)


def test_a_recompute_after_preemption_ranks_its_prompt_again_and_reads_only_its_outputs_as_decodes():
    """A pool too small for four requests: vLLM preempts and recomputes (prompt and outputs in one
    prefill). The recompute ranks the prompt again at the chunk holding its end; the tokens read as
    decodes are its outputs alone, all of them, each once."""
    lengths = [1000, 900, 1100, 950]
    steps = replay_steps(lengths, 200, 512, 8, blocks=200)
    passes, outputs_read, recomputed = Counter(), Counter(), Counter()
    for step in steps:
        rows, starts, seq_lens, decodes, prefills, prompts = builder_inputs(step)
        prompt_rows, past = prefill_rows(starts, seq_lens, decodes, prefills, prompts)
        assert not unranked_prompts(seq_lens, prompts, decodes)
        for row, _, _, so_far, last in prompt_rows:
            request = rows[row].request
            recomputed[request] += rows[row].first == 0 and passes[request] > 0  # its prompt ranked before
            passes[request] += last
        for row, start, end, first in past:
            assert first >= rows[row].prompt, "a prompt token is never read as a decode"
            assert first + (end - start) == seq_lens[row], "the outputs so far, all of them"
            outputs_read[rows[row].request] += end - start
    assert recomputed, "the pool preempted a request"
    assert all(passes[r] == 1 + recomputed[r] for r in range(len(lengths)))
    assert set(outputs_read) == {r for r in recomputed if recomputed[r]}
