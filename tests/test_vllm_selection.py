"""The vLLM plugin's selection over a paged cache, on the CPU and without vLLM: a random cache is
scattered into blocks through random block tables, and each paged selector's attention must equal
the same selector's over the unpaged keys (the references atskv's Quest and StreamingLLM run)."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.errors import InputError
from atskv.kernels.paged import (
    empty_page_bounds,
    paged_page_scores_reference,
    paged_page_scores_triton,
    physical_slots,
    region_page_scores,
    sink_recent_positions,
    update_page_bounds,
)
from atskv.kernels.quest import page_bounds, quest_page_scores_reference
from atskv.kernels.quest_decode import quest_pick_reference
from atskv.kernels.sparq_decode import sparq_decode_reference
from atskv.kernels.sparse_decode import sparse_decode_attention_reference
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.config import PluginConfig
from atskv.runtime.vllm.selection import PagedQuest, PagedStreamingLLM, paged_sparse_decode
from atskv.selectors.streaming_llm import StreamingLLMSelector

BLOCK = 16
HQ, HKV, D = 8, 2, 32
KERNELS = "cuda" if torch.cuda.is_available() else "cpu"  # kernel-vs-reference tests: on the GPU where there is one


class PagedCache:
    """Requests of `lengths` tokens in a paged cache laid out as vLLM's FlashAttention backend
    lays it out (`[blocks, HKV, BLOCK, 2 * D]` in NHD memory order), their blocks spread at random
    over the pool, written chunk by chunk the way prefill chunks and decode steps write them."""

    def __init__(self, lengths: list[int], width: int, generator: torch.Generator, spare_blocks: int = 7):
        self.lengths = lengths
        blocks = len(lengths) * width + spare_blocks
        physical = torch.zeros(blocks, BLOCK, HKV, 2 * D)  # NHD memory
        self.kv_cache = physical.permute(0, 2, 1, 3)  # the backend's logical [blocks, HKV, BLOCK, 2D]
        order = torch.randperm(blocks, generator=generator)
        self.block_table = order[: len(lengths) * width].view(len(lengths), width).int()
        self.keys = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
        self.values = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
        self.bounds = empty_page_bounds(blocks, HKV, D, torch.float32, "cpu")
        # stale garbage from an earlier tenant of the blocks: a block's first token must reset it
        self.bounds[0].uniform_(-9, -8, generator=generator)
        self.bounds[1].uniform_(8, 9, generator=generator)

    def slot(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        return physical_slots(positions.view(1, 1, -1), self.block_table[request : request + 1], BLOCK).view(-1)

    def write(self, request: int, start: int, stop: int, pad: int = 0) -> None:
        """Tokens [start, stop) of one request, as one forward writes them (with `pad` padding tokens)."""
        slots = self.slot(request, torch.arange(start, stop))
        key, value = self.keys[request][start:stop], self.values[request][start:stop]
        cache = self.kv_cache.transpose(1, 2)  # [blocks, BLOCK, HKV, 2D]
        flat = cache.reshape(-1, HKV, 2 * D)  # a view: blocks and tokens merge in NHD
        flat[slots.long(), :, :D] = key
        flat[slots.long(), :, D:] = value
        slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int32)])
        key = torch.cat([key, torch.randn(pad, HKV, D)])
        update_page_bounds(*self.bounds, key, slots, BLOCK)

    def fill(self, chunk: int) -> None:
        for r, n in enumerate(self.lengths):
            for start in range(0, n, chunk):
                self.write(r, start, min(n, start + chunk), pad=3)

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.transpose(1, 2).split(D, dim=-1)


def padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """`[B, HKV, width, D]` of per-request `[n, HKV, D]`, zeros past each request's end."""
    out = torch.zeros(len(tensors), HKV, width, D)
    for r, t in enumerate(tensors):
        out[r, :, : t.shape[0]] = t.transpose(0, 1)
    return out


@pytest.fixture
def cache() -> PagedCache:
    generator = torch.Generator().manual_seed(0)
    paged = PagedCache([37, 100, 16, 161], width=12, generator=generator)
    paged.fill(chunk=23)
    return paged


def test_page_bounds_follow_the_writes_of_every_chunk(cache):
    for r, keys in enumerate(cache.keys):
        low, high = page_bounds(keys.transpose(0, 1).unsqueeze(0), BLOCK)  # [1, HKV, P, D]
        blocks = cache.block_table[r, : low.shape[2]].long()
        torch.testing.assert_close(cache.bounds[0][blocks], low[0].transpose(0, 1))
        torch.testing.assert_close(cache.bounds[1][blocks], high[0].transpose(0, 1))


def test_paged_page_scores_kernel_matches_its_reference(cache):
    query = torch.randn(len(cache.lengths), HQ, D)
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    want = paged_page_scores_reference(query, *cache.bounds, cache.block_table, seq_lens, BLOCK)
    inputs = [t.to(KERNELS) for t in (query, *cache.bounds, cache.block_table, seq_lens)]
    got = paged_page_scores_triton(*inputs, BLOCK)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)
    assert torch.isinf(want[0, :, math.ceil(37 / BLOCK) :]).all()


def test_a_host_tiers_page_scores_are_quests_over_each_rows_region_but_pages_with_nothing_parked(monkeypatch):
    """`region_page_scores` (the host tier's, one kernel): row b scores region rows[b]'s pages as
    Quest scores them, -inf past the region's held tokens and where a page holds no parked token;
    a row without a region (the spare) scores none. The kernel (Triton's interpreter on the CPU)
    as its reference."""
    g = torch.Generator().manual_seed(3)
    regions, pages = 3, 7
    low = torch.randn(regions * pages + 1, HKV, D, generator=g)
    high = low + torch.rand(low.shape, generator=g)
    held = torch.tensor([5 * BLOCK, 7 * BLOCK - 3, 2 * BLOCK + 1, 0], dtype=torch.int32)  # the spare last
    counts = torch.randint(0, 3, (regions + 1, HKV, pages), generator=g, dtype=torch.int32)
    rows = torch.tensor([2, regions, 0, 1, 0])
    query = torch.randn(len(rows), HQ, D, generator=g)
    want = torch.full((len(rows), HKV, pages), -math.inf)
    for b, r in enumerate(rows.tolist()):
        if r == regions:
            continue
        bounds = [t[r * pages : (r + 1) * pages].transpose(0, 1).unsqueeze(0) for t in (low, high)]
        scores = quest_page_scores_reference(query[b : b + 1], *bounds)[0]  # [HKV, pages]
        counted = (torch.arange(pages) < math.ceil(int(held[r]) / BLOCK)) & (counts[r] > 0)
        want[b] = scores.masked_fill(~counted, -math.inf)
    assert want.isfinite().any(-1).all(-1)[rows != regions].all() and not want[1].isfinite().any()
    torch.testing.assert_close(region_page_scores(query, low, high, rows, held, counts, pages, BLOCK), want)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    got = region_page_scores(*[t.to(KERNELS) for t in (query, low, high, rows, held, counts)], pages, BLOCK)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("budget", [24, 48, 0.3])
def test_paged_quest_attends_what_quest_attends_on_the_unpaged_cache(cache, budget):
    b = len(cache.lengths)
    query = torch.randn(b, HQ, D)
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    positions, lengths = PagedQuest().pick(query, HKV, cache.bounds, cache.block_table, seq_lens, BLOCK, budget)
    got = paged_sparse_decode(query, *cache.split(), positions, lengths, cache.block_table, D**-0.5)

    width = cache.block_table.shape[1] * BLOCK
    keys, values = padded(cache.keys, width), padded(cache.values, width)
    low, high = page_bounds(keys, BLOCK)
    pages = quest_page_scores_reference(query, low, high)
    used = torch.arange(pages.shape[-1]) < ((seq_lens + BLOCK - 1) // BLOCK).view(-1, 1, 1)
    positions = torch.where(torch.arange(width) < seq_lens.view(-1, 1), torch.arange(width), -1)
    most = budget if isinstance(budget, int) else math.ceil(budget * width)
    n_pages = min(pages.shape[-1], math.ceil(most / BLOCK) + 2)
    pages = pages.masked_fill(~used, -math.inf)
    positions = positions.unsqueeze(1).expand(b, HKV, width)
    logical, want_lengths = quest_pick_reference(pages, positions, budget, seq_lens, n_pages, BLOCK)
    want = sparse_decode_attention_reference(query, keys, values, logical, want_lengths, D**-0.5)
    assert torch.equal(lengths, want_lengths)
    torch.testing.assert_close(got, want)
    assert (lengths < seq_lens.view(-1, 1)).any(), "the budget must leave tokens out somewhere"


def test_paged_quest_with_the_whole_context_is_dense_attention(cache):
    b = len(cache.lengths)
    query = torch.randn(b, HQ, D)
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    positions, lengths = PagedQuest().pick(query, HKV, cache.bounds, cache.block_table, seq_lens, BLOCK,
                                           max(cache.lengths))  # fmt: skip
    out = torch.full_like(query, torch.nan)
    got = paged_sparse_decode(query, *cache.split(), positions, lengths, cache.block_table, D**-0.5, out=out)
    assert got is out
    for r, n in enumerate(cache.lengths):
        q = query[r].view(HKV, HQ // HKV, D)
        k, v = cache.keys[r].transpose(0, 1), cache.values[r].transpose(0, 1)
        dense = torch.softmax(q @ k.transpose(1, 2) * D**-0.5, -1) @ v
        torch.testing.assert_close(got[r], dense.reshape(HQ, D))


@pytest.mark.parametrize("budget", [20, 0.25])
def test_paged_streaming_llm_reads_the_tokens_streaming_llm_keeps(cache, budget):
    b = len(cache.lengths)
    query = torch.randn(b, HQ, D)
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    positions, lengths = PagedStreamingLLM(sinks=4).pick(query, HKV, None, cache.block_table, seq_lens, BLOCK, budget)
    got = paged_sparse_decode(query, *cache.split(), positions, lengths, cache.block_table, D**-0.5)
    for r, n in enumerate(cache.lengths):
        k = math.ceil(n * budget) if isinstance(budget, float) else min(n, budget)
        positions = torch.arange(n, dtype=torch.float32)
        sink = positions < 4
        scores = torch.where(sink, torch.inf, positions)  # StreamingLLMSelector's scores for one row
        keep = scores.topk(k).indices.sort().values
        q = query[r].view(HKV, HQ // HKV, D)
        keys, values = cache.keys[r][keep].transpose(0, 1), cache.values[r][keep].transpose(0, 1)
        want = torch.softmax(q @ keys.transpose(1, 2) * D**-0.5, -1) @ values
        torch.testing.assert_close(got[r], want.reshape(HQ, D))
        assert int(lengths[r, 0]) == k
    assert StreamingLLMSelector.name == PagedStreamingLLM.name  # the same selector by name in both runtimes


def sparq_reference_on_the_unpaged_cache(cache: PagedCache, query, budget, rank: int, recent: int):
    """atskv's SparQ decode step (the fast path's reference) over each request's keys, unpaged."""
    width = cache.block_table.shape[1] * BLOCK
    keys = padded(cache.keys, width)
    seq_lens = torch.tensor(cache.lengths)
    slot_pos = torch.where(torch.arange(width) < seq_lens.view(-1, 1), torch.arange(width), -1)
    slot_pos = slot_pos.unsqueeze(1).expand(-1, HKV, -1)
    newest = (seq_lens - 1).view(-1, 1).expand(-1, HKV)
    k = budget if isinstance(budget, int) else math.ceil(budget * width)
    return sparq_decode_reference(query, keys, keys.transpose(2, 3).clone(), slot_pos, newest, seq_lens, D**-0.5,
                                  rank, budget, min(k, width), recent=recent)  # fmt: skip


@pytest.mark.parametrize("budget, recent", [(24, 0), (0.3, 0), (20, 6), (500, 0)])
def test_paged_sparq_chooses_what_sparq_chooses_on_the_unpaged_cache(cache, budget, recent, monkeypatch):
    """The kernels reading vLLM's cache in place through the block table (Triton's interpreter on the
    CPU) and their reference choose the tokens atskv's SparQ step chooses over the unpaged keys,
    and attend them."""
    from atskv.runtime.vllm.selection import PagedSparQ, slot_view, usable_positions

    b = len(cache.lengths)
    query = torch.randn(b, HQ, D, generator=torch.Generator().manual_seed(5))
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    want_idx, want_len = sparq_reference_on_the_unpaged_cache(cache, query, budget, rank=4, recent=recent)
    keys = slot_view(cache.split()[0], 1)[0]
    selector = PagedSparQ(rank_fraction=4 / D, recent=recent)
    for kernels, device in (("reference", "cpu"), ("triton", KERNELS)):
        monkeypatch.setenv("ATSKV_KERNELS", kernels)
        step = {}
        inputs = [t.to(device) for t in (query, cache.block_table, seq_lens, keys)]
        positions, lengths = selector.pick(*inputs[:1], HKV, None, *inputs[1:3], BLOCK, budget, step, keys=inputs[3],
                                           scaling=D**-0.5)  # fmt: skip
        positions, lengths = positions.cpu(), lengths.cpu()
        assert torch.equal(step["positions"].cpu(), usable_positions(seq_lens, cache.block_table.shape[1] * BLOCK))
        assert torch.equal(lengths, want_len), kernels
        for r in range(b):
            for h in range(HKV):
                n = int(lengths[r, h])
                assert set(positions[r, h, :n].tolist()) == set(want_idx[r, h, :n].tolist()), (kernels, r, h)
        monkeypatch.setenv("ATSKV_KERNELS", "reference")
        got = paged_sparse_decode(query, *cache.split(), positions, lengths, cache.block_table, D**-0.5)
        width = cache.block_table.shape[1] * BLOCK
        want = sparse_decode_attention_reference(query, padded(cache.keys, width), padded(cache.values, width),
                                                 want_idx, want_len, D**-0.5)  # fmt: skip
        torch.testing.assert_close(got, want)
    assert (lengths < seq_lens.view(-1, 1)).any() or budget == 500, "the budget must leave tokens out somewhere"


def test_a_cache_not_in_nhd_order_is_refused():
    hnd = torch.zeros(4, HKV, BLOCK, 2 * D)  # HND memory: blocks and tokens do not merge
    key_cache = hnd.transpose(1, 2)[..., :D]
    with pytest.raises(ValueError, match="NHD"):
        one = torch.ones(1, HKV, dtype=torch.int32)
        paged_sparse_decode(torch.randn(1, HQ, D), key_cache, key_cache, one.unsqueeze(-1), one, one, 1.0)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"selector": "nope"}, "no selector 'nope'"),
        ({"budget": 0}, "bad budget"),
        ({"budget": 1.5}, "bad budget"),
        ({"budget": True}, "bad budget"),
        ({"dense_layers": -1}, "dense_layers"),
        ({"dense_layers": True}, "dense_layers must be an int"),  # a flag is no count (atskv.errors.is_int)
        ({"budjet": 0.1}, "no option 'budjet'"),
        ({"selector": "quest", "free_blocks": True}, "free_blocks needs"),
        ({"selector": "streaming_llm", "budget": 1.0, "free_blocks": True}, "free_blocks needs"),
        ({"selector": "streaming_llm", "free_blocks": "yes"}, "true or false"),
        ({"selector": "streaming_llm", "options": {"sink": 4}}, "no option 'sink'; its options: sinks"),
        ({"selector": "h2o", "options": [0.5]}, "options must be a dict"),
        ({"selector": "learned"}, "needs its predictor"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir"}}, "/no/such/dir"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "refresh_every": -1}}, "refresh_every"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "refresh_every": 2.5}}, "refresh_every"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "prompt_sample": 0}}, "prompt_sample"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "window_share": 1.5}},
         r"window_share is a share of the budget, in \[0, 1\]; got 1.5"),  # atskv's learned selector's words
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "window": 0}}, "window is a count"),
        ({"selector": "h2o", "options": {"prompt_sample": 1.5}}, "prompt_sample is a stride"),
        ({"selector": "h2o", "options": {"prompt_sample": True}}, "prompt_sample is a stride"),
        ({"selector": "learned", "options": {"predictor": "/no/such/dir", "window": True}}, "window is a count"),
    ],
)
def test_bad_plugin_settings_are_one_line_errors(settings, message):
    with pytest.raises(InputError, match=message):
        PluginConfig.from_additional_config({"atskv": settings})


def test_plugin_settings_from_vllms_additional_config():
    assert PluginConfig.from_additional_config(None) == PluginConfig()
    config = PluginConfig.from_additional_config({"atskv": {"selector": "streaming_llm", "budget": 512}, "other": 1})
    assert (config.selector, config.budget, config.dense) == ("streaming_llm", 512, False)
    assert PluginConfig.from_additional_config({"atskv": {"budget": 1.0}}).dense
    assert PluginConfig(selector="streaming_llm", free_blocks=True).free_blocks  # dense layers beside: kept


@pytest.mark.parametrize("budget, sinks, prompt", [(0.05, 4, 3000), (0.3, 4, 200), (100, 4, 700), (40, 20, 90),
                                                   (0.02, 0, 5000), (1, 4, 64)])  # fmt: skip
def test_streaming_llm_frees_only_blocks_no_later_query_reads(budget, sinks, prompt):
    selector = PagedStreamingLLM(sinks=sinks)
    freed: set[int] = set()
    for processed in range(prompt - 3, prompt + 400, 3):
        unread = selector.unread_blocks(processed, prompt, budget, BLOCK)
        if processed < prompt:
            assert not unread
        if freed and unread:  # vLLM frees a range top down to the first null block: it may only grow at its top
            assert unread.start == min(freed) and unread.stop >= max(freed) + 1
        freed |= set(unread)
        # every later query (contexts processed + 1 ... + 150) reads none of the freed blocks
        later = torch.arange(processed + 1, processed + 151, dtype=torch.int32)
        positions, lengths = sink_recent_positions(later, budget, sinks, int(later.max()), 1)
        read = positions[:, 0][torch.arange(positions.shape[-1]) < lengths[:, :1]]
        assert not freed & set((read // BLOCK).tolist())
    # and all but the margin of what the query after the last one does not read is freed
    context = prompt + 400
    positions, lengths = sink_recent_positions(torch.tensor([context], dtype=torch.int32), budget, sinks, context, 1)
    read_blocks = set((positions[0, 0, : int(lengths[0, 0])] // BLOCK).tolist())
    wholly_unread = set(range(context // BLOCK)) - read_blocks
    assert wholly_unread - freed <= {max(wholly_unread, default=0)}  # one token of margin costs one block at most
    assert len(freed) >= len(wholly_unread) - 1


@pytest.mark.parametrize("recent_fraction", [0.5, 0.0, 0.3])
@pytest.mark.parametrize("budget, prompt", [(0.05, 3000), (0.3, 200), (100, 700), (40, 90), (20, 20), (1, 5000)])
def test_compacted_lists_free_only_blocks_no_later_query_reads(budget, prompt, recent_fraction):
    """H2O's and the learned selector's rule (`compacted_unread_blocks`): wherever the prompt's list
    was ranked and compacted (at its end, or at a chunk that ended up to `PROMPT_TAIL` short of it,
    the rest read as decodes), its moved tokens' slots, its recent window and every later token lie
    outside the blocks freed once the prompt is in; nothing before it is freed, and a long prompt
    frees most of its blocks."""
    from atskv.kernels.budget import kept_count
    from atskv.runtime.vllm.batch import prompt_end
    from atskv.runtime.vllm.heavy_hitters import compacted_unread_blocks, recent_window

    assert not compacted_unread_blocks(prompt - 1, prompt, budget, BLOCK, recent_fraction)
    freed = set(compacted_unread_blocks(prompt, prompt, budget, BLOCK, recent_fraction))
    assert freed == set(compacted_unread_blocks(prompt + 500, prompt, budget, BLOCK, recent_fraction))
    for ranked_at in range(prompt_end(prompt), prompt + 1):
        count = kept_count(budget, ranked_at)
        window = recent_window(count, recent_fraction)
        held = set(range(count - window)) | set(range(ranked_at - window, prompt + 300))
        assert not freed & {p // BLOCK for p in held}, ranked_at
    if prompt >= 3000:
        assert len(freed) > 0.8 * prompt / BLOCK


@pytest.mark.parametrize("window", [32, 4])
@pytest.mark.parametrize("budget, prompt", [(0.05, 3000), (0.3, 200), (100, 700), (40, 90), (20, 20), (1, 5000)])
def test_a_compacted_ranking_frees_only_blocks_no_later_query_reads(budget, prompt, window):
    """SnapKV's rule (`compacted_ranking_unread_blocks`): wherever the ranking was made (at the
    prompt's end or up to `PROMPT_TAIL` short of it, with a window of up to `window` queries), the
    slots its best tokens move into (as many as the first later query reads), its window and every
    later token lie outside the freed blocks; a long prompt frees most of its blocks."""
    from atskv.kernels.budget import kept_count
    from atskv.runtime.vllm.batch import prompt_end
    from atskv.runtime.vllm.prompt_ranks import compacted_ranking_unread_blocks

    assert not compacted_ranking_unread_blocks(prompt - 1, prompt, budget, BLOCK, window)
    freed = set(compacted_ranking_unread_blocks(prompt, prompt, budget, BLOCK, window))
    for ranked_at in range(prompt_end(prompt), prompt + 1):
        for w in range(1, min(window, ranked_at) + 1):
            start = ranked_at - w
            take = min(start, max(0, kept_count(budget, ranked_at + 1) - (ranked_at + 1 - start)))
            held = set(range(take)) | set(range(start, prompt + 300))
            assert not freed & {p // BLOCK for p in held}, (ranked_at, w)
    if prompt >= 3000:
        assert len(freed) > 0.8 * prompt / BLOCK


def test_which_selectors_free_blocks():
    from atskv.runtime.vllm.composition import build_paged_selector
    from atskv.runtime.vllm.selection import PagedH2O, PagedSnapKV, PagedSparQ

    assert not PagedQuest.frees_blocks and not PagedSparQ.frees_blocks
    assert PagedStreamingLLM.frees_blocks and PagedH2O.frees_blocks and PagedSnapKV.frees_blocks
    assert build_paged_selector("h2o+sparq", {}).frees_blocks  # its residents' rule
    assert PluginConfig(selector="h2o+sparq", free_blocks=True).free_blocks


@pytest.mark.parametrize("split_size, stages", [(32, 1), (10_000, 1), (16, 3), (10_000, 2)])
def test_the_sparse_decode_kernel_reads_a_paged_cache_as_its_reference_does(cache, split_size, stages):
    from atskv.kernels.sparse_decode import sparse_decode_attention_triton
    from atskv.runtime.vllm.selection import slot_view

    b = len(cache.lengths)
    query = torch.randn(b, HQ, D)
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    positions, lengths = PagedQuest().pick(query, HKV, cache.bounds, cache.block_table, seq_lens, BLOCK, 40)
    key_cache, value_cache = cache.split()
    keys, values = slot_view(key_cache, b), slot_view(value_cache, b)
    options = dict(block_table=cache.block_table, block_size=BLOCK)
    want = sparse_decode_attention_reference(query, keys, values, positions, lengths, D**-0.5, **options)
    out = torch.full((b, HQ, D), torch.nan, device=KERNELS)
    key_cache, value_cache = cache.kv_cache.to(KERNELS).transpose(1, 2).split(D, dim=-1)  # .to keeps NHD strides
    inputs = [t.to(KERNELS) for t in (query, slot_view(key_cache, b), slot_view(value_cache, b), positions, lengths)]
    options = dict(block_table=cache.block_table.to(KERNELS), block_size=BLOCK)
    got = sparse_decode_attention_triton(*inputs, D**-0.5, out=out, split_size=split_size, num_stages=stages, **options)
    assert got is out
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    # the mass each position received (H2O's), by index as unpaged
    want_mass = sparse_decode_attention_reference(query, keys, values, positions, lengths, D**-0.5, want_mass=True,
                                                  block_table=cache.block_table, block_size=BLOCK)[1]  # fmt: skip
    got, mass = sparse_decode_attention_triton(*inputs, D**-0.5, split_size=split_size, num_stages=stages,
                                               want_mass=True, **options)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mass.cpu(), want_mass, rtol=1e-4, atol=1e-5)
    assert want_mass.sum(-1).allclose(torch.full((b, HKV), float(HQ // HKV))), "each head's probabilities sum to 1"


@pytest.mark.parametrize("budget", [20, 0.25, 3])
def test_the_sink_recent_kernel_matches_its_reference(budget, monkeypatch):
    seq_lens = torch.tensor([37, 100, 2, 161], dtype=torch.int32)
    want = sink_recent_positions(seq_lens, budget, 4, 48, HKV)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    got = sink_recent_positions(seq_lens.to(KERNELS), budget, 4, 48, HKV)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_one_forwards_layers_share_the_batchs_usable_positions(cache):
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    query = torch.randn(len(cache.lengths), HQ, D)
    step = {}
    first = PagedQuest().pick(query, HKV, cache.bounds, cache.block_table, seq_lens, BLOCK, 24, step)
    shared = step["positions"]
    again = PagedQuest().pick(query, HKV, cache.bounds, cache.block_table, seq_lens, BLOCK, 24, step)
    assert step["positions"] is shared and torch.equal(first[0], again[0])
    assert (shared[:, 0] >= 0).sum(-1).tolist() == cache.lengths


def test_the_prefill_share_of_a_batch_starts_after_its_decodes():
    from dataclasses import dataclass

    from atskv.runtime.vllm.batch import prefill_rows, prefill_share

    @dataclass
    class Metadata:  # the fields of vLLM's FlashAttentionMetadata that the split touches
        num_actual_tokens: int
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        block_table: torch.Tensor
        scheduler_metadata: object
        max_num_splits: int

    # three decodes (1 token each), then prefill chunks of 5 and 7 tokens
    batch = Metadata(15, torch.tensor([0, 1, 2, 3, 8, 15]), torch.tensor([40, 9, 17, 5, 30]),
                     torch.arange(25).view(5, 5), object(), 16)  # fmt: skip
    rest = prefill_share(batch, 3)
    assert rest.num_actual_tokens == 12 and rest.query_start_loc.tolist() == [0, 5, 12]
    assert rest.seq_lens.tolist() == [5, 30] and torch.equal(rest.block_table, batch.block_table[3:])
    assert rest.scheduler_metadata is None and rest.max_num_splits == 0
    assert batch.num_actual_tokens == 15  # the batch's own metadata is left as it was
    # what a selector that scores the prompt sees of the same batch: (row, tokens [start, end), length,
    # last): without the prompts' lengths any chunk may end its prompt; with them, the second does not
    rows = (batch.query_start_loc, batch.seq_lens, 3, 2)
    assert prefill_rows(*rows) == ([(3, 3, 8, 5, True), (4, 8, 15, 30, True)], [])
    prompts = torch.tensor([7, 3, 9, 5, 200])
    assert prefill_rows(*rows, prompts) == ([(3, 3, 8, 5, True), (4, 8, 15, 30, False)], [])


def test_a_prompts_end_and_a_recomputes_outputs_are_read_as_decodes():
    """With the prompts' lengths: the chunk that reaches a prompt's last `PROMPT_TAIL` token (its
    end, or one short of it: the last token then comes as a one-token row, a decode) ends it for
    the selectors that rank it; a recompute's outputs are read as decodes, in reads that keep each
    request's order; a chunk before that is all prompt and not the last."""
    from atskv.runtime.vllm.batch import PROMPT_TAIL, past_prompt_waves, prefill_rows

    assert PROMPT_TAIL == 1
    # rows: 2 decodes; a fresh chunk (positions 0-9 of a 400-token prompt); a recompute's chunk across
    # its prompt's end (positions 250-349, prompt 320); a chunk one short of its prompt's end (positions
    # 290-318, prompt 320); a recompute's chunk past its prompt (positions 400-404, prompt 330); a
    # fresh last chunk (positions 100-199 of 200)
    starts = torch.tensor([0, 1, 2, 12, 112, 141, 146, 246])
    lengths = torch.tensor([50, 60, 10, 350, 319, 405, 200])
    prompts = torch.tensor([49, 59, 400, 320, 320, 330, 200])
    prompt, rows = prefill_rows(starts, lengths, 2, 5, prompts)
    assert prompt == [(2, 2, 12, 10, False), (3, 12, 82, 320, True), (4, 112, 141, 319, True), (6, 146, 246, 200, True)]
    assert rows == [(3, 82, 112, 320), (5, 141, 146, 400)]
    # a kept list's pick moves it on: one token of each request a read, in order
    waves = past_prompt_waves(rows, True, 256)
    assert waves[:2] == [([3, 5], [82, 141], [320, 400]), ([3, 5], [83, 142], [321, 401])]
    assert [len(tokens) for _, tokens, _ in waves] == [2] * 5 + [1] * 25
    waves = past_prompt_waves(rows, False, 16)  # the others: up to a wave at a time
    assert [len(tokens) for _, tokens, _ in waves] == [16, 16, 3]
    assert waves[1] == ([3] * 14 + [5] * 2, list(range(98, 112)) + [141, 142], list(range(336, 350)) + [400, 401])
    assert past_prompt_waves([], True, 5) == past_prompt_waves([], False, 5) == []
    # without prompt lengths (vLLM's own worker) every chunk is all prompt and may end it
    prompt, past = prefill_rows(starts, lengths, 2, 5)
    assert [row[4] for row in prompt] == [True] * 5 and past == []



def test_a_prompt_whose_last_two_tokens_come_alone_is_named_unranked():
    """Decode rows: a generated token, a prompt's last token alone (the chunk before reached
    `prompt_end`: ranked there), its second-to-last alone (no chunk will reach `prompt_end`), a
    prompt token further back alone (a later chunk ends the prompt), a one-token prompt."""
    from atskv.runtime.vllm.batch import unranked_prompts

    seq_lens = torch.tensor([501, 300, 299, 120, 1, 40])
    prompts = torch.tensor([500, 300, 300, 300, 1, 41])
    assert unranked_prompts(seq_lens, prompts, 5) == [2]
    assert unranked_prompts(seq_lens, prompts, 6) == [2, 5]
    assert unranked_prompts(seq_lens, prompts, 0) == []


@pytest.mark.parametrize("in_order, wave", [(True, 256), (False, 16)])
def test_past_reads_are_the_waves_as_tensors_in_one_copy(in_order, wave):
    """The backend's reads of past-prompt tokens: `past_prompt_waves`' (rows, tokens, positions),
    the positions as the sequence lengths a decode reads to (position + 1, the cache's dtype)."""
    from atskv.runtime.vllm.batch import past_prompt_waves, past_reads

    rows = [(3, 82, 112, 320), (4, 112, 122, 290), (5, 122, 127, 400)]
    reads = past_reads(rows, in_order, wave, torch.device("cpu"), torch.int32)
    got = [(r.tolist(), t.tolist(), [n - 1 for n in lengths.tolist()]) for r, t, lengths in reads]
    assert got == past_prompt_waves(rows, in_order, wave) and len(got) == (30 if in_order else 3)
    assert all(lengths.dtype == torch.int32 for _, _, lengths in reads)
    assert past_reads([], in_order, wave, torch.device("cpu"), torch.int32) == []


def test_the_builders_see_the_prompt_lengths_and_requests_of_the_batch_each_runner_builds():
    """vLLM's second model runner hands each step's batch to its model state's `prepare_attn`
    (which runs the builders) and keeps it nowhere: the lengths and request ids read during that
    call are that batch's (a recompute prefills more than its prompt), none for a warm-up's dummy
    batch, the live requests the runner's, and `prepare_attn` still gets its arguments and returns
    its result. Its first runner keeps one batch, read as it stands."""
    from types import SimpleNamespace

    import numpy as np

    from atskv.runtime.vllm.batch import RunnerBatch

    seen = []

    def prepare_attn(input_batch, mode, *, for_capture=False):
        lengths, requests = view.prompt_lengths(), view.requests()  # what a builder reads while the runner builds
        seen.append(None if lengths is None else (lengths.tolist(), requests[0], sorted(requests[1])))
        return {"mode": mode, "for_capture": for_capture}

    prompt_len = SimpleNamespace(np=np.array([0, 1500, 900, 40], dtype=np.int32))  # by the runner's request index
    live = {"a": 1, "b": 2, "c": 3}
    runner = SimpleNamespace(model_state=SimpleNamespace(prepare_attn=prepare_attn),
                             req_states=SimpleNamespace(prompt_len=prompt_len, req_id_to_index=live))  # fmt: skip
    view = RunnerBatch(runner)
    assert view.prompt_lengths() is None and view.requests() is None, "before any batch"
    # a batch (its second request a recompute: more to prefill than its prompt), a warm-up's dummy, another
    for prefill, index, ids in (([1500, 1000], [1, 2], ["a", "b"]), ([0, 0, 0], [0, 0, 0], ["x", "y", "z"]),
                                ([40], [3], ["c"])):  # fmt: skip
        batch = SimpleNamespace(prefill_len_np=np.array(prefill, dtype=np.int32),
                                idx_mapping_np=np.array(index, dtype=np.int32), req_ids=ids)  # fmt: skip
        assert runner.model_state.prepare_attn(batch, "FULL", for_capture=True) == {"mode": "FULL",
                                                                                   "for_capture": True}
    assert seen == [([1500, 900], ["a", "b"], ["a", "b", "c"]), None, ([40], ["c"], ["a", "b", "c"])]
    batch = SimpleNamespace(num_prompt_tokens_cpu_tensor=torch.tensor([9, 3]), req_ids=["p", "q"],
                            req_id_to_index={"p": 0, "q": 1})  # fmt: skip
    first = RunnerBatch(SimpleNamespace(input_batch=batch))
    batch.num_prompt_tokens_cpu_tensor, batch.req_ids = torch.tensor([5]), ["q"]  # the runner updates its batch
    assert first.prompt_lengths().tolist() == [5] and first.requests()[0] == ["q"]


@pytest.mark.parametrize("last_known, compact", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("budget", [0.25, 20, 3, 500])
@pytest.mark.parametrize("generated", [1, 3])
def test_paged_snapkv_reads_what_snapkv_keeps(budget, last_known, compact, generated):
    """Prompts scored chunk by chunk (the last chunk's ranking stands; `last_known`: only the last
    one ranks, as with atskv's worker), then decode queries with 1 token generated (the first
    query after the prompt: the prompt's largest share, all the ranking stored holds) or 3: each reads
    exactly the tokens atskv's snapkv keeps at that context (scores from the prompt's last queries,
    +inf for its window and what was generated), ties included. With `compact` (`free_blocks`)
    the best-ranked tokens move to each request's first slots where its prompt ends and the
    blocks `unread_blocks` names are filled with NaN: each read slot holds the key of a token
    snapkv keeps (told by content), and together they are that set."""
    from atskv.runtime.vllm.selection import PagedSnapKV, slot_view
    from atskv.selectors.base import LayerView, select_top_budget
    from atskv.selectors.snapkv import window_votes

    generator = torch.Generator().manual_seed(3)
    lengths, chunk = [37, 100, 16, 161], 23
    cache = PagedCache(lengths, width=12, generator=generator)
    cache.fill(chunk=chunk)
    queries = [torch.randn(n, HQ, D, generator=generator) for n in lengths]
    selector = PagedSnapKV(window=4, kernel=3)
    key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    state.ranked.fill_(7)  # stale: an earlier tenant's
    for r, n in enumerate(lengths):
        prompt = n - generated
        for start in range(0, prompt, chunk):
            stop = min(prompt, start + chunk)
            chunk_queries, last = queries[r][start:stop], stop == prompt or not last_known
            selector.observe_prompt(state, PromptChunk(chunk_queries, key_slots, cache.block_table[r], stop, BLOCK,
                                                       D**-0.5, budget, last=last, value_slots=value_slots,
                                                       compact=compact and last))  # fmt: skip
        if compact:
            unread = selector.unread_blocks(prompt, prompt, budget, BLOCK)
            cache.kv_cache[cache.block_table[r, list(unread)].long()] = torch.nan  # another request's now
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    positions, counts = selector.pick(torch.randn(len(lengths), HQ, D), HKV, state, cache.block_table, seq_lens, BLOCK,
                                      budget)  # fmt: skip
    for r, n in enumerate(lengths):
        prompt, w = n - generated, 4
        keys = cache.keys[r][:prompt].transpose(0, 1).unsqueeze(0)  # [1, HKV, P, D]
        at = torch.arange(prompt)
        causal = (at.view(1, -1) <= at[-w:].view(-1, 1)).expand(1, HKV, w, prompt)
        window_queries = queries[r][prompt - w : prompt].transpose(0, 1).unsqueeze(0)
        view = LayerView(0, window_queries, keys, causal, at.expand(1, HKV, prompt), None, D**-0.5, budget, None)
        votes = window_votes(view, w, kernel=3)  # [1, HKV, P]: +inf for the window
        scores = torch.cat([votes, torch.full((1, HKV, generated), torch.inf)], -1).unsqueeze(2)
        everything = torch.arange(n).expand(1, HKV, n)
        keep = select_top_budget(scores, torch.ones(1, HKV, 1, n, dtype=torch.bool), budget, everything,
                                 torch.tensor([[[n]]]))[0, :, 0]  # fmt: skip
        for h in range(HKV):
            read = positions[r, h, : counts[r, h]]
            held = key_slots[h, cache.slot(r, read).long()]  # what the slots hold: told apart by content
            read = (held.unsqueeze(1) == cache.keys[r][:, h].unsqueeze(0)).all(-1).nonzero()[:, 1].tolist()
            assert sorted(read) == keep[h].nonzero().view(-1).tolist() and len(set(read)) == len(read), (r, h)


GENERATED, CHUNK = 4, 23  # decode steps after each prompt, prefill chunk


def causal_lse(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`[HQ, n]` natural-log log-sum-exps of a chunk's queries `[n, HQ, D]` (the last n of the
    `[L, HKV, D]` keys' positions) over what each sees: what FlashAttention returns beside its output."""
    n, length = queries.shape[0], keys.shape[0]
    logits = torch.einsum("nhd,lhd->hnl", queries, keys.repeat_interleave(HQ // HKV, dim=1)) * D**-0.5
    sees = torch.arange(length) <= (length - n + torch.arange(n)).view(-1, 1)
    return logits.masked_fill(~sees, -torch.inf).logsumexp(-1)


def test_a_prompt_chunks_mass_uses_the_log_sum_exps_it_is_given(cache):
    """`chunk_mass` with FlashAttention's log-sum-exps gives what its own pass gives, and uses them:
    log-sum-exps larger by log 2 halve every token's mass."""
    from atskv.runtime.vllm.heavy_hitters import chunk_mass
    from atskv.runtime.vllm.selection import slot_view

    r, start, stop = 3, 100, 161
    queries = torch.randn(stop - start, HQ, D, generator=torch.Generator().manual_seed(1))
    key_slots = slot_view(cache.split()[0], 1)[0]
    chunk = PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5)
    own = chunk_mass(chunk)
    lse = causal_lse(queries, cache.keys[r][:stop])
    given = chunk_mass(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5, lse=lse))
    torch.testing.assert_close(given, own, rtol=1e-4, atol=1e-5)
    assert own.sum().item() == pytest.approx((stop - start) * HQ, rel=1e-4), "each query's probabilities sum to 1"
    halved = chunk_mass(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5,
                                    lse=lse + math.log(2)))  # fmt: skip
    torch.testing.assert_close(halved, own / 2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("w", [5, 61])
def test_window_votes_take_the_log_sum_exps_they_are_given(cache, w):
    """SnapKV's votes (`window_votes`) are the received mass of the chunk's last `w` queries (61:
    all of them), max-pooled: with FlashAttention's log-sum-exps they equal the votes of their own
    pass, and larger log-sum-exps scale them down."""
    from atskv.runtime.vllm.prompt_ranks import window_votes
    from atskv.runtime.vllm.selection import slot_view

    r, start, stop = 3, 100, 161
    queries = torch.randn(stop - start, HQ, D, generator=torch.Generator().manual_seed(w))
    key_slots = slot_view(cache.split()[0], 1)[0]
    lse = causal_lse(queries, cache.keys[r][:stop])
    own = window_votes(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5), w, 1)
    given = window_votes(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5, lse=lse),
                         w, 1)  # fmt: skip
    torch.testing.assert_close(given, own, rtol=1e-4, atol=1e-5)
    assert own.sum().item() == pytest.approx(w * HQ, rel=1e-4), "each window query's probabilities sum to 1"
    halved = window_votes(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5,
                                      lse=lse + math.log(2)), w, 1)  # fmt: skip
    torch.testing.assert_close(halved, own / 2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_a_top_count_ranks_as_the_whole_ranking_begins(seed):
    """`top_newest_first` (a top-k over one key a token) gives the first `count` positions of a
    stable sort of every token, ties to the newer token: on votes with plateaus, infinities,
    signed zeros and subnormals, at every count up to past the length (on the GPU where there is
    one: its shifts and top-k)."""
    from atskv.runtime.vllm.prompt_ranks import top_newest_first

    g = torch.Generator().manual_seed(seed)
    votes = torch.randn(3, 97, generator=g).round()  # plateaus
    special = torch.tensor([math.inf, -math.inf, -0.0, 0.0, -1e-40, 1e-40, 0.5])
    at = torch.rand(3, 97, generator=g) < 0.3
    votes[at] = special[torch.randint(len(special), (int(at.sum()),), generator=g)]
    whole = 96 - votes.flip(-1).sort(dim=-1, descending=True, stable=True).indices  # newest first among equals
    for count in range(0, 100, 7):
        assert torch.equal(top_newest_first(votes.to(KERNELS), count).cpu(), whole[:, :count])


@pytest.mark.parametrize("sample", [2, 7, 61])
def test_a_sampled_prompt_mass_is_every_strideth_querys_times_the_stride(cache, sample):
    """`prompt_sample`: the mass of every s-th query of the chunk, the chunk's last among them, times s."""
    from atskv.runtime.vllm.heavy_hitters import chunk_mass
    from atskv.runtime.vllm.selection import slot_view

    r, start, stop = 3, 100, 161
    queries = torch.randn(stop - start, HQ, D, generator=torch.Generator().manual_seed(sample))
    key_slots = slot_view(cache.split()[0], 1)[0]
    lse = causal_lse(queries, cache.keys[r][:stop])
    chunk = PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5, lse=lse)
    got = chunk_mass(chunk, sample)
    own = chunk_mass(PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, 0.5), sample)
    torch.testing.assert_close(own, got, rtol=1e-4, atol=1e-5)  # the log-sum-exps of its own pass: the same
    sampled = torch.arange(stop - start).flip(0)[::sample].flip(0)  # the chunk's last query, then every s-th back
    logits = torch.einsum("nhd,lhd->hnl", queries, cache.keys[r][:stop].repeat_interleave(HQ // HKV, dim=1))
    sees = torch.arange(stop) <= (start + torch.arange(stop - start)).view(-1, 1)
    probs = (logits * D**-0.5).masked_fill(~sees, -torch.inf).softmax(-1)[:, sampled]  # [HQ, m, L]
    want = probs.view(HKV, HQ // HKV, -1, stop).sum(dim=(1, 2)) * sample
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def decoding_requests(seed: int) -> tuple[torch.Generator, PagedCache, list[int]]:
    """Four requests in a paged cache (one shorter than a wide batch's lists), their prompts `GENERATED`
    tokens short of their lengths, and the generator for their queries."""
    generator = torch.Generator().manual_seed(seed)
    cache = PagedCache([37, 100, 16, 161], width=12, generator=generator)
    cache.fill(chunk=CHUNK)
    return generator, cache, [n - GENERATED for n in cache.lengths]


class _Accumulated:
    """What atskv's `H2OSelector.scores` reads of a layer: its accumulated mass by slot."""

    def __init__(self, mass: torch.Tensor):
        self.mass = mass

    def slot_tensor(self, name: str) -> torch.Tensor:
        return self.mass


@pytest.mark.parametrize("name", ["h2o", "learned"])
def test_a_chunk_known_not_to_end_its_prompt_adds_its_mass_and_ranks_nothing(cache, name, tmp_path):
    """`last=False` (the worker showed the prompt goes on): the chunk's mass is added, the list is
    left for the last chunk to rank (what it would hold now is never read); `last=True` ranks.
    (SnapKV keeps no mass: a chunk that is not the last does nothing, `test_paged_snapkv_...`.)"""
    from atskv.runtime.vllm.selection import PagedH2O, PagedLearned, slot_view

    selector = PagedH2O() if name == "h2o" else PagedLearned(predictor=engine_ready_predictor(tmp_path / "p", (2,)))
    key_slots = slot_view(cache.split()[0], 1)[0]
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    queries = torch.randn(40, HQ, D, generator=torch.Generator().manual_seed(3))
    r, stop = 1, 100  # the request of 100 tokens, its last 40

    def observe(last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        mass, kept = state.prompt_mass.clone(), state.kept.clone()
        selector.observe_prompt(state, PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5,
                                                   20, layer=2, last=last))  # fmt: skip
        return mass, kept

    mass, kept = observe(last=False)
    assert not torch.equal(state.prompt_mass, mass) and torch.equal(state.kept, kept)
    mass, kept = observe(last=True)
    assert not torch.equal(state.prompt_mass, mass) and not torch.equal(state.kept, kept)


@pytest.mark.parametrize("flash_lse, last_known, compact", [(False, False, False), (True, False, False),
                                                             (False, True, False), (False, True, True)])  # fmt: skip
@pytest.mark.parametrize("budget", [0.25, 20, 3, 500])
def test_paged_h2o_reads_and_accumulates_what_h2o_keeps(budget, flash_lse, last_known, compact):
    """Prompts observed chunk by chunk, then 4 decode steps of the whole batch (a request shorter
    than the widest list, and a padded row of length 0 whose stale block table is another
    request's): each step reads exactly the tokens atskv's h2o keeps (its scores, its top budget,
    ties to the newer token), attends as over them, and each read's mass accumulates as h2o's.
    With `flash_lse` each chunk comes with its queries' log-sum-exps, as the backend takes them
    from FlashAttention, and the mass uses them instead of its own pass. With `compact`
    (`free_blocks`) the kept tokens move to each request's first slots at its prompt's last chunk
    and the blocks `unread_blocks` names are another request's from then on, their KV NaN and
    their slots' list entries and values scribbled over before every step: the reads are the
    same tokens (slot j of head h its j-th kept position) and attend the same."""
    from atskv.kernels.budget import kept_count
    from atskv.kernels.kept_lists import list_slots
    from atskv.runtime.vllm.heavy_hitters import recent_window
    from atskv.runtime.vllm.selection import PagedH2O, slot_view
    from atskv.selectors.base import LayerView, select_top_budget
    from atskv.selectors.h2o import H2OSelector

    # `last_known`: the worker shows which chunk ends each prompt, and the list is ranked only there

    generator, cache, prompts = decoding_requests(seed=5)
    lengths, generated, chunk = cache.lengths, GENERATED, CHUNK
    queries = [torch.randn(p, HQ, D, generator=generator) for p in prompts]
    selector, reference = PagedH2O(), H2OSelector()
    key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    for tensor in (state.prompt_mass, state.kept_value):
        tensor.uniform_(5, 6, generator=generator)  # stale: an earlier tenant's
    state.kept.fill_(3)
    for r, prompt in enumerate(prompts):
        for start in range(0, prompt, chunk):
            stop = min(prompt, start + chunk)
            lse = causal_lse(queries[r][start:stop], cache.keys[r][:stop]) if flash_lse else None
            last = stop == prompt or not last_known
            selector.observe_prompt(state, PromptChunk(queries[r][start:stop], key_slots, cache.block_table[r], stop,
                                                       BLOCK, D**-0.5, budget, lse=lse, last=last,
                                                       value_slots=value_slots, compact=compact and last))  # fmt: skip

    def grouped_logits(q, keys):  # q [Tq, HQ, D], keys [n, HKV, D] -> [HKV, G, Tq, n]
        k = keys.transpose(0, 1).unsqueeze(1)
        return q.view(q.shape[0], HKV, HQ // HKV, D).permute(1, 2, 0, 3) @ k.transpose(-1, -2) * D**-0.5

    masses, kept = [], []
    for r, prompt in enumerate(prompts):  # atskv's h2o: the dense prompt's mass, its top budget at the end
        logits = grouped_logits(queries[r], cache.keys[r][:prompt])
        causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
        masses.append(logits.masked_fill(~causal, -torch.inf).softmax(-1).sum(dim=(1, 2)).unsqueeze(0))
        kept.append(torch.ones(1, HKV, prompt, dtype=torch.bool))

    def h2o_keep(r: int, n: int) -> torch.Tensor:
        at = torch.arange(n).expand(1, HKV, n)
        view = LayerView(0, None, None, kept[r].unsqueeze(2), at, torch.tensor([[[n]]]), D**-0.5, budget,
                         _Accumulated(masses[r]))  # fmt: skip
        return select_top_budget(reference.scores(view), kept[r].unsqueeze(2), budget, at, view.context)[:, :, 0]

    kept = [h2o_keep(r, p) for r, p in enumerate(prompts)]
    position_of = [[{} for _ in range(HKV)] for _ in prompts]  # a compacted slot's position
    others = torch.zeros(0, dtype=torch.long)  # the slots of freed blocks: another request's
    if compact:
        for r, prompt in enumerate(prompts):
            window = recent_window(kept_count(budget, prompt), selector.recent_fraction)
            for h in range(HKV):
                hitters = kept[r][0, h, : prompt - window].nonzero().view(-1).tolist()
                position_of[r][h] = dict(enumerate(hitters))
            unread = cache.block_table[r, list(selector.unread_blocks(prompt, prompt, budget, BLOCK))].long()
            cache.kv_cache[unread] = torch.nan
            others = torch.cat([others, (unread.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)])
        assert len(others) or budget == 500, "the longer prompts free blocks"
    rows = len(lengths)
    table = torch.cat([cache.block_table, cache.block_table[1:2]])  # a padded row: a stale table, length 0
    for g in range(generated):
        seq_lens = torch.tensor([p + g + 1 for p in prompts] + [0], dtype=torch.int32)
        query = torch.randn(rows + 1, HQ, D, generator=generator)
        state.kept[others], state.kept_value[others] = 1, torch.nan  # what the freed blocks' tenant writes
        positions, counts = selector.pick(query, HKV, state, table, seq_lens, BLOCK, budget)
        out, mass = paged_sparse_decode(query, *cache.split(), positions, counts, table, D**-0.5, want_mass=True)
        selector.observe_read(state, mass, table, seq_lens, BLOCK)
        assert counts[rows].tolist() == [0] * HKV, "a padded row reads nothing"
        for r, prompt in enumerate(prompts):
            n = prompt + g + 1
            masses[r] = torch.nn.functional.pad(masses[r], (0, 1))
            kept[r] = torch.nn.functional.pad(kept[r], (0, 1), value=True)
            kept[r] = h2o_keep(r, n)
            logits = grouped_logits(query[r : r + 1], cache.keys[r][:n])
            probs = logits.masked_fill(~kept[r][0, :, None, None], -torch.inf).softmax(-1)  # [HKV, G, 1, n]
            masses[r] += probs.sum(dim=(1, 2)).unsqueeze(0)
            want = (probs @ cache.values[r][:n].transpose(0, 1).unsqueeze(1)).reshape(HQ, D)
            torch.testing.assert_close(out[r], want, rtol=1e-4, atol=1e-5)
            for h in range(HKV):
                read = [position_of[r][h].get(at, at) for at in positions[r, h, : counts[r, h]].tolist()]
                assert sorted(read) == kept[r][0, h].nonzero().view(-1).tolist(), (g, r, h)
                entries = list_slots(table[r : r + 1], seq_lens[r : r + 1], BLOCK, int(counts[r, h]), state.spare,
                                     state.moved)[0]  # fmt: skip
                listed = state.kept_value[entries, h]
                torch.testing.assert_close(listed, masses[r][0, h, read], rtol=1e-4, atol=1e-5)


def engine_ready_predictor(folder, layers: tuple[int, ...], without=("hidden_norm", "token_type")) -> str:
    """A random predictor that reads what an attention backend sees: no hidden state, no token type
    (nor what else `without` names)."""
    from atskv.features import SCALAR_FEATURES
    from atskv.models.geometry import ModelGeometry
    from atskv.predictor.export import export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP

    torch.manual_seed(11)
    spec = FeatureSpec(64, SCALAR_FEATURES, len(layers), HKV)
    mlp = RelevanceMLP(spec, reduced_width=0, hidden=16, without=list(without)).eval()
    geometry = ModelGeometry("llama", max(layers) + 1, HQ, HKV, D, 64, ("full_attention",) * (max(layers) + 1), None)
    export_predictor(mlp, torch.zeros(96, dtype=torch.int8), folder, base_model="tiny", geometry=geometry,
                     managed_layers=list(layers))  # fmt: skip
    return str(folder)


@pytest.mark.parametrize("last_known, received, layers", [(False, True, (2, 3)), (True, True, (2, 3)),
                                                       (True, False, (2, 3)), (True, True, (1, 4))])  # fmt: skip
@pytest.mark.parametrize("budget, window_share", [(0.25, 0.0), (20, 0.0), (3, 0.0), (0.25, 0.5), (20, 0.5)])
@pytest.mark.parametrize("at_once", [False, True])
def test_paged_learned_reads_what_the_learned_selector_keeps(budget, window_share, last_known, received, layers,
                                                             at_once, tmp_path, monkeypatch):  # fmt: skip
    """Two managed layers (the second reads the first's attention; apart, as Gemma's global
    layers are, or next to each other) score prompts chunk by chunk,
    then 4 decode steps: each reads exactly what atskv's learned selector keeps without a refresh
    (the collection's features at the prompt's end, scored as the selector scores slots, the
    `window_share` of the budget pinned by SnapKV's vote of the last 2 queries, its top budget;
    generated tokens at +inf), and its list holds the prompt's picks with those scores, lowest first
    (the order they leave in: `QueuedLists`). A predictor fit without the
    attention received (`received` False) gets the same and the prompt's mass is never computed.
    `at_once`: the backend hands it every layer's lists, and a step's first layer reads both
    layers' queues in one kernel call (the second finds its read in the forward's `step`)."""
    from atskv.kernels.budget import kept_count
    from atskv.kernels.learned_features import score_slots
    from atskv.predictor.features import attention_so_far, scalar_features
    from atskv.runtime.vllm import learned
    from atskv.runtime.vllm.selection import PagedLearned, slot_view
    from atskv.selectors.base import LayerView, select_top_budget
    from atskv.selectors.snapkv import window_votes

    without = ("hidden_norm", "token_type") + (() if received else learned.RECEIVED)
    selector = PagedLearned(predictor=engine_ready_predictor(tmp_path / "predictor", layers, without),
                            window_share=window_share, window=2)  # fmt: skip
    assert selector.takes_prompt_lse == (received or window_share > 0)  # the mass, or the window's votes
    if not received:
        monkeypatch.setattr(learned, "chunk_mass", None)  # called, it would fail
    generator, cache, prompts = decoding_requests(seed=7)
    lengths, generated, chunk = cache.lengths, GENERATED, CHUNK
    queries = {layer: [torch.randn(p, HQ, D, generator=generator) for p in prompts] for layer in layers}
    key_slots = slot_view(cache.split()[0], 1)[0]
    states = {layer: selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
              for layer in layers}  # fmt: skip
    for r, prompt in enumerate(prompts):
        for start in range(0, prompt, chunk):
            stop, step = min(prompt, start + chunk), {}  # one forward: its layers share `step`
            for layer in layers:
                part = PromptChunk(queries[layer][r][start:stop], key_slots, cache.block_table[r], stop, BLOCK,
                                   D**-0.5, budget, layer, r, step, last=stop == prompt or not last_known)  # fmt: skip
                selector.observe_prompt(states[layer], part)

    kept, scores = {}, {}
    for r, prompt in enumerate(prompts):  # the learned selector at the prompt's end: features, scores, its top budget
        keys = cache.keys[r][:prompt].transpose(0, 1).unsqueeze(0)  # [1, HKV, P, D]
        previous = None
        for i, layer in enumerate(layers):
            q = queries[layer][r].view(prompt, HKV, HQ // HKV, D).permute(1, 2, 0, 3)  # [HKV, G, P, D]
            logits = q @ keys[0].unsqueeze(1).transpose(-1, -2) * D**-0.5
            causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
            probs = logits.masked_fill(~causal, -torch.inf).softmax(-1).mean(1).unsqueeze(0)  # [1, HKV, P, P]
            attention = attention_so_far(probs, prompt - 1)
            features = scalar_features(attention, previous, torch.zeros(1, prompt, 64), keys, prompt - 1)
            previous = attention.mean(1)
            at = torch.arange(prompt).expand(1, HKV, prompt)
            score = torch.empty(1, HKV, prompt)
            score_slots(selector.loaded.mlp, i, features, torch.zeros(1, HKV, prompt, 0), torch.ones(1, HKV, prompt),
                        at, score)  # fmt: skip
            if window_share:  # the learned selector's `_pin_window_pick`: its top votes score +inf
                last = queries[layer][r][-2:].transpose(0, 1).unsqueeze(0)
                view = LayerView(0, last, keys, causal[-2:].expand(1, HKV, 2, prompt), at, None, D**-0.5, budget, None)
                pins = math.ceil(window_share * kept_count(budget, prompt))
                score.scatter_(-1, window_votes(view, 2).topk(pins, dim=-1).indices, torch.inf)
            everything = torch.ones(1, HKV, 1, prompt, dtype=torch.bool)
            kept[layer, r] = select_top_budget(score.unsqueeze(2), everything, budget, at,
                                               torch.tensor([[[prompt]]]))[:, :, 0]  # fmt: skip
            scores[layer, r] = score
    rows, reads = len(lengths), []
    if at_once:  # (the backend's `later_states` gives each layer its own and the later ones')
        selector.later_states = lambda: reads.append(1) or [states[layer] for layer in layers]
    for g in range(generated):
        seq_lens = torch.tensor([p + g + 1 for p in prompts], dtype=torch.int32)
        step = {}  # one forward's
        for layer in layers:
            positions, counts = selector.pick(torch.randn(rows, HQ, D), HKV, states[layer], cache.block_table,
                                              seq_lens, BLOCK, budget, step)  # fmt: skip
            for r, prompt in enumerate(prompts):
                n = prompt + g + 1
                scores[layer, r] = torch.nn.functional.pad(scores[layer, r], (0, 1), value=torch.inf)
                held = torch.nn.functional.pad(kept[layer, r], (0, 1), value=True)
                at = torch.arange(n).expand(1, HKV, n)
                ranked = scores[layer, r].masked_fill(~held, -torch.inf).unsqueeze(2)
                keep = select_top_budget(ranked, held.unsqueeze(2), budget, at, torch.tensor([[[n]]]))
                kept[layer, r] = keep[:, :, 0]
                for h in range(HKV):
                    read = positions[r, h, : counts[r, h]]
                    assert sorted(read.tolist()) == kept[layer, r][0, h].nonzero().view(-1).tolist(), (g, layer, r, h)
                    entries = cache.slot(r, torch.arange(kept_count(budget, prompt))).long()
                    stored, listed = states[layer].kept[entries, h].long(), states[layer].kept_value[entries, h]
                    torch.testing.assert_close(listed, scores[layer, r][0, h, stored], rtol=1e-4, atol=1e-5)
                    assert bool((listed[1:] >= listed[:-1]).all())  # lowest first: the order they leave in
    assert len(reads) == (generated if at_once else 0)  # once a forward


@pytest.mark.parametrize("total, tp_size, firsts", [(8, 1, [0]), (8, 2, [0, 4]), (8, 4, [0, 2, 4, 6]),
                                                    (2, 4, [0, 0, 1, 1]), (1, 2, [0, 0])])  # fmt: skip
def test_each_tensor_parallel_rank_holds_the_kv_heads_vllm_gives_it(total, tp_size, firsts):
    """vLLM's QKV projection: `total / tp` contiguous heads a rank, or each head replicated over
    `tp / total` consecutive ranks where there are fewer heads than ranks."""
    from atskv.runtime.vllm.protocol import shard_kv_heads

    assert [shard_kv_heads(total, tp_size, rank) for rank in range(tp_size)] == [(f, total) for f in firsts]


def test_a_tensor_parallel_shard_scores_its_kv_heads_as_the_model_does(tmp_path):
    """The learned selector on a GPU holding the model's KV head 1 of 2 (its only head there)
    scores it as the whole model's selector scores head 1 (its folded predictor, which the prompt's
    ranking and a refresh run); a shard of a model with another head count than the predictor's
    is a one-line error."""
    from atskv.kernels.prompt_scores import prompt_scores
    from atskv.runtime.vllm.composition import build_paged_selector
    from atskv.runtime.vllm.selection import PagedLearned

    predictor = engine_ready_predictor(tmp_path / "predictor", (2, 3))
    whole = PagedLearned(predictor=predictor)
    whole.new_state(4, BLOCK, HKV, D, torch.float32, "cpu")
    shard = PagedLearned(predictor=predictor, refresh_every=4)
    shard.kv_shard = (1, HKV)
    shard.new_state(4, BLOCK, 1, D, torch.float32, "cpu")
    keys, attention = torch.randn(HKV, 40, D), torch.rand(HKV, 40)
    whole_scores = prompt_scores(attention, None, keys, whole.folded, 1)
    torch.testing.assert_close(prompt_scores(attention[1:], None, keys[1:], shard.folded, 1), whole_scores[1:])
    as_head_0 = prompt_scores(attention[1:], None, keys[1:], whole.folded, 1)  # the head matters
    assert (as_head_0 - whole_scores[1:]).abs().max() > 1e-4
    torch.testing.assert_close(shard.folded.bias, whole.folded.bias[:, 1:])
    composed = build_paged_selector("learned+sparq", {"learned": {"predictor": predictor}})
    composed.kv_shard = (1, HKV)  # what the backend sets: the learned part must see it
    composed.new_state(4, BLOCK, 1, D, torch.float32, "cpu")
    torch.testing.assert_close(composed.residency.folded.bias, whole.folded.bias[:, 1:])
    other = PagedLearned(predictor=predictor)
    other.kv_shard = (0, 2 * HKV)
    with pytest.raises(InputError, match=f"scores {HKV} KV heads, this model's layers have {2 * HKV}"):
        other.new_state(4, BLOCK, HKV, D, torch.float32, "cpu")


def test_the_learned_selector_frees_blocks_only_without_a_refresh(tmp_path):
    """A refresh rescores the listed tokens from features of their positions, which compaction
    gives up for slots: `free_blocks` with `refresh_every` is a one-line error, without it fine."""
    predictor = engine_ready_predictor(tmp_path / "predictor", (2,))
    assert PluginConfig(selector="learned", options={"predictor": predictor}, free_blocks=True).free_blocks
    with pytest.raises(InputError, match="learned without refresh_every"):
        PluginConfig(selector="learned", options={"predictor": predictor, "refresh_every": 16}, free_blocks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name, received", [("learned", False), ("learned", True), ("h2o", True), ("snapkv", True)])
def test_ranking_a_prompt_never_waits_for_the_gpu(name, received, tmp_path):
    """A prefill chunk's ranking runs once per request and layer inside vLLM's forward: a host sync
    there (a host scalar copied to the GPU, `.item()`, a mask's nonzero) stalls the CPU until the
    GPU drains, then leaves the GPU idle while the ranking's Python runs, once per request and
    layer (~13 ms each at the 8B shape, H100). Under CUDA's sync debug mode any sync is an error."""
    from atskv.runtime.vllm import learned
    from atskv.runtime.vllm.composition import build_paged_selector

    layers, device = (2, 3), torch.device("cuda")
    options = {}
    if name == "learned":
        without = ("hidden_norm", "token_type") + (() if received else learned.RECEIVED)
        options = {"predictor": engine_ready_predictor(tmp_path / "predictor", layers, without), "window_share": 0.5}
    selector = build_paged_selector(name, options)
    blocks, prompt, chunk = 24, 300, 128
    key_slots = torch.randn(HKV, blocks * BLOCK, D, device=device)
    table = torch.randperm(blocks, device=device)[: -(-prompt // BLOCK)].int()
    queries = torch.randn(prompt, HQ, D, device=device)
    states = {layer: selector.new_state(blocks, BLOCK, HKV, D, torch.float32, device) for layer in layers}

    def rank(step: dict) -> None:
        for start in range(0, prompt, chunk):
            stop = min(prompt, start + chunk)
            for layer in layers:
                selector.layer = layer
                part = PromptChunk(queries[start:stop], key_slots, table, stop, BLOCK, D**-0.5, 0.1, layer, 0, step,
                                   last=stop == prompt)  # fmt: skip
                selector.observe_prompt(states[layer], part)

    rank({})  # kernels compiled and weights packed before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rank({})
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_predictor_that_reads_the_hidden_state_is_refused_in_vllm(tmp_path):
    from atskv.features import SCALAR_FEATURES
    from atskv.models.geometry import ModelGeometry
    from atskv.predictor.export import export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP
    from atskv.runtime.vllm.selection import PagedLearned

    mlp = RelevanceMLP(FeatureSpec(64, SCALAR_FEATURES, 2, HKV), reduced_width=8, hidden=16).eval()
    geometry = ModelGeometry("llama", 4, HQ, HKV, D, 64, ("full_attention",) * 4, None)
    export_predictor(mlp, torch.zeros(96, dtype=torch.int8), tmp_path, base_model="tiny", geometry=geometry,
                     managed_layers=[2, 3])  # fmt: skip
    with pytest.raises(InputError, match=r"reads hidden, hidden_norm, token_type, which vLLM does not show"):
        PagedLearned(predictor=str(tmp_path))
    with pytest.raises(InputError, match="needs its predictor"):
        PagedLearned()


def test_the_plugins_selection_imports_no_transformers():
    """vLLM's workers run with vLLM's transformers, which may be older than atskv's pin: the plugin's
    pure modules import none (a learned selector's predictor brings it when loaded)."""
    import subprocess
    import sys

    modules = ["config", "batch", "selection", "heavy_hitters", "prompt_ranks", "learned"]
    heavy = "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'lightning')))"
    code = "; ".join([f"import atskv.runtime.vllm.{m}" for m in modules] + ["import sys", heavy])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_paged_sparqs_logits_kernel_at_other_tile_widths_chooses_the_same(cache, monkeypatch):
    """`sparq_decode_paged`'s tuning keywords reach the kernels: at 32 and 64 slots a step of the
    logits kernel (several steps a span) and other warps, the choice is the default tile's."""
    from atskv.kernels.sparq_decode import sparq_decode_paged
    from atskv.runtime.vllm.selection import slot_view, usable_positions

    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    query = torch.randn(len(cache.lengths), HQ, D, generator=torch.Generator().manual_seed(9))
    keys = slot_view(cache.split()[0], 1)[0]
    slots = cache.block_table.shape[1] * BLOCK
    args = [t.to(KERNELS) for t in (query, keys, cache.block_table)]
    at = [t.to(KERNELS) for t in (usable_positions(seq_lens, slots), seq_lens)]

    def choose(**tuning):
        idx, lengths = sparq_decode_paged(*args, BLOCK, *at, D**-0.5, 4, 24, 24, **tuning)
        return [set(idx[r, h, : int(lengths[r, h])].tolist()) for r in range(idx.shape[0]) for h in range(HKV)]

    default = choose()
    assert choose(block_s=32, parts=2) == default and choose(block_s=64, warps=(4, 8, 4, 4)) == default
    assert [len(chosen) for chosen in default] == [min(24, n) for n in cache.lengths for _ in range(HKV)]
    with pytest.raises(Exception, match="power of 2"):  # it reaches the kernel: Triton tiles are powers of 2
        choose(block_s=48)


@pytest.mark.parametrize("budget, residency", [(12, None), (0.1, 0.5), (8, 40)])
def test_a_composition_reads_what_sparq_chooses_among_the_residents(cache, budget, residency, monkeypatch):
    """`streaming_llm+sparq`: StreamingLLM's sinks and recent tokens at the residency budget (4x the
    budget by default, atskv's rule), then SparQ's choice among them at the budget, normalised over
    the residents as atskv's `HybridSelector` shows them to its attention part; the kernels
    (Triton's interpreter on the CPU) and the reference alike."""
    from atskv.runtime.vllm.composition import RESIDENCY_FACTOR, build_paged_selector
    from atskv.runtime.vllm.selection import slot_view
    from atskv.selectors.hybrid import RESIDENCY_FACTOR as ATSKV_FACTOR

    assert RESIDENCY_FACTOR == ATSKV_FACTOR
    options = {"sparq": {"rank_fraction": 4 / D}} | ({"residency_budget": residency} if residency else {})
    selector = build_paged_selector("streaming_llm+sparq", options)
    assert selector.name == "streaming_llm+sparq" and selector.reads_keys and not selector.keeps_state
    b, width = len(cache.lengths), cache.block_table.shape[1] * BLOCK
    held = residency or (budget * 4 if isinstance(budget, int) else min(1.0, budget * 4))
    query = torch.randn(b, HQ, D, generator=torch.Generator().manual_seed(9))
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32)
    slot_pos = torch.full((b, HKV, width), -1)
    for r, n in enumerate(cache.lengths):
        k = math.ceil(n * held) if isinstance(held, float) else min(n, held)
        keep = torch.where(torch.arange(n) < 4, torch.inf, torch.arange(n, dtype=torch.float32)).topk(k).indices
        slot_pos[r, :, keep] = keep
    keys = padded(cache.keys, width)
    k = budget if isinstance(budget, int) else math.ceil(budget * width)
    want_idx, want_len = sparq_decode_reference(query, keys, keys.transpose(2, 3).clone(), slot_pos,
                                                (seq_lens.long() - 1).view(-1, 1).expand(-1, HKV), seq_lens, D**-0.5,
                                                4, budget, k)  # fmt: skip
    key_slots = slot_view(cache.split()[0], 1)[0]
    for kernels, device in (("reference", "cpu"), ("triton", KERNELS)):
        monkeypatch.setenv("ATSKV_KERNELS", kernels)
        inputs = [t.to(device) for t in (query, cache.block_table, seq_lens, key_slots)]
        positions, lengths = selector.pick(inputs[0], HKV, None, inputs[1], inputs[2], BLOCK, budget, {},
                                           keys=inputs[3], scaling=D**-0.5)  # fmt: skip
        positions, lengths = positions.cpu(), lengths.cpu()
        assert torch.equal(lengths.long(), want_len.long()), kernels
        for r in range(b):
            for h in range(HKV):
                n = int(lengths[r, h])
                assert set(positions[r, h, :n].tolist()) == set(want_idx[r, h, :n].tolist()), (kernels, r, h)
                assert set(positions[r, h, :n].tolist()) <= set(slot_pos[r, h][slot_pos[r, h] >= 0].tolist())
    assert (lengths < seq_lens.view(-1, 1)).any()


def test_a_composition_hands_the_reads_mass_to_its_residency_part_by_its_own_entries():
    from atskv.runtime.vllm.composition import build_paged_selector

    selector = build_paged_selector("h2o+sparq", {"residency_budget": 20})
    assert selector.reads_mass and selector.scores_prompt and selector.keeps_state
    got = {}
    selector.residency.observe_read = lambda state, mass, *rest: got.setdefault("mass", mass)
    chosen = torch.tensor([[[3, 0, 5]]])
    selector._chosen = (chosen, torch.tensor([[2]]), 6)
    selector.observe_read(None, torch.tensor([[[0.5, 0.25, 9.0]]]), None, None, BLOCK)
    assert got["mass"].tolist() == [[[0.25, 0.0, 0.0, 0.5, 0.0, 0.0]]]  # the third read entry is filler


@pytest.mark.parametrize("name, options, message", [
    ("quest+sparq", {}, "quest chooses per query"),
    ("h2o+snapkv", {}, "snapkv cannot choose among"),
    ("h2o+sparq", {"sparq": {"rank": 4}}, "sparq has no option 'rank'"),
    ("h2o+sparq", {"h2o_": {}}, "no option 'h2o_'"),
    ("h2o+sparq", {"residency_budget": 0}, "bad residency_budget"),
    ("a+b+c", {}, "no selector 'a\\+b\\+c'"),
])  # fmt: skip
def test_bad_compositions_are_one_line_errors(name, options, message):
    with pytest.raises(InputError, match=message):
        PluginConfig(selector=name, options=options)


def test_learned_plus_sparq_takes_its_parts_options_by_name(tmp_path):
    """`learned+sparq` with the learned part's predictor under "learned": the composition scores the
    prompt and keeps state (its residency part's), reads keys (its attention part's), and builds
    from the plugin's settings as vLLM hands them over."""
    from atskv.eval.vllm_speed import random_engine_predictor

    predictor = str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "p"))
    config = PluginConfig.from_additional_config({"atskv": {
        "selector": "learned+sparq", "budget": 0.05,
        "options": {"learned": {"predictor": predictor, "window_share": 0.5}, "residency_budget": 0.25}}})  # fmt: skip
    from atskv.runtime.vllm.composition import build_paged_selector

    selector = build_paged_selector(config.selector, config.options)
    assert (selector.scores_prompt, selector.keeps_state, selector.reads_keys, selector.reads_mass) == (
        True, True, True, False)  # fmt: skip
    assert selector.residency.window_share == 0.5 and selector.residency_budget == 0.25
    with pytest.raises(InputError, match="needs its predictor"):
        PluginConfig(selector="learned+sparq", options={"sparq": {}})


@pytest.mark.parametrize("window_share", [0.0, 0.5])
def test_paged_learned_with_a_refresh_rescores_its_list_every_n_steps(window_share, tmp_path, monkeypatch):
    """`refresh_every=2`, two managed layers: at decode steps 2 and 4 of each request every listed
    token's score becomes the predictor's (scored by the MLP itself, not the folded kernel form)
    on its current features: the mass the prompt and the decode reads gave it so far, its key's
    norm as written, its age, the previous layer's received mass; pinned tokens stay +inf; at
    steps 1 and 3 the scores stay. The kernel path (Triton's interpreter) gives the same."""
    from atskv.features import feature_columns
    from atskv.kernels.budget import kept_count, kept_tokens
    from atskv.runtime.vllm.selection import PagedLearned, slot_view

    layers = (2, 3)
    predictor = engine_ready_predictor(tmp_path / "predictor", layers)
    selector = {layer: PagedLearned(predictor=predictor, window_share=window_share, window=2, refresh_every=2)
                for layer in layers}  # fmt: skip
    for layer, s in selector.items():
        s.layer = layer
    assert selector[2].reads_mass
    mlp = selector[2].loaded.mlp
    budget = 0.4
    for kernels in ("reference", "triton") if KERNELS == "cpu" else ("reference",):  # CPU tensors: the interpreter's
        monkeypatch.setenv("ATSKV_KERNELS", kernels)
        generator, cache, prompts = decoding_requests(seed=5)
        key_slots = slot_view(cache.split()[0], 1)[0]
        states = {layer: selector[layer].new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
                  for layer in layers}  # fmt: skip
        for r, prompt in enumerate(prompts):
            for layer in layers:  # the prompt's keys as the cache write hands them over
                selector[layer].after_write(states[layer], cache.keys[r][:prompt], cache.slot(r, torch.arange(prompt)),
                                            BLOCK)  # fmt: skip
            for start in range(0, prompt, CHUNK):
                stop, step = min(prompt, start + CHUNK), {}
                for layer in layers:
                    queries = torch.randn(stop - start, HQ, D, generator=generator)
                    chunk = PromptChunk(queries, key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, budget, layer,
                                        r, step)  # fmt: skip
                    selector[layer].observe_prompt(states[layer], chunk)
            written = states[layers[0]].key_norm[cache.slot(r, torch.arange(prompt)).long()]
            torch.testing.assert_close(written, cache.keys[r][:prompt].norm(dim=-1))
        rows = len(prompts)
        for g in range(GENERATED):
            seq_lens = torch.tensor([p + g + 1 for p in prompts], dtype=torch.int32)
            step = {}
            for i, layer in enumerate(layers):
                state = states[layer]
                for r, prompt in enumerate(prompts):  # the new token's key
                    selector[layer].after_write(state, cache.keys[r][prompt + g : prompt + g + 1],
                                                cache.slot(r, torch.tensor([prompt + g])), BLOCK)  # fmt: skip
                before = state.kept_value.clone()
                want = {}
                for r, prompt in enumerate(prompts):  # the expected scores, by position, from the state as it is
                    n = prompt + g + 1
                    held = int(kept_tokens(budget, torch.tensor(n - 1)))
                    at = cache.slot(r, torch.arange(held)).long()
                    for h in range(HKV):
                        pos = state.kept[at, h].long()
                        where = cache.slot(r, pos).long()
                        seen = (n - 1 - pos).clamp(min=1).float()
                        attention = state.prompt_mass[where, h] / (HQ // HKV) / seen
                        prev = (states[layers[0]].prompt_mass[where].mean(-1) / (HQ // HKV) / seen if i
                                else torch.zeros(held))  # fmt: skip
                        columns = feature_columns(attention, pos.float(), torch.tensor(n - 1.0), torch.zeros(held),
                                                  state.key_norm[where, h], prev)  # fmt: skip
                        with torch.no_grad():
                            score = mlp.score(columns.new_zeros(held, 0), columns, torch.zeros(held, dtype=torch.long),
                                              torch.full((held,), i), torch.full((held,), h)).float()  # fmt: skip
                        want[r, h] = (at, torch.where(state.pinned[where, h], torch.inf, score))
                positions, counts = selector[layer].pick(torch.randn(rows, HQ, D, generator=generator), HKV, state,
                                                         cache.block_table, seq_lens, BLOCK, budget, step)  # fmt: skip
                due = (g + 1) % 2 == 0
                for (r, h), (at, score) in want.items():
                    newest = prompts[r] + g
                    others = state.kept[at, h] != newest  # the entry the new token took, if one
                    got = state.kept_value[at, h][others]
                    expected = score[others] if due else before[at, h][others]
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4,
                                               msg=f"{kernels} {g} {layer} {r} {h}")  # fmt: skip
                if window_share and due:
                    assert torch.isinf(torch.cat([s for _, s in want.values()])).any(), "pinned tokens stay +inf"
                width = positions.shape[-1]
                mass = torch.rand(rows, HKV, width, generator=generator)
                received = state.prompt_mass.clone()
                selector[layer].observe_read(state, mass, cache.block_table, seq_lens, BLOCK)
                read = cache.slot(1, positions[1, 0, : counts[1, 0]]).long()  # what the read gave request 1, head 0
                torch.testing.assert_close(state.prompt_mass[read, 0] - received[read, 0], mass[1, 0, : counts[1, 0]])
        assert kept_count(budget, 161) > 0


@pytest.mark.parametrize("budget", [0.25, 20])
def test_a_compacted_learned_list_reads_what_it_read_uncompacted(budget, tmp_path):
    """The learned selector with `free_blocks`: its prompt's kept tokens move to the request's first
    slots where the prompt ends, the freed blocks become another request's (their KV NaN, their
    state scribbled over before every step) and a fractional budget's list grows while decoding;
    every step reads the same tokens (a moved slot mapped back to its position) as the same
    selector without compaction."""
    from atskv.runtime.vllm.selection import PagedLearned, slot_view

    predictor = engine_ready_predictor(tmp_path / "predictor", (2, 3))
    runs, steps = {}, 48  # a quarter of 48 new tokens: the list grows past its prompt's blocks
    for compact in (False, True):
        generator = torch.Generator().manual_seed(13)
        cache = PagedCache([298, 198], width=20, generator=generator)
        cache.fill(chunk=CHUNK)
        prompts = [n - steps for n in cache.lengths]
        selector = PagedLearned(predictor=predictor, window_share=0.5, window=2)
        selector.layer = 2
        key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
        state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
        moved, others = {}, torch.zeros(0, dtype=torch.long)
        for r, prompt in enumerate(prompts):
            queries = torch.randn(prompt, HQ, D, generator=generator)
            for start in range(0, prompt, CHUNK):
                stop = min(prompt, start + CHUNK)
                selector.observe_prompt(state, PromptChunk(
                    queries[start:stop], key_slots, cache.block_table[r], stop, BLOCK, D**-0.5, budget, 2, r, {},
                    last=stop == prompt, value_slots=value_slots, compact=compact and stop == prompt,
                    on_move=lambda positions, r=r: moved.__setitem__(r, positions.clone())))  # fmt: skip
            if compact:
                unread = cache.block_table[r, list(PagedLearned.freeing_rule({})(prompt, prompt, budget, BLOCK))].long()
                cache.kv_cache[unread] = torch.nan
                others = torch.cat([others, (unread.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)])
        reads = []
        for g in range(steps):
            seq_lens = torch.tensor([p + g + 1 for p in prompts], dtype=torch.int32)
            state.kept[others], state.kept_value[others] = 1, -5.0  # what the freed blocks' tenant writes
            positions, counts = selector.pick(torch.randn(len(prompts), HQ, D, generator=generator), HKV, state,
                                              cache.block_table, seq_lens, BLOCK, budget)  # fmt: skip
            reads.append([[sorted(int(moved[r][h, p]) if r in moved and p < moved[r].shape[1] else p
                                  for p in positions[r, h, : counts[r, h]].tolist()) for h in range(HKV)]
                          for r in range(len(prompts))])  # fmt: skip
        runs[compact] = (reads, len(others))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0 or budget == 20, "the longer prompts free blocks"
