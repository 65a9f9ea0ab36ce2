"""Sparse decode attention: the torch reference against masked attention over the expanded cache,
the Triton kernel (Triton's interpreter on CPU) against the reference."""

import math
from functools import partial

import pytest
import torch

from atskv.kernels import sparse_decode
from atskv.kernels.sparse_decode import (
    choose_split_size,
    sparse_decode_attention,
    sparse_decode_attention_reference,
    sparse_decode_attention_triton,
)


def masked_attention(query, keys, values, indices, lengths, scaling):
    """Float64 attention of every query head over the whole cache, expanded to the query heads, with a
    boolean mask built from each KV head's index set; rows with an empty set give zeros."""
    b, hq, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    keep = torch.zeros(b, hkv, s, dtype=torch.bool)
    for row in range(b):
        for head in range(hkv):
            keep[row, head, indices[row, head, : lengths[row, head]].long()] = True
    group = hq // hkv
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    mask = keep.repeat_interleave(group, 1)
    logits = torch.einsum("bhd,bhsd->bhs", query.double(), k) * scaling
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhs,bhsd->bhd", probs, v)


def make_inputs(b, hkv, group, d, s, k, dtype=torch.float32, seed=0, spare=0, device="cpu"):
    """Random decode inputs; keys/values are views of a buffer `spare` slots longer than `s` (as the
    slot cache passes them) and the query a strided view, so strides are exercised. Index sets are
    distinct per (row, KV head); lengths are ragged and include 0 and K."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hkv * group, 2, d, generator=g).to(device, dtype)[:, :, 1]
    keys = torch.randn(b, hkv, s + spare, d, generator=g).to(device, dtype)[:, :, :s]
    values = torch.randn(b, hkv, s + spare, d, generator=g).to(device, dtype)[:, :, :s]
    indices = torch.rand(b, hkv, s, generator=g).argsort(-1)[..., :k]
    lengths = torch.randint(0, k + 1, (b, hkv), generator=g)
    lengths.view(-1)[0] = 0
    lengths.view(-1)[-1] = k
    return query, keys, values, indices.to(device), lengths.to(device)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("d", [64, 256])
def test_reference_matches_masked_attention(b, group, d):
    query, keys, values, indices, lengths = make_inputs(b, 2, group, d, s=90, k=37, seed=b * 10 + group)
    expected = masked_attention(query, keys, values, indices, lengths, 0.3)
    for index_dtype in (torch.int64, torch.int32):
        out = sparse_decode_attention_reference(query, keys, values, indices.to(index_dtype), lengths, 0.3)
        assert out.dtype == query.dtype and out.shape == query.shape
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert (out.view(b, 2, group, d)[lengths == 0] == 0).all()


def test_reference_defaults_to_all_indices_and_inverse_sqrt_scale():
    query, keys, values, indices, _ = make_inputs(2, 2, 2, 64, s=50, k=20, seed=5)
    full = torch.full((2, 2), 20)
    expected = masked_attention(query, keys, values, indices, full, 64**-0.5)
    out = sparse_decode_attention(query, keys, values, indices)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("group", "d", "split_size"), [(1, 64, None), (3, 64, 64), (4, 128, 50), (4, 256, 32)])
def test_triton_matches_reference_fp32(monkeypatch, group, d, split_size):
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    query, keys, values, indices, lengths = make_inputs(2, 2, group, d, s=300, k=150, seed=group + d, spare=17)
    expected = sparse_decode_attention_reference(query, keys, values, indices, lengths, 0.2)
    if split_size is None:  # the public entry point dispatches to the kernel
        out = sparse_decode_attention(query, keys, values, indices.int(), lengths, 0.2)
    else:  # several splits, some of them past a row's length (empty): the merge kernel runs
        assert math.ceil(150 / split_size) > 2
        out = sparse_decode_attention_triton(query, keys, values, indices, lengths, 0.2, split_size=split_size)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out.view(2, 2, group, d)[lengths == 0] == 0).all()


def test_triton_without_lengths_matches_reference(monkeypatch):
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    query, keys, values, indices, _ = make_inputs(1, 3, 3, 64, s=200, k=130, seed=3)
    expected = sparse_decode_attention_reference(query, keys, values, indices)
    torch.testing.assert_close(sparse_decode_attention(query, keys, values, indices), expected, rtol=1e-5, atol=1e-5)
    out = sparse_decode_attention_triton(query, keys, values, indices, split_size=64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_empty_index_lists_give_zeros():
    query, keys, values, indices, _ = make_inputs(2, 2, 2, 64, s=30, k=0)
    assert (sparse_decode_attention_reference(query, keys, values, indices) == 0).all()
    assert (sparse_decode_attention_triton(query, keys, values, indices) == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_within_tolerance(dtype):
    query, keys, values, indices, lengths = make_inputs(2, 2, 4, 128, s=256, k=100, dtype=dtype, seed=7, spare=5)
    expected = sparse_decode_attention_reference(query, keys, values, indices, lengths)
    out = sparse_decode_attention_triton(query, keys, values, indices, lengths, split_size=64)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def counted_and_mass(query, keys, indices, lengths, held, scaling):
    """Which index positions count (within the length, slot held) and the mass each should get:
    float64 softmax over them, summed over the group's query heads."""
    b, hkv = keys.shape[:2]
    counted = (torch.arange(indices.shape[-1]) < lengths.unsqueeze(-1)) & (held.gather(2, indices.long()) >= 0)
    picked = keys.double().gather(2, indices.long().unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    logits = torch.einsum("bhgd,bhkd->bhgk", query.double().view(b, hkv, -1, query.shape[-1]), picked) * scaling
    probs = logits.masked_fill(~counted.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0)
    return counted, probs.sum(2)


@pytest.mark.parametrize("split_size", [None, 64])
def test_held_slots_and_mass_match_reference(monkeypatch, split_size):
    """`held` skips free slots (an identity list over a buffer with holes, as an evicting layer
    attends), and `want_mass` gives each index's probability summed over the group: the reference
    against float64, the kernel (one split and several, one tile wholly free) against the reference."""
    query, keys, values, indices, lengths = make_inputs(2, 2, 4, 64, s=260, k=200, seed=11, spare=3)
    g = torch.Generator().manual_seed(1)
    held = torch.arange(260).expand(2, 2, 260).clone().masked_fill(torch.rand(2, 2, 260, generator=g) < 0.3, -1)
    held[0, 1, indices[0, 1, :64]] = -1  # the first tile of a full-length row wholly free
    counted, expected_mass = counted_and_mass(query, keys, indices, lengths, held, 0.25)
    assert lengths[0, 1] > 64 and counted.any(-1).view(-1)[1:].all()
    compact = torch.stack([torch.cat([i[c], i[~c]]) for i, c in zip(indices.view(4, -1), counted.view(4, -1))])
    expected = masked_attention(query, keys, values, compact.view(indices.shape), counted.sum(-1), 0.25)
    out, mass = sparse_decode_attention_reference(query, keys, values, indices, lengths, 0.25, held=held,
                                                  want_mass=True)  # fmt: skip
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.double(), expected_mass, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    out_k, mass_k = sparse_decode_attention(query, keys, values, indices, lengths, 0.25, held=held, want_mass=True) \
        if split_size is None else sparse_decode_attention_triton(query, keys, values, indices, lengths, 0.25,
                                                                  held=held, want_mass=True, split_size=split_size)
    torch.testing.assert_close(out_k, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass_k, mass, rtol=1e-5, atol=1e-6)
    assert (mass_k[~counted] == 0).all() and (out_k.view(2, 2, 4, 64)[~counted.any(-1)] == 0).all()


@pytest.mark.parametrize("split_size", [None, 64])
def test_mass_added_in_place_at_the_slots(split_size):
    """`add_mass_to` adds each counted index's mass to its slot of a per-slot accumulator (a strided
    view, as a selector's state is), bit for bit what adding the returned mass by slot gives;
    nothing else changes, and the output is the same."""
    query, keys, values, indices, lengths = make_inputs(2, 2, 4, 64, s=260, k=200, seed=12, spare=3)
    g = torch.Generator().manual_seed(3)
    held = torch.arange(260).expand(2, 2, 260).clone().masked_fill(torch.rand(2, 2, 260, generator=g) < 0.3, -1)
    start = torch.rand(2, 2, 260, generator=g)
    counted = torch.arange(200) < lengths.unsqueeze(-1)
    for call in (sparse_decode_attention_reference, partial(sparse_decode_attention_triton, split_size=split_size)):
        out, mass = call(query, keys, values, indices, lengths, 0.25, held=held, want_mass=True)
        expected = start.clone().scatter_add_(2, indices, mass.masked_fill(~counted, 0.0))
        accumulator = torch.zeros(2, 2, 260, 3)[..., 1]
        accumulator.copy_(start)
        out_added = call(query, keys, values, indices, lengths, 0.25, held=held, add_mass_to=accumulator)
        assert torch.equal(accumulator, expected) and torch.equal(out_added, out)
        assert not torch.equal(accumulator, start)
    with pytest.raises(ValueError, match="add_mass_to"):
        sparse_decode_attention(query, keys, values, indices, lengths, held=held, want_mass=True,
                                add_mass_to=accumulator)  # fmt: skip


def test_split_size_heuristic(monkeypatch):
    monkeypatch.setattr(sparse_decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)

    def splits(k, programs, d=128, device=cuda):
        return math.ceil(k / choose_split_size(k, programs, d, device))

    tile = sparse_decode._block_n(128)
    assert splits(tile, 8) == 1  # short list: one split
    assert splits(1638, 8 * 64) == 1  # the batch fills the GPU already
    # a list of a few tiles, one program: shares of MIN_SPLIT_TILES tiles
    assert splits(4 * tile, 1) == 4 // sparse_decode.MIN_SPLIT_TILES
    # long list, few programs: about WAVES programs per SM, in whole tiles
    assert sparse_decode.WAVES * 132 / 8 / 2 < splits(1638, 8) <= sparse_decode.WAVES * 132 / 8
    assert 1 < splits(1638, 128) <= math.ceil(sparse_decode.WAVES * 132 / 128)
    assert splits(200_000, 1) == sparse_decode.MAX_SPLITS
    for d in (64, 128, 256):  # whole tiles
        assert choose_split_size(1638, 8, d, cuda) % sparse_decode._block_n(d) == 0
    assert splits(100_000, 1, device=torch.device("cpu")) == 1  # the interpreter: one split


def test_rejects_bad_shapes():
    query, keys, values, indices, lengths = make_inputs(1, 2, 2, 64, s=40, k=10)
    with pytest.raises(ValueError, match="power of two"):
        sparse_decode_attention(query[..., :48], keys[..., :48], values[..., :48], indices)
    with pytest.raises(TypeError, match="dtype"):
        sparse_decode_attention(query, keys.half(), values.half(), indices)
    with pytest.raises(ValueError, match="indices"):
        sparse_decode_attention(query, keys, values, indices.float())
    with pytest.raises(ValueError, match="Hq % Hkv"):
        sparse_decode_attention(query[:, :3], keys, values, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4])
def test_triton_on_gpu_at_realistic_sizes(b):
    inputs = make_inputs(b, 8, 4, 128, s=32768, k=1638, dtype=torch.bfloat16, seed=b, spare=64, device="cuda")
    expected = sparse_decode_attention_reference(*inputs).float()
    out = sparse_decode_attention(*inputs)  # the heuristic: several splits at these sizes
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=5e-3)
    single = sparse_decode_attention_triton(*inputs, split_size=1638)
    torch.testing.assert_close(single.float(), expected, rtol=1e-2, atol=5e-3)
