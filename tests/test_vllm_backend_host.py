"""The attention backend's host-side paths on the CPU (vLLM needed, its CUDA modules not: the
FlashAttention call is never made here): a recompute's tokens past their prompts read as their
decode steps read, and a prompt chunk compacted where `free_blocks` asks for it. The backend is
driven through its own methods over a paged cache laid out as vLLM lays it out."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import vllm.v1.attention.backends.fa_utils as fa_utils  # noqa: E402

if not hasattr(fa_utils, "flash_attn_varlen_func"):  # no CUDA build here; nothing below calls it
    fa_utils.flash_attn_varlen_func = None

from atskv.runtime.vllm.backend import AtskvAttentionImpl  # noqa: E402
from atskv.runtime.vllm.batch import PromptChunk  # noqa: E402
from atskv.runtime.vllm.config import PluginConfig  # noqa: E402
from atskv.runtime.vllm.heavy_hitters import recent_window  # noqa: E402
from atskv.runtime.vllm.selection import PagedH2O, PagedStreamingLLM, paged_sparse_decode, slot_view  # noqa: E402
from tests.test_vllm_selection import BLOCK, CHUNK, GENERATED, HKV, HQ, D, PagedCache, decoding_requests  # noqa: E402


def backend(selector, state, **settings) -> AtskvAttentionImpl:
    """The backend's implementation as a sparse layer of the plugin with `settings`, its selector
    and state given (vLLM's constructor needs a layer of a model; the paths below read these)."""
    impl = object.__new__(AtskvAttentionImpl)
    impl.head_size, impl.num_kv_heads, impl.scale = D, HKV, D**-0.5
    impl.selector, impl.state = selector, state
    impl.config = PluginConfig(selector=selector.name, **settings)
    return impl


def observed(selector, budget):
    """Four requests' prompts scored chunk by chunk (ranked at their last), their state and cache."""
    generator, cache, prompts = decoding_requests(seed=8)
    key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
    state = None
    if selector.keeps_state:
        state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
        for r, prompt in enumerate(prompts):
            queries = torch.randn(prompt, HQ, D, generator=generator)
            for start in range(0, prompt, CHUNK):
                stop = min(prompt, start + CHUNK)
                selector.observe_prompt(state, PromptChunk(queries[start:stop], key_slots, cache.block_table[r], stop,
                                                           BLOCK, D**-0.5, budget, last=stop == prompt))  # fmt: skip
    return generator, cache, prompts, state


@pytest.mark.parametrize("selector", [PagedH2O(), PagedStreamingLLM()])
@pytest.mark.parametrize("budget", [20, 0.25])
def test_a_recomputes_outputs_are_read_as_their_decode_steps_read(selector, budget):
    """The same generated tokens, decoded one step at a time (each step all four requests), and
    handed to the backend as a recompute's prefill rows past their prompts: the same outputs, and
    for H2O the same lists after them (its picks move them on: one token of each request a read,
    in order, as the steps were); StreamingLLM's go in one read."""
    generator, cache, prompts, state = observed(selector, budget)
    rows = len(prompts)
    queries = torch.randn(GENERATED, rows, HQ, D, generator=generator)
    stepped = None if state is None else type(state)(*(t.clone() for t in vars(state).values()))
    want = []
    for g in range(GENERATED):  # as vLLM's decode steps run them
        seq_lens = torch.tensor([p + g + 1 for p in prompts], dtype=torch.int32)
        positions, counts = selector.pick(queries[g], HKV, stepped, cache.block_table, seq_lens, BLOCK, budget)
        out, mass = paged_sparse_decode(queries[g], *cache.split(), positions, counts, cache.block_table, D**-0.5,
                                        want_mass=True)  # fmt: skip
        if selector.reads_mass:
            selector.observe_read(stepped, mass, cache.block_table, seq_lens, BLOCK)
        want.append(out)
    # the recompute's batch: each request a prefill row whose tokens are its GENERATED outputs
    tokens = queries.transpose(0, 1).reshape(rows * GENERATED, HQ, D)
    past = [(r, r * GENERATED, (r + 1) * GENERATED, prompt) for r, prompt in enumerate(prompts)]
    metadata = SimpleNamespace(atskv_past_rows=past, block_table=cache.block_table,
                               seq_lens=torch.tensor(cache.lengths, dtype=torch.int32))  # fmt: skip
    output = torch.zeros(rows * GENERATED, HQ * D)
    backend(selector, state, budget=budget).read_past_prompts(tokens, cache.kv_cache, metadata, output)
    got = output.view(rows, GENERATED, HQ, D).transpose(0, 1)
    for g in range(GENERATED):
        torch.testing.assert_close(got[g], want[g], rtol=1e-5, atol=1e-6)
    if state is not None:
        assert all(torch.equal(a, b) for a, b in zip(vars(state).values(), vars(stepped).values()))


@pytest.mark.parametrize("free_blocks, known", [(True, True), (True, False), (False, True)])
def test_a_prompts_last_chunk_is_compacted_where_free_blocks_asks_and_the_prompts_are_known(free_blocks, known):
    """The backend's prompt observation hands H2O the layer's keys and values and asks for the
    compaction at a prompt's last chunk only with `free_blocks` and the prompts' lengths known (the
    worker's: `atskv_past_rows` stands for them): then the request's first slots hold its kept
    tokens' keys, in position order; otherwise they keep their own."""
    selector, budget = PagedH2O(), 20
    generator, cache, _ = decoding_requests(seed=9)
    key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    r, length = 3, cache.lengths[3]  # its whole length as one chunk, the prompt's last
    before = key_slots[:, cache.slot(r, torch.arange(length)).long()].clone()
    metadata = SimpleNamespace(atskv_prompt_rows=[(0, 0, length, length, True)],
                               block_table=cache.block_table[r : r + 1])  # fmt: skip
    if known:
        metadata.atskv_past_rows = []
    impl = backend(selector, state, budget=budget, free_blocks=free_blocks)
    impl.observe_prompts(torch.randn(length, HQ * D, generator=generator), cache.kv_cache, metadata)
    after = key_slots[:, cache.slot(r, torch.arange(length)).long()]
    if not (free_blocks and known):
        assert torch.equal(after, before)
        return
    window = recent_window(20, selector.recent_fraction)
    for h in range(HKV):
        kept = sorted(state.kept[cache.slot(r, state.entry_slots(cache.block_table[r], BLOCK, 20)).long(), h].tolist())
        moved = kept[: 20 - window]  # the entries that name the first slots: slot j holds the j-th kept token
        assert moved == list(range(20 - window))
        held = [int((before[h] == after[h, j]).all(-1).nonzero()[0]) for j in range(20 - window)]
        assert held == sorted(held) and held[-1] < length - window, "the kept tokens, in position order"
        assert torch.equal(after[h, length - window :], before[h, length - window :]), "the window stays"


@dataclasses.dataclass
class Metadata:
    """The fields of vLLM's FlashAttention metadata that the backend reads or replaces."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decode_reqs: int
    use_cascade: bool = False
    scheduler_metadata: object = None
    max_num_splits: int = 0


def test_a_mixed_batch_goes_through_forward_in_its_parts(monkeypatch):
    """One forward of a mixed batch: two decodes first, then a recompute's chunk that ends its
    request's 200-token prompt and goes two outputs past it. FlashAttention (stubbed, its rows
    marked) runs over the prefill share only; the chunk's prompt part is scored and ranked there;
    its outputs, then the decodes, are read sparsely: what H2O's selection run by hand in that
    order gives, outputs and lists."""
    from atskv.runtime.vllm.batch import prefill_rows

    selector, budget = PagedH2O(), 20
    generator = torch.Generator().manual_seed(10)
    lengths, prompts = [101, 61, 202], [100, 60, 200]
    cache = PagedCache(lengths, width=13, generator=generator)
    cache.fill(chunk=CHUNK)
    key_slots = slot_view(cache.split()[0], 1)[0]
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    queries = [torch.randn(n, HQ, D, generator=generator) for n in lengths]

    def chunk(lists, r: int, start: int, stop: int, last: bool) -> None:
        selector.observe_prompt(lists, PromptChunk(queries[r][start:stop], key_slots, cache.block_table[r], stop,
                                                   BLOCK, D**-0.5, budget, last=last))  # fmt: skip

    for r, start, stop, last in [(0, 0, 100, True), (1, 0, 60, True), (2, 0, 100, False)]:  # earlier steps
        chunk(state, r, start, stop, last)
    by_hand = type(state)(*(t.clone() for t in vars(state).values()))

    def read(q, table, seq_lens):
        positions, counts = selector.pick(q, HKV, by_hand, table, seq_lens, BLOCK, budget)
        out, mass = paged_sparse_decode(q, *cache.split(), positions, counts, table, D**-0.5, want_mass=True)
        selector.observe_read(by_hand, mass, table, seq_lens, BLOCK)
        return out

    chunk(by_hand, 2, 100, 200, True)
    past = [read(queries[2][p : p + 1], cache.block_table[2:3], torch.tensor([p + 1], dtype=torch.int32))
            for p in (200, 201)]  # fmt: skip
    decodes = read(torch.cat([queries[0][100:], queries[1][60:]]), cache.block_table[:2],
                   torch.tensor([101, 61], dtype=torch.int32))  # fmt: skip

    query = torch.cat([queries[0][100:], queries[1][60:], queries[2][100:]])  # 104 tokens
    starts, seq_lens = torch.tensor([0, 1, 2, 104]), torch.tensor(lengths, dtype=torch.int32)
    metadata = Metadata(104, starts, seq_lens, cache.block_table, num_decode_reqs=2)
    metadata.atskv_prompt_rows, metadata.atskv_past_rows = prefill_rows(starts, seq_lens, 2, 1, torch.tensor(prompts))
    impl = backend(selector, state, budget=budget)
    attended = []

    def flash(layer, q, key, value, kv_cache, share, out, lse_wanted, *scales):
        attended.append((share.num_actual_tokens, share.query_start_loc.tolist(), lse_wanted))
        out.fill_(7.0)
        return None  # no log-sum-exps kept: the selector computes them itself

    monkeypatch.setattr(impl, "attend", flash)
    monkeypatch.setattr(impl, "sparse_layer", lambda layer: True)
    output = torch.zeros(104, HQ * D)
    kv = torch.zeros(104, HKV, D)
    assert impl.forward(None, query, kv, kv, cache.kv_cache, metadata, output) is output
    assert attended == [(102, [0, 102], True)], "FlashAttention over the prefill share, after the decodes"
    got = output.view(104, HQ, D)
    assert bool((got[2:102] == 7.0).all()), "the prompt part keeps FlashAttention's output"
    torch.testing.assert_close(got[102:], torch.cat(past), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:2], decodes, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(vars(state).values(), vars(by_hand).values()))
