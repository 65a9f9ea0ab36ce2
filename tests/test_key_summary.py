"""The host tier's GPU key summaries (`atskv.runtime.fast.key_summary`): int4 keys' storage and page-score kernel
(Triton's interpreter on CPU) against its reference, and why int4 is there: it finds a lone strong key
that 16-token page bounds rank below a page of broad-range filler."""

from __future__ import annotations

import pytest
import torch

from atskv.kernels.int4_page_scores import (
    dequantize_int4,
    int4_page_scores_reference,
    int4_page_scores_triton,
    quantize_int4,
)  # fmt: skip
from atskv.runtime.fast.host_pages import HostPages, HostRetrieval
from atskv.runtime.fast.key_summary import KEY_SUMMARIES, Int4Keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_keys_round_trip_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(2, 3, 40, 64, generator=g) * torch.rand(2, 3, 40, 1, generator=g) * 10).to(dtype)
    keys[0, 0, 5] = 0  # an all-zero key
    codes, scale = quantize_int4(keys)
    assert codes.shape == (2, 3, 40, 32) and codes.dtype == torch.uint8 and scale.dtype == dtype
    back = dequantize_int4(codes, scale)
    assert bool(((back - keys.float()).abs() <= scale.float().unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    assert bool((back[0, 0, 5] == 0).all())
    nibbles = torch.stack((codes & 15, codes >> 4), -1).flatten(-2)
    assert int(nibbles.min()) >= 1 and int(nibbles.max()) <= 15  # codes in [-7, 7], stored + 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_packing_round_trips_keys_on_the_grid(dtype):
    """Keys that are whole multiples of a power-of-two scale, each reaching 7 steps: exactly those codes and scales,
    channel 2i in a byte's low nibble."""
    g = torch.Generator().manual_seed(1)
    steps = torch.randint(-7, 8, (3, 5, 16), generator=g)
    steps[..., 3] = 7 * (1 - 2 * torch.randint(0, 2, (3, 5), generator=g))
    grid = 2.0 ** torch.randint(-8, 4, (3, 5), generator=g)
    codes, scale = quantize_int4((steps * grid.unsqueeze(-1)).to(dtype))
    assert torch.equal(scale, grid.to(dtype))
    assert torch.equal((codes & 15).long() - 8, steps[..., 0::2])
    assert torch.equal((codes >> 4).long() - 8, steps[..., 1::2])
    assert torch.equal(dequantize_int4(codes, scale), steps * grid.unsqueeze(-1))


def test_int4_keys_refuse_an_odd_head_dim():
    with pytest.raises(ValueError, match="even head dim, got 7"):
        quantize_int4(torch.randn(1, 1, 4, 7))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("page_size", "dtype"), [(16, torch.float32), (6, torch.float32), (16, torch.float16)])
def test_the_int4_page_score_kernel_matches_its_reference(head_dim, group, page_size, dtype):
    """Strided inputs, a token count off the page grid and a page count off the kernel's block, unwritten
    slots (zero scale) included; only candidate tokens score, and a page without one scores -inf. A 16-bit
    query unpacks the codes by their bits (the interpreter has no bfloat16: float16 stands for both)."""
    g = torch.Generator().manual_seed(head_dim + group)
    b, hkv, tokens = 2, 2, 7 * page_size - 5
    codes, scale = quantize_int4(torch.randn(b, tokens, hkv, head_dim, generator=g).transpose(1, 2).to(dtype))
    scale = torch.nn.functional.pad(scale, (0, 3))[..., :tokens]  # strided: a row stride of tokens + 3
    scale[1, 0, tokens - 20 :] = 0
    query = torch.randn(b, head_dim, hkv * group, generator=g).transpose(1, 2).to(dtype)
    candidates = (torch.rand(b, hkv, tokens + 1, generator=g) < 0.7)[..., :tokens]  # strided too
    candidates[0, 0, page_size : 2 * page_size] = False  # page 1 of row 0, head 0: nothing to read back
    assert not (codes.is_contiguous() or scale.is_contiguous() or query.is_contiguous() or candidates.is_contiguous())
    want = int4_page_scores_reference(query, codes, scale, page_size, candidates)
    got = int4_page_scores_triton(query, codes, scale, page_size, candidates)
    assert got.shape == (b, hkv, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    some = torch.nn.functional.pad(candidates, (0, 5)).unflatten(-1, (7, page_size)).any(-1)
    assert torch.equal(got.isfinite(), some) and not some[0, 0, 1]  # -inf exactly where a page has none
    head = query[0, hkv * group - group :].float()  # page 0 of KV head 1: its group's queries
    logits = dequantize_int4(codes, scale)[0, 1, :page_size] @ head.T
    torch.testing.assert_close(want[0, 1, 0], logits[candidates[0, 1, :page_size]].max(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_page_score_kernel_matches_its_reference_on_the_gpu(dtype):
    """Compiled for the GPU (the test above runs Triton's interpreter): Gemma 3's head dim, a GQA group of 4."""
    g = torch.Generator().manual_seed(3)
    codes, scale = quantize_int4(torch.randn(2, 1, 1000, 256, generator=g).to(dtype).cuda())
    query = torch.randn(2, 4, 256, generator=g).to(dtype).cuda()
    candidates = torch.rand(2, 1, 1000, generator=g).cuda() < 0.5
    got = int4_page_scores_triton(query, codes, scale, 16, candidates)
    want = int4_page_scores_reference(query, codes, scale, 16, candidates)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def _ranked(summary: str, keys: torch.Tensor, query: torch.Tensor, parked: torch.Tensor | None = None) -> list[int]:
    """Pages of `keys` `[1, 1, N, D]` best first for `query` `[1, 1, D]`, by `summary`; `parked`: the
    tokens that are off the GPU (default: all)."""
    n, d = keys.shape[2:]
    pages = KEY_SUMMARIES[summary](1, 1, n // 16, 16, d, keys.dtype, keys.device)
    pages.park(0, keys, torch.ones(1, 1, n, dtype=torch.bool), n)
    parked = torch.ones(1, 1, n, dtype=torch.bool) if parked is None else parked
    return pages.page_scores(query, parked)[0, 0].argsort(descending=True).tolist()


def test_int4_finds_a_lone_strong_key_that_page_bounds_rank_below_broad_filler():
    """Page 0: small keys and one key that matches the query (q . k = 6); page 1: filler spread over
    [-2, 2] in every channel whose best token reaches only 2, but whose bound reaches 2 * |q|_1 = 16."""
    torch.manual_seed(0)
    d = 8
    query = torch.ones(1, 1, d)
    needle = 0.01 * torch.randn(16, d)
    needle[9] = 0.75
    filler = torch.cat((2 * torch.eye(d), -2 * torch.eye(d)))
    noise = 0.5 * torch.randn(16, d)
    keys = torch.cat((needle, filler, noise)).view(1, 1, 48, d)
    assert _ranked("int4", keys, query)[0] == 0
    assert _ranked("bounds", keys, query)[0] == 1
    parked = torch.ones(1, 1, 48, dtype=torch.bool)
    parked[0, 0, 9] = False  # the strong key is already on the GPU: its page has nothing better to give
    assert _ranked("int4", keys, query, parked)[0] != 0


def test_int4_keys_append_and_account_their_bytes():
    pages = HostPages(2, 2, 40, 8, torch.bfloat16, torch.device("cpu"), 4, 3, 6, summary="int4")
    assert isinstance(pages.summary, Int4Keys)
    assert pages.summary.nbytes == 2 * 2 * 40 * (8 // 2 + 2)  # D / 2 code bytes and a bf16 scale a token
    keys = torch.randn(2, 2, 40, 8).to(torch.bfloat16)
    for row in range(2):
        pages.park(row, keys[row : row + 1], keys[row : row + 1], first_position=0, count=22)
    new = torch.randn(2, 2, 1, 8).to(torch.bfloat16)
    pages.append(new, new)
    codes, scale = quantize_int4(torch.cat((keys[:, :, :22], new), 2))
    assert torch.equal(pages.summary.codes[:, :, :23], codes) and torch.equal(pages.summary.scale[:, :, :23], scale)
    assert not bool(pages.summary.scale[:, :, 23:].any())  # slots never written: zero scale, score 0


def test_an_unknown_summary_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"^summary must be one of bounds, int4, got 'int8'$"):
        HostRetrieval(summary="int8")
