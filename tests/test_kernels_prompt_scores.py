"""The learned selector's prompt ranking in the plugin (`atskv.kernels.prompt_scores`): the
reference against the predictor's own scoring of `feature_columns`, and the Triton kernel
(Triton's interpreter on the CPU) against the reference: with and without the attention received
and the previous layer's, keys strided as a gather through the block table leaves them, lengths
below, at and across the kernel's blocks."""

from __future__ import annotations

import pytest
import torch

from atskv.features import feature_columns
from atskv.kernels.listed_refresh import fold_mlp
from atskv.kernels.prompt_scores import paged_prompt_scores, prompt_scores_reference, prompt_scores_triton

HKV = 3  # the KV heads of `engine_mlp` (the SmolLM2 shape)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(length: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, HKV, dim, generator=g).transpose(0, 1)  # [Hkv, L, D], not contiguous
    attention = torch.rand(HKV, length, generator=g) / 10
    previous = torch.rand(length, generator=g) / 10
    return keys, attention, previous


@pytest.mark.parametrize("received", [True, False])
def test_the_reference_scores_a_prompt_as_the_predictor_does(engine_mlp, received):
    length, layer = 50, 1
    keys, attention, previous = inputs(length, 64, seed=0)
    got = prompt_scores_reference(attention if received else None, previous if received else None, keys,
                                  fold_mlp(engine_mlp), layer)  # fmt: skip
    zeros = torch.zeros(HKV, length)
    position = torch.arange(length).float().expand(HKV, -1)
    columns = feature_columns(attention if received else zeros, position, torch.tensor(length - 1.0), zeros,
                              keys.norm(dim=-1), previous.expand(HKV, -1) if received else zeros)  # fmt: skip
    n = HKV * length
    with torch.no_grad():
        want = engine_mlp.score(columns.new_zeros(n, 0), columns.reshape(n, -1), torch.zeros(n, dtype=torch.long),
                         torch.full((n,), layer), torch.arange(HKV).repeat_interleave(length))  # fmt: skip
    torch.testing.assert_close(got, want.float().view(HKV, length), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [1, 31, 32, 77])
@pytest.mark.parametrize("dim", [64, 48, 256])  # 256: Gemma 3's head size
@pytest.mark.parametrize("received, with_previous", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("mma", [False, True])  # fused multiply-adds, tensor cores
def test_the_kernel_scores_a_prompt_as_its_reference(engine_mlp, length, dim, received, with_previous, mma):
    keys, attention, previous = inputs(length, dim, seed=length + dim)
    folded = fold_mlp(engine_mlp.to(DEVICE))
    args = (attention.to(DEVICE) if received else None, previous.to(DEVICE) if with_previous else None,
            keys.to(DEVICE).to(torch.bfloat16))  # fmt: skip
    for layer in (0, 1):
        got = prompt_scores_triton(*args, folded, layer, block_h=16 if mma else 32, mma=mma)
        torch.testing.assert_close(got, prompt_scores_reference(*args, folded, layer), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [1, 45])
def test_paged_keys_read_through_the_block_table_score_as_the_gathered_keys(engine_mlp, length):
    """`paged_prompt_scores`: a request's keys scattered over a paged cache's shuffled blocks (vLLM's
    `[Hkv, num_slots, D]` slot view, its last block partly filled) score, through the kernel reading
    the block table and through the gathering reference, as the keys in order do."""
    block, dim = 8, 64
    keys, attention, previous = inputs(length, dim, seed=length)
    g = torch.Generator().manual_seed(length)
    blocks = -(-length // block)
    table = torch.randperm(3 * blocks, generator=g)[:blocks].to(torch.int32)
    cache = torch.randn(3 * blocks, block, HKV, dim, generator=g)  # the unused slots are noise
    position = torch.arange(length)
    cache[table[position // block].long(), position % block] = keys.transpose(0, 1)
    key_slots = cache.flatten(0, 1).transpose(0, 1)  # [Hkv, num_slots, D]
    folded = fold_mlp(engine_mlp)
    want = prompt_scores_reference(attention, previous, keys, folded, 1)
    torch.testing.assert_close(paged_prompt_scores(attention, previous, key_slots, table, block, length, folded, 1),
                               want, rtol=1e-5, atol=1e-5)  # fmt: skip
    on = fold_mlp(engine_mlp.to(DEVICE))
    got = prompt_scores_triton(attention.to(DEVICE), previous.to(DEVICE), key_slots.to(DEVICE), on, 1,
                               table=(table.to(DEVICE), block, length)).cpu()  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
