"""The learned selector's refresh over kept lists in a paged cache (`atskv.kernels.listed_refresh`):
the folded MLP against the predictor's own scoring, and the Triton kernel (Triton's interpreter on
the CPU) against the torch reference, on random lists through random block tables: rows due and
not due, padded rows, pinned entries, the first managed layer and a later one."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.features import SCALAR_FEATURES
from atskv.kernels.budget import kept_tokens
from atskv.kernels.kept_lists import list_slots
from atskv.kernels.listed_refresh import (
    fold_mlp,
    refresh_listed_scores_reference,
    refresh_listed_scores_triton,
)
from atskv.kernels.paged import physical_slots

BLOCK, HKV, GROUP = 4, 3, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_folded_mlp_scores_as_the_predictor(engine_mlp):
    folded = fold_mlp(engine_mlp)
    n, layers = 50, engine_mlp.spec.num_layers
    scalars = torch.randn(n, len(SCALAR_FEATURES))
    layer, head = torch.randint(0, layers, (n,)), torch.randint(0, engine_mlp.spec.num_kv_heads, (n,))
    with torch.no_grad():
        want = engine_mlp.score(scalars.new_zeros(n, 0), scalars, torch.zeros(n, dtype=torch.long), layer, head)
    got = torch.relu(scalars @ folded.w + folded.bias[layer, head]) @ folded.w2 + folded.b2
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


def state(lengths, prompts, width_blocks, budget, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = len(lengths) * width_blocks + 5
    slots = blocks * BLOCK
    table = torch.randperm(blocks, generator=g)[: len(lengths) * width_blocks].view(len(lengths), -1).int()
    kept = torch.randint(0, 999, (slots + 1, HKV), generator=g, dtype=torch.int32)
    values = torch.randn(slots + 1, HKV, generator=g)
    received = torch.rand(slots + 1, HKV, generator=g) * 5
    key_norm = torch.rand(slots + 1, HKV, generator=g) * 10
    pinned = torch.rand(slots + 1, HKV, generator=g) < 0.1
    prompt_len = torch.randint(0, 999, (slots + 1,), generator=g, dtype=torch.int32)
    for r, (n, p) in enumerate(zip(lengths, prompts)):
        held = int(kept_tokens(budget, torch.tensor(max(n - 1, 0))))
        at = list_slots(table[r : r + 1], torch.tensor([n]), BLOCK, held, slots)[0]
        for h in range(HKV):
            kept[at, h] = torch.randperm(max(n - 1, 1), generator=g)[:held].int()
        if n:
            prompt_len[physical_slots(torch.zeros(1, 1, 1), table[r : r + 1], BLOCK).long().view(-1)] = p
    return kept, values, received, key_norm, pinned, prompt_len, table


@pytest.mark.parametrize("budget", [6, 0.3])
@pytest.mark.parametrize("layer, previous", [(0, False), (5, True)])
def test_the_refresh_kernel_matches_its_reference(engine_mlp, budget, layer, previous):
    lengths = [37, 0, 60, 20, 50]  # prompts below: 37 - 29 = 8 and 60 - 28 = 32 due at every 8 steps
    prompts = [29, 0, 28, 19, 50]  # 20 - 19 = 1: not due; 50 - 50 = 0: still in its prompt
    kept, values, received, key_norm, pinned, prompt_len, table = state(lengths, prompts, 16, budget, seed=layer)
    prev = torch.rand_like(received) if previous else None
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    width = min(16 * BLOCK, math.ceil(budget * 16 * BLOCK) + 1 if isinstance(budget, float) else budget + 1)
    folded = fold_mlp(engine_mlp)
    want = values.clone()
    args = (kept, received, key_norm, prev, pinned, prompt_len, table, seq_lens, BLOCK, budget, 8, GROUP, folded,
            layer, width)  # fmt: skip
    refresh_listed_scores_reference(kept, want, *args[1:])
    assert not torch.equal(want, values), "due rows must change"
    moved = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    folded_dev = type(folded)(folded.w.to(DEVICE), folded.bias.to(DEVICE), folded.w2.to(DEVICE), folded.b2)
    got = values.clone().to(DEVICE)
    refresh_listed_scores_triton(moved(kept), got, *[moved(a) for a in args[1:12]], folded_dev, layer, width,
                                 block_j=8, block_h=64)  # fmt: skip
    torch.testing.assert_close(got.cpu()[:-1], want[:-1], rtol=1e-4, atol=1e-4)
    for r in (1, 3, 4):  # padded, not due, in its prompt: untouched
        at = list_slots(table[r : r + 1], seq_lens[r : r + 1], BLOCK, width, kept.shape[0] - 1)[0]
        assert torch.equal(want[at[at < kept.shape[0] - 1]], values[at[at < kept.shape[0] - 1]])
