"""`free_blocks` on vLLM's own scheduler-side objects, without a GPU (vLLM needed; skipped where it
is not installed): the registered spec finds its manager, the manager frees exactly the blocks
StreamingLLM (or H2O's and the learned selector's compacted lists) will not read, once the prompt
is in, and a finished request gives all back; dense
layers beside freeing ones are grouped apart by vLLM's own grouping and keep their blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinatorNoPrefixCache  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

from atskv.runtime.vllm.composition import freeing_rule  # noqa: E402
from atskv.runtime.vllm.freeing import KeptBlocksSpec, UnreadBlocksManager, UnreadBlocksSpec  # noqa: E402

BLOCK = 16


def spec(budget=64, sinks=4) -> UnreadBlocksSpec:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return UnreadBlocksSpec.of(full, "streaming_llm", budget, {"sinks": sinks})


def test_the_spec_is_registered_beside_vllms_own():
    assert KVCacheSpecRegistry.get_manager_class(spec()) is UnreadBlocksManager
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert KVCacheSpecRegistry.get_manager_class(full) is not UnreadBlocksManager  # vLLM's own still found
    assert UnreadBlocksSpec.merge([spec(), spec()]) == spec()
    assert spec().page_size_bytes == full.page_size_bytes
    with pytest.raises(ValueError, match="different rules"):
        UnreadBlocksSpec.merge([spec(64), spec(32)])


@pytest.mark.parametrize("selector, options, most", [
    ("streaming_llm", {"sinks": 4}, 7),
    # 2 blocks of moved tokens, the window's and the prompt's tail's, and every generated token's (those
    # a list evicts later stay in their blocks: at 200 generated, 22 live of the 107)
    ("h2o", {}, 22),
    ("learned", {"predictor": "/not/loaded/by/the/scheduler"}, 22),  # no window: 4 blocks of moved tokens
    ("snapkv", {}, 24),  # its 64 best (4 blocks), its window of up to 32 before the prompt's tail
    ("h2o+sparq", {"residency_budget": 128}, 26),  # the residents' rule at their budget: 4 blocks moved
    ("learned+sparq", {"learned": {"predictor": "/not/loaded"}}, 34),  # 4 x 64 residents, no window
])  # fmt: skip
def test_the_manager_frees_what_the_selector_will_not_read(selector, options, most):
    pool = BlockPool(400, enable_caching=False, hash_block_size=BLOCK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    manager = UnreadBlocksManager(UnreadBlocksSpec.of(full, selector, 64, options), block_pool=pool,
                                  enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK)  # fmt: skip
    idle = pool.get_num_free_blocks()
    prompt = 1500
    manager.allocate_new_blocks("r", prompt, prompt)
    manager.remove_skipped_blocks("r", 1000, prompt)  # mid-prefill: the prompt's blocks all stay
    assert idle - pool.get_num_free_blocks() == 94
    unread_blocks = freeing_rule(selector, options)
    for processed in range(prompt, prompt + 200):  # as the scheduler runs it: free, then one more slot
        manager.remove_skipped_blocks("r", processed, prompt)
        blocks = manager.req_to_blocks["r"]
        live = {i for i, block in enumerate(blocks) if not block.is_null}
        assert live == set(range(len(blocks))) - set(unread_blocks(processed, prompt, 64, BLOCK))
        assert idle - pool.get_num_free_blocks() == len(live) <= most
        manager.allocate_new_blocks("r", processed + 1, processed + 1)
    manager.free("r")
    assert pool.get_num_free_blocks() == idle


def model_specs(dense: int, layers: int = 32) -> dict:
    """What `AtskvWorker` declares for a Llama-shaped model with `dense` dense layers first."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": KeptBlocksSpec.of(full) if i < dense else spec() for i in range(layers)}


def grouped(specs: dict) -> list:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    return get_kv_cache_groups(config, dict(specs))


def test_dense_layers_beside_freeing_ones_get_groups_of_their_own():
    groups = grouped(model_specs(dense=2))
    kinds = [type(g.kv_cache_spec) for g in groups]
    assert kinds == [KeptBlocksSpec] + [UnreadBlocksSpec] * 15 and {len(g.layer_names) for g in groups} == {2}
    assert groups[0].layer_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert [KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec) for g in groups[:2]] == [
        FullAttentionManager, UnreadBlocksManager]  # fmt: skip
    assert [type(g.kv_cache_spec) for g in grouped(model_specs(dense=0))] == [UnreadBlocksSpec]  # one group
    with pytest.raises(AssertionError):  # vLLM's uniformity check: the first layer's merge tells them apart
        KeptBlocksSpec.merge(list(model_specs(dense=2).values()))


def block_coordinator(num_blocks: int) -> KVCacheCoordinatorNoPrefixCache:
    """vLLM's own block coordinator over `num_blocks`, for 2 dense layers beside 30 freeing ones."""
    return KVCacheCoordinatorNoPrefixCache(
        KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=grouped(model_specs(dense=2))),
        max_model_len=4096, max_in_flight_tokens=4096, use_eagle=False, enable_kv_cache_events=False,
        dcp_world_size=1, pcp_world_size=1, scheduler_block_size=BLOCK, hash_block_size=BLOCK)  # fmt: skip


def test_with_dense_layers_a_request_holds_their_blocks_and_few_of_the_rest():
    coordinator = block_coordinator(3000)
    pool = coordinator.block_pool
    idle = pool.get_num_free_blocks()
    prompt = 1500
    coordinator.allocate_new_blocks("r", prompt, prompt)
    assert idle - pool.get_num_free_blocks() == 16 * 94  # every group holds the prompt until it is in
    coordinator.remove_skipped_blocks("r", prompt, prompt)
    held = [sum(not b.is_null for b in blocks) for blocks in coordinator.get_blocks("r")]
    assert held[0] == 94 and all(0 < n <= 6 for n in held[1:]), held
    assert idle - pool.get_num_free_blocks() == sum(held)
    coordinator.free("r")
    assert pool.get_num_free_blocks() == idle


def test_the_traces_request_shares_count_a_requests_blocks_before_and_after_they_are_freed():
    from atskv.eval.vllm_trace import request_shares

    coordinator = block_coordinator(3001)  # 3000 and vLLM's null block
    prompt = 1500
    request = SimpleNamespace(request_id="r", num_prompt_tokens=prompt, num_computed_tokens=prompt)
    scheduler = SimpleNamespace(running=[request], kv_cache_manager=SimpleNamespace(
        coordinator=coordinator, block_pool=coordinator.block_pool))  # fmt: skip
    coordinator.allocate_new_blocks("r", prompt, prompt)
    assert request_shares(scheduler) == (16 * 94 / 3000, 0.0)  # its last chunk in: every block still held
    coordinator.remove_skipped_blocks("r", prompt, prompt)
    request.num_computed_tokens = prompt + 1
    held = sum(sum(not b.is_null for b in blocks) for blocks in coordinator.get_blocks("r"))
    assert held < 94 + 15 * 7 and request_shares(scheduler) == (0.0, held / 3000)
    # a shorter request past its prompt, its blocks not yet freed: the longest one's share is told
    short = SimpleNamespace(request_id="s", num_prompt_tokens=400, num_computed_tokens=401)
    coordinator.allocate_new_blocks("s", 401, 401)
    scheduler.running.append(short)
    assert 16 * 26 > held and request_shares(scheduler) == (0.0, held / 3000)
