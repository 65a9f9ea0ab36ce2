"""vLLM's FlashAttention 3 as the plugin's sparse read (`decode_kernel: flash`) gives what atskv's
sparse decode kernel gives on the same picked tokens, per KV head, over a random paged cache in
vLLM's layout (GPU with FlashAttention 3 and vLLM needed; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs a Hopper GPU (FlashAttention 3)")]  # fmt: skip

from atskv.runtime.vllm.flash_read import flash_sparse_decode  # noqa: E402
from atskv.runtime.vllm.selection import paged_sparse_decode  # noqa: E402


@pytest.mark.parametrize("batch, hq, hkv, picked, splits", [(3, 32, 8, 300, 0), (2, 16, 2, 1000, 32), (5, 8, 8, 17, 4)])
def test_flash_read_equals_atskvs_kernel_on_the_same_picks(batch, hq, hkv, picked, splits):
    generator = torch.Generator(device="cuda").manual_seed(batch)
    block, d, width = 16, 128, 96
    blocks = batch * width + 5
    kv_cache = torch.randn(blocks, block, hkv, 2 * d, device="cuda", dtype=torch.bfloat16, generator=generator)
    key_cache, value_cache = kv_cache.split(d, dim=-1)  # vLLM's NHD layout: K and V side by side
    table = torch.randperm(blocks, device="cuda", generator=generator)[: batch * width].view(batch, width).int()
    seq_lens = torch.randint(picked, width * block, (batch,), device="cuda", generator=generator)
    # each (request, KV head) its own distinct positions; some heads count fewer than the list holds
    scores = torch.rand(batch, hkv, width * block, device="cuda", generator=generator)
    scores = scores.masked_fill(torch.arange(width * block, device="cuda") >= seq_lens.view(-1, 1, 1), -1.0)
    positions = scores.topk(picked, dim=-1).indices.int()
    lengths = torch.randint(1, picked + 1, (batch, hkv), device="cuda", generator=generator).int()
    lengths[0] = picked
    query = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=generator)

    want = paged_sparse_decode(query, key_cache, value_cache, positions, lengths, table, d**-0.5)
    out = torch.full_like(query, torch.nan)
    got = flash_sparse_decode(query, key_cache, value_cache, positions, lengths, table, d**-0.5, out, {}, splits)
    assert got is out
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # and it reads only the picks: a change past a head's count changes nothing
    key_cache.zero_()  # every key equal: uniform attention over exactly what is read
    got = flash_sparse_decode(query, key_cache, value_cache, positions, lengths, table, d**-0.5, out, {}, splits)
    want = paged_sparse_decode(query, key_cache, value_cache, positions, lengths, table, d**-0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
