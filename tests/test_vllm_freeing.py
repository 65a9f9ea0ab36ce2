"""`free_blocks` on vLLM's own scheduler-side objects, without a GPU (vLLM needed; skipped where it
is not installed): the registered spec finds its manager, the manager frees exactly the blocks
StreamingLLM will not read, once the prompt is in, and a finished request gives all back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

from atskv.runtime.vllm.freeing import UnreadBlocksManager, UnreadBlocksSpec  # noqa: E402
from atskv.runtime.vllm.selection import PagedStreamingLLM  # noqa: E402

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


def test_the_manager_frees_what_streaming_llm_will_not_read():
    pool = BlockPool(400, enable_caching=False, hash_block_size=BLOCK)
    manager = UnreadBlocksManager(spec(), block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                  scheduler_block_size=BLOCK)  # fmt: skip
    idle = pool.get_num_free_blocks()
    prompt = 1500
    manager.allocate_new_blocks("r", prompt, prompt)
    manager.remove_skipped_blocks("r", 1000, prompt)  # mid-prefill: the prompt's blocks all stay
    assert idle - pool.get_num_free_blocks() == 94
    selector = PagedStreamingLLM(sinks=4)
    for processed in range(prompt, prompt + 200):  # as the scheduler runs it: free, then one more slot
        manager.remove_skipped_blocks("r", processed, prompt)
        blocks = manager.req_to_blocks["r"]
        live = {i for i, block in enumerate(blocks) if not block.is_null}
        assert live == set(range(len(blocks))) - set(selector.unread_blocks(processed, prompt, 64, BLOCK))
        assert idle - pool.get_num_free_blocks() == len(live) <= 7
        manager.allocate_new_blocks("r", processed + 1, processed + 1)
    manager.free("r")
    assert pool.get_num_free_blocks() == idle
