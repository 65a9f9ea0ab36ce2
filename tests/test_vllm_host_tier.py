"""The plugin's host tier (`atskv.runtime.vllm.host_tier`) on the CPU, without vLLM: H2O's lists
compacted where their prompts end over a paged cache laid out as vLLM's, the prompts parked first,
the freed blocks another request's; each decode step must read H2O's kept tokens and the parked
tokens of the pages Quest's bounds of the original keys rate highest, attend as over them, and
fetch only the pages its cache misses."""

from __future__ import annotations

import pytest
import torch

from atskv.errors import InputError
from atskv.kernels.int4_page_scores import dequantize_int4, quantize_int4
from atskv.kernels.page_copy import paged_page_copy
from atskv.kernels.quest import page_bounds, quest_page_scores_reference
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.config import PluginConfig
from atskv.runtime.vllm.host_tier import HostTier, ParkedPrompts, Parking, Regions, region_nbytes, split_unread
from atskv.runtime.vllm.selection import PagedH2O, paged_sparse_decode, slot_view
from tests.test_vllm_selection import BLOCK, HKV, HQ, D, PagedCache


def test_the_first_freed_blocks_hold_the_cache_where_enough_are_freed():
    assert split_unread(range(3, 20), 4) == (range(3, 7), range(7, 20))
    assert split_unread(range(3, 6), 4) == (range(0), range(3, 6)), "too few freed: no tier for the request"
    assert split_unread(range(3, 20), 0) == (range(0), range(3, 20))


def test_regions_go_to_requests_until_they_leave_the_runner():
    regions = Regions(2, num_blocks=10, device="cpu")
    assert regions.claim("a", {"a"}) == 0 and regions.claim("b", {"a", "b"}) == 1
    assert regions.claim("c", {"a", "b", "c"}) is None, "both held by requests still running"
    assert regions.claim("a", {"a", "b", "c"}) == 0, "a request ranked again (a recompute) keeps its region"
    assert regions.claim("c", {"b", "c"}) == 0, "a's request finished: its region is free"
    regions.assign(torch.tensor([7]), 0)
    regions.assign(torch.tensor([3]), None)
    table = torch.tensor([[7, 1], [3, 2], [0, 0]], dtype=torch.int32)  # the last: a padded row (the null block)
    assert regions.rows(table).tolist() == [0, 2, 2], "no region: the spare (2)"


def test_a_forwards_first_sparse_layer_plans_the_regions_for_the_rest():
    """`Regions.plan`: the rows and the clock's tick once a forward, made anew by the layer that
    made them when a forward reuses its metadata (as CUDA graph capture does)."""
    regions = Regions(2, num_blocks=10, device="cpu")
    regions.assign(torch.tensor([7]), 1)
    table, step, first, later = torch.tensor([[7, 1], [3, 2]], dtype=torch.int32), {}, object(), object()
    rows, clock = regions.plan(table, step, first)
    assert rows.tolist() == [1, 2] and clock.tolist() == [1]
    regions.assign(torch.tensor([3]), 0)  # (a change no later layer of this forward would see)
    assert regions.plan(table, step, later)[0] is rows and regions.clock.tolist() == [1], "found, not made again"
    assert regions.plan(table, step, first)[0].tolist() == [1, 0] and regions.clock.tolist() == [2], "made anew"
    assert regions.plan(table, {}, later)[1].tolist() == [3], "a new forward's first layer: a tick"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"selector": "h2o", "host_tier": {}}, "needs free_blocks"),
        ({"selector": "streaming_llm", "free_blocks": True, "host_tier": {}}, "needs free_blocks and one of"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"regions": 0}}, "regions must be an int >= 1"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"pages": 8, "cache_pages": 4}}, "cache_pages"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"page": 8}}, "page"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": 4}, "must be a dict"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"summary": "pq"}}, "summary is one of bounds, int4"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"regions": 2, "gib": 8}}, "regions or gib, not both"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"gib": 0}}, "gib must be a number > 0"),
        ({"selector": "h2o", "free_blocks": True, "host_tier": {"gib": "8G"}}, "gib must be a number > 0"),
    ],
)
def test_bad_host_tiers_are_one_line_errors(settings, message):
    with pytest.raises(InputError, match=message):
        PluginConfig(**settings)


def test_a_host_tier_beside_a_compacting_selector_is_taken():
    config = PluginConfig(selector="snapkv", free_blocks=True, host_tier={"regions": 3, "pages": 2, "cache_pages": 4})
    assert config.tier == HostTier(regions=3, pages=2, cache_pages=4)
    assert config.tier.region_count() == 3 and HostTier().region_count() == 2


def test_a_host_tier_in_gib_makes_as_many_regions_as_its_pinned_bytes_hold():
    """`region_nbytes` is what `ParkedPrompts` pins for a region in a layer (whole pages), so `gib`
    over the sparse layers' sum gives the regions that fit, and one that fits none is refused."""
    tokens, layers = 1000, 3  # 1000 tokens: 63 pages of 16
    one = region_nbytes(tokens, HKV, D, BLOCK, torch.bfloat16)
    assert one == 2 * HKV * 63 * BLOCK * D * 2
    parked = ParkedPrompts(HostTier(), 5, tokens, HKV, D, BLOCK, torch.bfloat16, torch.device("cpu"))
    assert parked.host_nbytes == 5 * one
    gib = 4.5 * layers * one / 2**30
    assert HostTier(gib=gib).region_count(layers * one) == 4
    with pytest.raises(InputError, match=r"gib \(.*\) holds no region: .* takes .* GiB"):
        HostTier(gib=0.9 * layers * one / 2**30).region_count(layers * one)


@pytest.mark.parametrize("choice", ["reference", "triton"])
def test_the_paged_page_copy_writes_the_needed_pages_into_one_head_of_their_blocks(choice, monkeypatch):
    """Keys and values, each page into its head of its block in vLLM's cache (keys then values per
    head, two views of one tensor), nothing else written."""
    monkeypatch.setenv("ATSKV_KERNELS", choice)
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 3, HKV, 6 * BLOCK, D, generator=g)  # 3 regions of 6 pages
    kv = torch.full((12, BLOCK, HKV, 2 * D), 100.0)
    rows = torch.tensor([2, 0, 3])  # the last: a row without a region (past the source), nothing needed
    pages = torch.randint(0, 6, (3, HKV, 2), generator=g)
    blocks = torch.randperm(12, generator=g)[: 3 * HKV * 2].view(3, HKV, 2)
    need = torch.rand(3, HKV, 2, generator=g) < 0.6
    need[2] = False
    device = "cuda" if choice == "triton" and torch.cuda.is_available() else "cpu"  # compiled where there is a GPU
    on = [t.to(device) for t in (keys, values, kv, rows, pages, blocks, need)]
    paged_page_copy(on[0], on[1], on[2][..., :D], on[2][..., D:], *on[3:])
    kv = on[2].cpu()
    for b, h, k in need.nonzero().tolist():
        tokens = slice(pages[b, h, k] * BLOCK, (pages[b, h, k] + 1) * BLOCK)
        assert torch.equal(kv[blocks[b, h, k], :, h, :D], keys[rows[b], h, tokens])
        assert torch.equal(kv[blocks[b, h, k], :, h, D:], values[rows[b], h, tokens])
    assert int((kv != 100).sum()) == 2 * int(need.sum()) * BLOCK * D, "nothing else written"


def parked_h2o(budget: int, tier: HostTier, lengths: list[int], regions_held: int, seed: int):
    """Requests of `lengths` in a paged cache; H2O ranks each prompt in one chunk and compacts it,
    the first `regions_held` requests with their prompt parked first (the rest find no region)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedCache(lengths, width=max(lengths) // BLOCK + 4, generator=g)
    cache.fill(chunk=64)
    key_slots, value_slots = (slot_view(c, 1)[0] for c in cache.split())
    selector = PagedH2O()
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    regions = Regions(tier.region_count(), key_slots.shape[1] // BLOCK, "cpu")
    parked = ParkedPrompts(tier, tier.region_count(), cache.block_table.shape[1] * BLOCK, HKV, D, BLOCK, torch.float32,
                           torch.device("cpu"))  # fmt: skip
    moved, parkings, freed = {}, {}, []
    for r, prompt in enumerate(lengths):
        unread = selector.unread_blocks(prompt, prompt, budget, BLOCK)
        held, gone = split_unread(unread, tier.cache_pages)
        region = regions.claim(f"r{r}", {f"r{i}" for i in range(len(lengths))}) if r < regions_held else None
        regions.assign(cache.block_table[r, :1], region)
        parking = None if region is None else Parking(region, gone.stop * BLOCK, held.start * BLOCK)

        def on_move(positions, r=r, parking=parking):
            moved[r] = positions.clone()
            if parking is not None:
                parked.mark_kept(parking.region, positions)

        queries = torch.randn(prompt, HQ, D, generator=g)
        chunk = PromptChunk(queries, key_slots, cache.block_table[r], prompt, BLOCK, D**-0.5, budget,
                            value_slots=value_slots, compact=True, on_move=on_move)  # fmt: skip
        if parking is not None:
            parked.park(parking, chunk)
            parkings[r] = parking
        selector.observe_prompt(state, chunk)
        freed += cache.block_table[r, list(gone if parking is not None else unread)].tolist()
    cache.kv_cache[torch.tensor(freed).long()] = torch.nan  # another request's now
    return g, cache, selector, state, regions, parked, moved, parkings


@pytest.mark.parametrize("pages, cache_pages, summary", [(2, 2, "bounds"), (3, 5, "bounds"), (3, 5, "int4")])
def test_decode_reads_the_kept_tokens_and_the_best_parked_pages(pages, cache_pages, summary):
    """Pages ranked by Quest's bounds of the parked keys, or by the best parked token's logit over
    the keys in int4 (dequantised here)."""
    budget, lengths = 24, [300, 260, 200]
    tier = HostTier(regions=2, pages=pages, cache_pages=cache_pages, summary=summary)
    g, cache, selector, state, regions, parked, moved, parkings = parked_h2o(budget, tier, lengths, 2, seed=3)
    assert set(parkings) == {0, 1}, "two regions: the third request reads its kept tokens alone"
    per_page = parked.parked.view(*parked.parked.shape[:2], -1, BLOCK).sum(-1)
    assert torch.equal(parked.parked_in_page, per_page.int()), "a page's count: its parked tokens, kept ones out"
    table, queries = cache.block_table, torch.randn(3, len(lengths), HQ, D, generator=g)
    queries = torch.cat([queries, queries[-1:]])  # the last step asks again: every page it wants is cached
    for step in range(4):
        seq_lens = torch.tensor([n + step + 1 for n in lengths], dtype=torch.int32)
        for r, n in enumerate(lengths):  # each step's token, written where the request writes it
            cache.keys[r] = torch.cat([cache.keys[r], torch.randn(1, HKV, D, generator=g)])
            cache.values[r] = torch.cat([cache.values[r], torch.randn(1, HKV, D, generator=g)])
            cache.write(r, n + step, n + step + 1)
        query = queries[step]
        own, own_counts = selector.pick(query, HKV, state, table, seq_lens, BLOCK, budget)
        fetched_before = int(parked.fetched)
        positions, counts = parked.extend(query, own, own_counts, *regions.plan(table, {}, None), table,
                                          *cache.split())  # fmt: skip
        for r, h in zip(*torch.where(own_counts > 0)):
            assert torch.equal(positions[r, h, : own_counts[r, h]], own[r, h, : own_counts[r, h]]), "its own first"
        out, mass = paged_sparse_decode(query, *cache.split(), positions, counts, table, D**-0.5, want_mass=True)
        selector.observe_read(state, mass[..., : own.shape[-1]], table, seq_lens, BLOCK)
        if step == 3:
            assert int(parked.fetched) == fetched_before, "a page read again comes from the cache"
        for r, n in enumerate(lengths):
            context = n + step + 1
            keys, values = cache.keys[r][:context], cache.values[r][:context]
            want_out = torch.zeros(HQ, D)
            for h in range(HKV):
                kept = own[r, h, : own_counts[r, h]].tolist()
                kept = {int(moved[r][h, p]) if p < moved[r].shape[1] else p for p in kept}  # slot j: j-th moved
                read = set(kept)
                if r in parkings:
                    stop = parkings[r].stop
                    parked_at = torch.zeros(stop, dtype=torch.bool)
                    parked_at[:] = True
                    parked_at[moved[r][h][moved[r][h] < stop]] = False
                    group = query[r, h * (HQ // HKV) : (h + 1) * (HQ // HKV)].view(1, HQ // HKV, D)
                    if summary == "bounds":
                        low, high = page_bounds(keys[:stop, h].view(1, 1, stop, D), BLOCK)
                        scores = quest_page_scores_reference(group, low, high)[0, 0]
                    else:
                        logits = (group[0] @ dequantize_int4(*quantize_int4(keys[:stop, h])).T).amax(0)
                        scores = logits.masked_fill(~parked_at, -torch.inf).view(-1, BLOCK).amax(-1)
                    scores[~parked_at.view(-1, BLOCK).any(-1)] = -torch.inf
                    for page in scores.topk(min(pages, len(scores))).indices.tolist():
                        read |= {p for p in range(page * BLOCK, (page + 1) * BLOCK) if parked_at[p]}
                    assert int(counts[r, h]) == len(read), (step, r, h)
                else:
                    assert int(counts[r, h]) == int(own_counts[r, h]), "no region: its own reads alone"
                at = torch.tensor(sorted(read))
                logits = query[r, h * (HQ // HKV) : (h + 1) * (HQ // HKV)] @ keys[at, h].T * D**-0.5
                want_out[h * (HQ // HKV) : (h + 1) * (HQ // HKV)] = logits.softmax(-1) @ values[at, h]
            torch.testing.assert_close(out[r], want_out, rtol=1e-4, atol=1e-5, msg=f"{step} {r}")


@pytest.mark.parametrize("summary", ["bounds", "int4"])
def test_the_kernels_read_what_the_reference_reads(summary, monkeypatch):
    """The same parked prompts through the Triton kernels (the page scores and pick, the cache's
    bookkeeping, the page copy; Triton's interpreter on the CPU; on a GPU compiled, from pinned
    host regions read through their device alias) and through the torch references on the CPU,
    two steps (the second hits what the first fetched): as many tokens read, the same attention,
    the same fetches."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tier = HostTier(regions=2, pages=3, cache_pages=5, summary=summary)
    g, cache, selector, state, regions, parked, moved, parkings = parked_h2o(24, tier, [300, 260, 200], 2, seed=4)
    other = ParkedPrompts(tier, 2, parked.pages * BLOCK, HKV, D, BLOCK, torch.float32, torch.device(device))
    assert other.host_keys.is_pinned() == (device == "cuda") and other.keys.device.type == device
    for name in ("host_keys", "host_values", "parked", "parked_in_page", "held", "cache_start", "slot_of", "page_in",
                 "used", "fetched"):  # fmt: skip
        getattr(other, name).copy_(getattr(parked, name))
    for mine, theirs in zip(other.summary_parts, parked.summary_parts):
        mine.copy_(theirs)
    rows, table = regions.rows(cache.block_table), cache.block_table
    caches, other_caches = cache.split(), [c.clone().to(device) for c in cache.split()]
    seq_lens, query = torch.tensor([301, 261, 201], dtype=torch.int32), torch.randn(3, HQ, D, generator=g)
    for clock in range(1, 3):
        monkeypatch.setenv("ATSKV_KERNELS", "reference")  # the CPU side (compiled Triton takes no CPU tensor)
        own, counts = selector.pick(query, HKV, state, table, seq_lens, BLOCK, 24)
        want = parked.extend(query, own, counts, rows, torch.tensor([clock]), table, *caches)
        out = paged_sparse_decode(query, *caches, *want, table, D**-0.5)
        monkeypatch.setenv("ATSKV_KERNELS", "triton")
        moved_in = [t.to(device) for t in (query, own, counts, rows, torch.tensor([clock]), table)]
        got = other.extend(*moved_in, *other_caches)
        assert torch.equal(got[1].cpu(), want[1]), "as many tokens read"
        # the GPU's page scores round otherwise, so near ties may pick other pages: compare what is read
        other_out = paged_sparse_decode(moved_in[0], *other_caches, *got, moved_in[5], D**-0.5)
        torch.testing.assert_close(other_out.cpu(), out, rtol=1e-4, atol=1e-5)
        assert int(other.fetched) == int(parked.fetched) > 0
