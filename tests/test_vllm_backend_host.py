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

from atskv.kernels.kept_lists import list_slots  # noqa: E402
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
    impl.tier, impl.parked = impl.config.tier, None
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


@pytest.mark.gpu
@pytest.mark.parametrize("selector", [PagedH2O(), PagedStreamingLLM()])
def test_a_recomputes_reads_never_wait_for_the_gpu(selector):
    """The reads of tokens past a prompt (a prompt's tail after the chunk that ranked it, a
    recompute's outputs) run in a mixed step's eager forward, once a wave and layer: a host sync
    there stalls the CPU until the GPU drains and leaves the GPU idle while the rest of the layer's
    Python runs (a 50-token tail cost ~0.9 s a step at the 8B shape, H100). Under CUDA's sync debug
    mode any sync is an error; the reads' tensors are made once a forward (the second layer's here)."""
    budget, device = 20, torch.device("cuda")
    _, cache, prompts, state = observed(selector, budget)
    state = None if state is None else type(state)(*(t.to(device) for t in vars(state).values()))
    rows = len(prompts)
    tokens = torch.randn(rows * GENERATED, HQ, D, device=device)
    past = [(r, r * GENERATED, (r + 1) * GENERATED, prompt) for r, prompt in enumerate(prompts)]
    kv_cache, output = cache.kv_cache.to(device), torch.zeros(rows * GENERATED, HQ * D, device=device)
    impl = backend(selector, state, budget=budget)
    block_table = cache.block_table.to(device)  # the builder's tensors, on the GPU before a forward runs
    seq_lens = torch.tensor(cache.lengths, dtype=torch.int32, device=device)

    def forward(layers: int) -> None:
        metadata = SimpleNamespace(atskv_past_rows=past, block_table=block_table, seq_lens=seq_lens)
        for _ in range(layers):
            impl.read_past_prompts(tokens, kv_cache, metadata, output)

    forward(2)  # kernels compiled, pinned memory cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
        entries = list_slots(cache.block_table[r : r + 1], torch.tensor([length]), BLOCK, 20, state.spare, state.moved)
        kept = sorted(state.kept[entries[0], h].tolist())
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


def test_a_host_tier_parks_a_ranked_prompt_before_its_kept_tokens_move_and_reads_it_back():
    """The builder gives a prompt ranked in its batch a region (its request id, the runner's live
    requests) and tells its first block; the layer parks the prompt's freed part before H2O moves
    its kept tokens to the front (those then count as not parked), and a decode step reads the
    kept tokens and the best parked pages, fetched into the request's cache blocks."""
    from atskv.runtime.vllm.backend import AtskvMetadataBuilder
    from atskv.runtime.vllm.host_tier import ParkedPrompts, split_unread

    selector, budget = PagedH2O(), 20
    settings = dict(budget=budget, free_blocks=True, host_tier={"regions": 1, "pages": 2, "cache_pages": 3})
    generator = torch.Generator().manual_seed(12)
    cache = PagedCache([300, 280], width=22, generator=generator)
    cache.fill(chunk=CHUNK)
    key_slots = slot_view(cache.split()[0], 1)[0]
    state = selector.new_state(key_slots.shape[1] // BLOCK, BLOCK, HKV, D, torch.float32, "cpu")
    builder = object.__new__(AtskvMetadataBuilder)
    builder.config, builder.tier, builder.regions, builder.device = PluginConfig("h2o", **settings), None, None, "cpu"
    builder.tier, builder.unread = builder.config.tier, selector.unread_blocks
    builder.kv_cache_spec = SimpleNamespace(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    builder.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=cache.kv_cache.shape[0]))
    builder.batch = SimpleNamespace(requests=lambda: (["a", "b"], {"a", "b"}))
    rows = [(0, 0, 300, 300, True), (1, 300, 580, 280, True)]  # both prompts' last chunks, one batch
    parking = builder.parking(rows, torch.tensor([300, 280]), cache.block_table)
    assert list(parking) == [0], "one region: the first request's"
    unread = selector.unread_blocks(300, 300, budget, BLOCK)
    held, freed = split_unread(unread, 3)
    assert parking[0].stop == freed.stop * BLOCK and parking[0].cache_start == held.start * BLOCK
    regions = builder.host_regions()
    assert regions.rows(cache.block_table).tolist() == [0, 1], "the second: the spare, none"

    impl = backend(selector, state, **settings)
    impl.parked = ParkedPrompts(impl.tier, 1, 22 * BLOCK, HKV, D, BLOCK, torch.float32, torch.device("cpu"))
    before = [k.clone() for k in cache.keys]
    queries = torch.randn(580, HQ * D, generator=generator)
    metadata = SimpleNamespace(atskv_prompt_rows=rows, atskv_past_rows=[], atskv_parking=parking,
                               block_table=cache.block_table)  # fmt: skip
    impl.observe_prompts(queries, cache.kv_cache, metadata)
    stop = parking[0].stop
    assert torch.equal(impl.parked.host_keys[0, :, :stop], before[0][:stop].transpose(0, 1)), "parked unmoved"
    moved = impl.parked.parked[0, :, :stop].logical_not().sum(-1)
    window = recent_window(20, selector.recent_fraction)
    assert moved.tolist() == [20 - window] * HKV, "its moved tokens (all below the cut here) are kept, not parked"
    cache.kv_cache[cache.block_table[0, list(freed)].long()] = torch.nan  # another request's now
    query = torch.randn(2, HQ, D, generator=generator)
    seq_lens = torch.tensor([301, 281], dtype=torch.int32)
    for r, n in enumerate((300, 280)):  # the step's own token
        cache.keys[r] = torch.cat([cache.keys[r], torch.zeros(1, HKV, D)])
        cache.values[r] = torch.cat([cache.values[r], torch.zeros(1, HKV, D)])
        cache.write(r, n, n + 1)
    out = torch.zeros(2, HQ, D)
    impl.read_sparsely(query, cache.kv_cache, cache.block_table, seq_lens, {}, out, regions)
    assert not out.isnan().any() and int(impl.parked.fetched) == 2 * HKV, "two pages a KV head, fetched once"


def test_the_backend_tells_its_selector_which_kv_heads_this_gpu_holds(monkeypatch):
    """One GPU (or no parallel group yet): no shard; at tensor parallelism 2, rank 1 of a model
    of 8 KV heads holds heads 4-7, as vLLM's QKV projection splits them."""
    from atskv.runtime.vllm import backend as module

    config = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 8))
    assert module.tensor_shard(None) is None
    monkeypatch.setattr(module, "model_parallel_is_initialized", lambda: False)
    assert module.tensor_shard(config) is None
    monkeypatch.setattr(module, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1)
    assert module.tensor_shard(config) is None
    monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 1)
    assert module.tensor_shard(config) == (4, 8)


def test_a_host_tier_in_gib_buys_regions_over_this_gpus_sparse_layers(monkeypatch):
    """`gib` is shared by the layers that read sparsely (not the dense ones, nor another
    backend's): the builder and every layer get the same count from it."""
    import atskv.runtime.vllm.backend as module
    from atskv.runtime.vllm.host_tier import HostTier, region_nbytes

    def layer(index: int, sparse: bool):
        impl = object.__new__(AtskvAttentionImpl)
        impl._sparse = sparse
        return SimpleNamespace(impl=impl, layer_name=f"model.layers.{index}.self_attn.attn")

    layers = {f"layer{i}": layer(i, sparse=i >= 2) for i in range(6)} | {"other": SimpleNamespace(impl=object())}
    monkeypatch.setattr(module, "get_layers_from_vllm_config", lambda config, kind: layers)
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1000))
    one = region_nbytes(1000, HKV, D, BLOCK, torch.bfloat16)
    tier = HostTier(gib=4 * 3.5 * one / 2**30)  # 4 sparse layers, 3.5 regions' bytes each
    assert module.tier_regions(tier, config, HKV, D, BLOCK, torch.bfloat16) == 3
    assert module.tier_regions(HostTier(regions=5), None, HKV, D, BLOCK, torch.bfloat16) == 5


def test_each_sparse_layer_is_handed_its_own_and_the_later_sparse_layers_states(monkeypatch):
    """`later_states`, for a selector that reads every layer's state at a forward's first sparse
    layer: those of this engine's sparse layers from this one on, in layer order (not the dense
    layers', nor another backend's), and None while any is not made yet or outside an engine."""
    import atskv.runtime.vllm.backend as module

    def layer(index: int, sparse: bool):
        impl = object.__new__(AtskvAttentionImpl)
        impl._sparse, impl._later, impl.vllm_config = sparse, None, object()
        impl.selector, impl.state = SimpleNamespace(layer=index), f"state {index}"
        return f"model.layers.{index}.self_attn.attn", SimpleNamespace(impl=impl)

    layers = dict(layer(i, sparse=i >= 2) for i in (5, 0, 3, 1, 2, 4)) | {"other": SimpleNamespace(impl=object())}
    monkeypatch.setattr(module, "get_layers_from_vllm_config", lambda config, kind: layers)
    impl = {int(name.split(".")[2]): entry.impl for name, entry in layers.items() if name != "other"}
    assert impl[2].later_states() == ["state 2", "state 3", "state 4", "state 5"]
    assert impl[4].later_states() == ["state 4", "state 5"]
    impl[5].state = None
    assert impl[2].later_states() is None and impl[4].later_states() is None
    impl[5].state = "state 5, made"
    assert impl[3].later_states() == ["state 3", "state 4", "state 5, made"]
    impl[3].vllm_config = None
    impl[3]._later = None
    assert impl[3].later_states() is None
