"""SparQ's fused decode step (`atskv.kernels.sparq_decode`): the Triton kernels (Triton's interpreter
on CPU) against the torch reference, the reference against the selector's ranking, and the fast
path through the kernels against the reference session."""

from __future__ import annotations

import pytest
import torch

import atskv
import atskv.runtime.fast.graph as fast_graph
from atskv.kernels.partial_scores import partial_scores
from atskv.kernels.sparq_decode import (
    pooled_probs,
    sparq_decode,
    sparq_decode_reference,
    sparq_decode_triton,
    sparq_probs,
)
from atskv.selectors.base import select_top_budget
from tests.conftest import left_padded, tiny_model
from tests.test_decode import _no_host_reads, _reference

RANK = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, Triton's interpreter on CPU
# small blocks and candidate steps: every loop of the kernels runs several times
SMALL = dict(block_s=16, parts=3, probs_block=64, window=8, collect_block=64, block_c=16, radix=2)


def static_layer(b=2, hkv=2, group=3, slots=300, d=16, dtype=torch.float32, seed=0):
    """A static cache after some decode steps: free slots past the end and, in one row, scattered
    (evicted) ones; `keys_t` is the channel-major copy, stale at the slot just written."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, slots, d, generator=g).to(dtype)
    slot_pos = torch.arange(slots).expand(b, hkv, slots).clone()
    slot_pos[:, :, 280:] = -1
    slot_pos[1, 0, torch.randperm(280, generator=g)[:60]] = -1
    write_slot = torch.tensor([[279, 100], [5, 279]])
    keys_t = keys.transpose(2, 3).contiguous()
    keys_t[0, 0, :, 279] = 0.0  # the decode token's column is not written yet
    query = torch.randn(b, hkv * group, d, generator=g).to(dtype)
    context = torch.tensor([280, 280])
    moved = (t.to(DEVICE) for t in (query, keys, keys_t, slot_pos, write_slot, context))
    return *moved, d**-0.5


def chosen(indices, lengths):
    """The counted slots of every row, as sets."""
    return [[set(row[: int(n)].tolist()) for row, n in zip(ri, li)] for ri, li in zip(indices, lengths)]


def both(args, budget, k, rank=RANK, recent=0, **knobs):
    """Reference and kernel on their own copies of the arguments (the step writes `keys_t`)."""
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    tri_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref = sparq_decode_reference(*ref_args, rank, budget, k, recent=recent)
    tri = sparq_decode_triton(*tri_args, rank, budget, k, recent=recent, **knobs)
    return ref, tri, ref_args, tri_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("budget,k", [(40, 64), (0.1, 28), (500, 300)])
@pytest.mark.parametrize("knobs", [SMALL, {}])
def test_kernel_matches_reference_and_writes_the_new_key(dtype, group, budget, k, knobs):
    args = static_layer(group=group, dtype=dtype)
    (ref_idx, ref_len), (tri_idx, tri_len), ref_args, tri_args = both(args, budget, k, **knobs)
    assert tri_idx.shape == (2, 2, k) and tri_idx.dtype == ref_idx.dtype == torch.int32
    assert torch.equal(tri_len, ref_len)
    assert chosen(tri_idx, tri_len) == chosen(ref_idx, ref_len)
    assert int(tri_idx.min()) >= 0 and int(tri_idx.max()) < 300  # the filler too
    keys, slot_pos = args[1], args[3]
    for i in range(2):  # counted slots are distinct and held
        for h in range(2):
            counted = tri_idx[i, h, : int(tri_len[i, h])].long()
            assert len(set(counted.tolist())) == len(counted) and bool((slot_pos[i, h, counted] >= 0).all())
    kept = {40: 40, 0.1: 28, 500: 500}[budget]  # 10% of the 280 tokens seen; 500: more than any row holds
    assert torch.equal(ref_len.long(), (slot_pos >= 0).sum(-1).clamp(max=kept))
    for copy in (ref_args[2], tri_args[2]):  # the written token's column, and nothing else changed
        assert torch.equal(copy, keys.transpose(2, 3))


def test_kernel_matches_reference_at_the_llama_8b_head_shape():
    """Head dim 128, r = 16, groups of 4, bf16: the channel ranking runs over several steps."""
    args = static_layer(group=4, d=128, slots=600, dtype=torch.bfloat16, seed=1)
    args[3][:, :, 280:] = torch.arange(280, 600)  # held up to the end
    ref, tri, ref_args, tri_args = both(args, 0.05, 40, rank=16, block_s=64)
    assert chosen(*tri) == chosen(*ref) and tri[1].tolist() == [[14, 14], [14, 14]]
    assert torch.equal(tri_args[2], ref_args[2])


def test_equal_query_magnitudes_choose_the_lower_channels():
    """Query channels of equal |q| across the rank cut: both take the lower channels first (the
    other choice changes the approximate logits, hence the slots)."""
    args = static_layer(group=1, d=32, dtype=torch.float32, seed=3)
    query = args[0]
    query.mul_(0.01)
    query[..., 8:32:3] = torch.tensor([2.0, -2.0] * 4)[: len(range(8, 32, 3))]  # 8 tied channels for RANK = 4
    ref, tri, _, _ = both(args, 40, 64)
    assert chosen(*tri) == chosen(*ref)  # with the higher channels first the slots differ (checked)


@pytest.mark.parametrize("knobs", [SMALL, {}])
@pytest.mark.parametrize("group", [1, 4])
def test_fixed_channels_match_sparcas_scores(group, knobs):
    """SparCas's pick (`channels=`): a compact copy `[B, Hkv, S, R]` read channel-major through its
    strides, the channels fixed per KV head, no temperature correction. Kernel and reference keep
    the same slots, the top budget of the pooled probabilities as `SparCasSelector.scores` has them."""
    query, keys, _, slot_pos, write_slot, context, scaling = static_layer(group=group)
    g = torch.Generator().manual_seed(5)
    channels = torch.stack([torch.randperm(16, generator=g)[:RANK].sort().values for _ in range(4)])
    channels = channels.view(2, 2, RANK).to(DEVICE)
    compact = keys.gather(-1, channels.unsqueeze(2).expand(-1, -1, keys.shape[2], -1))  # [B, Hkv, S, R]
    args = (query, keys, compact.transpose(2, 3), slot_pos, write_slot, context, scaling)
    want = sparq_decode_reference(*args, RANK, 40, 64, channels=channels)
    got = sparq_decode_triton(*args, RANK, 40, 64, channels=channels, **knobs)
    assert torch.equal(got[1], want[1]) and chosen(*got) == chosen(*want)
    dims = channels.repeat_interleave(group, dim=1).unsqueeze(2)
    probs = pooled_probs(partial_scores(query.unsqueeze(2), compact, dims, compact=True) * scaling,
                         (slot_pos >= 0).unsqueeze(2))[:, :, 0]  # fmt: skip
    for b in range(2):
        for h in range(2):
            best = probs[b, h].masked_fill(slot_pos[b, h] < 0, -1).topk(40).indices
            assert chosen(*want)[b][h] == set(best.tolist())


@pytest.mark.parametrize("budget", [12, 0.05])
def test_reference_keeps_what_the_selector_ranking_keeps(budget):
    """Slots in position order (as on the fast path for a layer that keeps everything): the reference's
    counted slots are the mask path's top budget of `SparQSelector.scores`, ties going to recent tokens."""
    query, keys, keys_t, slot_pos, write_slot, context, scaling = static_layer(group=4)
    keys_t = keys.transpose(2, 3).contiguous()
    indices, lengths = sparq_decode_reference(query, keys, keys_t, slot_pos, write_slot, context, scaling, RANK,
                                              budget, 64)  # fmt: skip
    valid = (slot_pos >= 0).unsqueeze(2)
    scores = sparq_probs(query.unsqueeze(2), keys, valid, scaling, RANK)
    keep = select_top_budget(scores, valid, budget, slot_pos, context.view(-1, 1, 1))[:, :, 0]
    counted = torch.arange(64, device=DEVICE) < lengths.unsqueeze(-1)
    picked = torch.zeros(keep.shape, dtype=torch.int, device=DEVICE).scatter_add_(-1, indices.long(), counted.int()) > 0
    assert torch.equal(picked, keep)


@pytest.mark.parametrize("knobs", [SMALL, {}])
@pytest.mark.parametrize("budget,k", [(40, 64), (0.1, 28)])
@pytest.mark.parametrize("recent", [0, 8, 50])
def test_recent_positions_come_first_in_kernel_and_reference(recent, budget, k, knobs):
    """`recent`: the last positions up to the token at the write slot are chosen whatever their
    probabilities, within the budget (50: more than it, the newest first). One row holds its
    positions shuffled over the slots, another has free slots among them; both take the same slots."""
    query, keys, keys_t, slot_pos, write_slot, context, scaling = static_layer(group=4, seed=2)
    g = torch.Generator().manual_seed(6)
    slot_pos[0, 1, :280] = slot_pos[0, 1, torch.randperm(280, generator=g).to(DEVICE)]
    write_slot = slot_pos.argmax(-1)  # the decode token: the newest
    args = (query, keys, keys_t, slot_pos, write_slot, context, scaling)
    (ref_idx, ref_len), (tri_idx, tri_len), _, _ = both(args, budget, k, recent=recent, **knobs)
    assert torch.equal(tri_len, ref_len) and chosen(tri_idx, tri_len) == chosen(ref_idx, ref_len)
    plain = chosen(*sparq_decode_reference(*args, RANK, budget, k))
    for b in range(2):
        for h in range(2):
            n, pos = int(ref_len[b, h]), slot_pos[b, h]
            window = (pos > pos.max() - recent).sum()  # free slots (-1) sort last, below the window
            assert set(pos.argsort(descending=True)[: min(window, n)].tolist()) <= chosen(tri_idx, tri_len)[b][h]
            assert (chosen(tri_idx, tri_len)[b][h] == plain[b][h]) == (recent == 0)  # else some came in


@pytest.mark.parametrize("knobs", [SMALL, {}])
def test_equal_probabilities_go_to_the_higher_slot(knobs):
    """Exact ties the same in both: every slot equal (a zero query), and a run of identical best keys
    longer than the budget, which the budget cuts."""
    query, keys, keys_t, slot_pos, write_slot, context, scaling = static_layer(group=4)
    zero = (torch.zeros_like(query), keys, keys_t, slot_pos, write_slot, context, scaling)
    ref, tri, _, _ = both(zero, 40, 64, **knobs)
    assert chosen(*tri) == chosen(*ref)
    assert chosen(*tri)[0][0] == set(range(240, 280))  # the 40 highest held slots
    query, keys, keys_t, slot_pos, write_slot, context, scaling = static_layer(group=1)
    keys[:, :, 150:210] = 3 * query.unsqueeze(2)  # 60 equal slots, the best ones (no GQA: one query per KV head)
    keys_t = keys.transpose(2, 3).contiguous()
    ref, tri, _, _ = both((query, keys, keys_t, slot_pos, write_slot, context, scaling), 40, 64, **knobs)
    assert chosen(*tri) == chosen(*ref)
    assert chosen(*tri)[0][1] == set(range(170, 210))


@pytest.mark.parametrize("knobs", [SMALL, {}])
def test_nearly_flat_probabilities_are_narrowed_by_the_second_level(knobs):
    """Keys a thousandth of the usual size: every held slot's pooled probability lies within a
    percent of the others, so the first level's cut bin holds most slots (more than the
    collection's registers) and the second level's bins part them. Both choose the same slots."""
    args = list(static_layer(group=4, slots=1200))
    args[3][:, :, 280:1100] = torch.arange(280, 1100)  # held up to 1100
    args[5] = torch.tensor([1100, 1100], device=DEVICE)
    args[1] = args[1] * 1e-3
    args[2] = args[1].transpose(2, 3).contiguous()
    query, keys, _, slot_pos, _, _, scaling = args
    probs = sparq_probs(query.unsqueeze(2), keys, (slot_pos >= 0).unsqueeze(2), scaling, RANK)[:, :, 0]
    bits = probs.view(torch.int32)[slot_pos >= 0]
    first, second = bits >> 19, (bits >> 7) & 4095
    top = first.mode().values
    assert (first == top).sum() > 300 and second[first == top].unique().numel() > 20, "not the case meant"
    ref, tri, _, _ = both(tuple(args), 100, 128, **knobs)
    assert chosen(*tri) == chosen(*ref)


def test_dispatch_picks_the_kernel_by_backend(monkeypatch):
    args = static_layer()
    monkeypatch.setenv("ATSKV_KERNELS", "reference")
    ref = sparq_decode(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], RANK, 40, 64)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    tri = sparq_decode(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], RANK, 40, 64)
    assert chosen(*tri) == chosen(*ref)


@pytest.mark.parametrize("recent", [0, 8])
def test_fast_generate_through_the_kernel_gives_the_reference_tokens(monkeypatch, recent):
    """SparQ's fused step inside `atskv.generate` (left-padded batch, every step checked for host
    reads) gives the reference session's tokens; so it does with the newest tokens always chosen
    (the padded row's positions start after its padding)."""
    model, ids, mask = (t.to(DEVICE) for t in left_padded("llama", 100, 20, seed=3))
    expected = _reference(model, ids, atskv.make_selector("sparq", recent=recent), 0.2, 6, mask)
    calls = []
    original = fast_graph.GraphedStep.__call__

    def guarded(self, variant=None):
        with _no_host_reads():
            calls.append(variant)
            return original(self, variant)

    monkeypatch.setattr(fast_graph.GraphedStep, "__call__", guarded)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    fast = atskv.generate(model, ids, atskv.make_selector("sparq", recent=recent), 0.2, attention_mask=mask,
                          max_new_tokens=6, dense_layers=1, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, expected) and len(calls) == 5


def test_fast_path_keeps_the_channel_major_copy_current(monkeypatch):
    """After decoding, the selector's copy equals the layer's keys transposed at every held slot."""
    from atskv.selectors.sparq import SparQSelector

    copies = []

    class Watched(SparQSelector):
        def decode_indices(self, view):
            out = super().decode_indices(view)
            copies.append((view.layer.state[self.name], view.keys, view.slot_pos))
            return out

    model = tiny_model("llama").to(DEVICE)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    atskv.generate(model, torch.randint(1, 90, (1, 70), device=DEVICE), Watched(), 8, max_new_tokens=4, dense_layers=1)
    assert copies
    for keys_t, keys, slot_pos in copies:
        held = (slot_pos >= 0).unsqueeze(2)
        assert torch.equal(keys_t * held, keys.transpose(2, 3) * held)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [0.05, 1000])
def test_kernel_on_cuda_at_the_llama_8b_shape(budget):
    """32K slots, 32 / 8 heads, D = 128, bf16, B = 2 with free slots: the same slots as the reference,
    except between slots whose probabilities agree to rounding (the GPU's exp is not torch's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    b, hkv, group, d, slots = 2, 8, 4, 128, 33_160
    keys = torch.randn(b, hkv, slots, d, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(b, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    slot_pos = torch.arange(slots, device="cuda").expand(b, hkv, slots).clone()
    slot_pos[:, :, 32_800:] = -1
    slot_pos[1, 3, ::5] = -1
    write_slot = torch.full((b, hkv), 32_799, device="cuda")
    context, scaling = torch.tensor([32_800, 32_800], device="cuda"), d**-0.5
    args = (query, keys, keys.transpose(2, 3).contiguous(), slot_pos, write_slot, context, scaling)
    k = 1640 if budget == 0.05 else 1000
    ref, tri, _, _ = both(args, budget, k, rank=16)
    assert torch.equal(tri[1], ref[1])
    held = (slot_pos >= 0).unsqueeze(2)
    probs = sparq_probs(query.unsqueeze(2), keys, held, scaling, 16)[:, :, 0].masked_fill(~held[:, :, 0], -1.0)
    for i in range(b):
        for h in range(hkv):
            n = int(ref[1][i, h])
            boundary = probs[i, h].topk(n).values[-1]
            differ = torch.tensor(sorted(chosen(*tri)[i][h] ^ chosen(*ref)[i][h]), dtype=torch.long, device="cuda")
            assert torch.allclose(probs[i, h, differ], boundary.expand(len(differ)), rtol=1e-5, atol=0)
