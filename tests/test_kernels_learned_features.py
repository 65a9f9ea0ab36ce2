"""The learned selector's kernels (`atskv.kernels.learned_features`, Triton's interpreter on CPU)
against their torch references, and the references against the predictor's own code."""

from __future__ import annotations

import pytest
import torch

from atskv.features import SCALAR_FEATURES
from atskv.kernels.learned_features import refresh_scores, slot_scalars, write_token_features
from atskv.predictor.model import FeatureSpec, RelevanceMLP

B, H, S, D, D_MODEL, POSITIONS = 2, 3, 40, 16, 48, 300


def _state(g, width: int):
    """A slot state as the selector keeps it: one float32 tensor, the projection as bfloat16 pairs."""
    pairs = (width + 1) // 2
    state = torch.zeros(B, H, S, pairs + 3)
    projected = state[..., :pairs].view(torch.bfloat16)[..., :width]
    projected.copy_(torch.randn(B, H, S, width, generator=g))  # never a NaN's bits, as random pairs could be
    state[..., pairs] = torch.randn(B, H, S, generator=g).abs()  # hidden norms
    state[..., pairs + 1] = torch.randint(0, 9, (B, H, S), generator=g).float()  # kinds: 0 (none) or 1 + type
    state[..., pairs + 2] = torch.rand(B, H, S, generator=g) * 5  # received attention
    return state, (projected, state[..., pairs], state[..., pairs + 1], state[..., pairs + 2])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("width", [7, 0])  # 7: the last bfloat16 pair half used; 0: a predictor without hidden state
def test_the_token_write_matches_its_reference(monkeypatch, bias, width):
    g = torch.Generator().manual_seed(0)
    weight, b = torch.randn(width, D_MODEL, generator=g), torch.randn(width, generator=g) if bias else None
    hidden = (torch.randn(B, 3, D_MODEL, generator=g) * 4).bfloat16()[:, -1]  # a strided view, as the step's
    types = torch.randint(0, 8, (100,), generator=g, dtype=torch.int8)
    ids = torch.tensor([[5, 17], [3, 99]])[:, -1]
    slots = torch.tensor([[4, 0, 39], [12, 12, 7]])
    results, scores = {}, {}
    for choice in ("reference", "triton"):
        monkeypatch.setenv("ATSKV_KERNELS", choice)
        state, views = _state(torch.Generator().manual_seed(1), width)
        scores[choice] = torch.randn(B, H, S, generator=torch.Generator().manual_seed(2))
        write_token_features(weight, b, hidden, types, ids, slots, *views, scores[choice])
        results[choice] = state
    assert torch.equal(results["triton"], results["reference"]) and torch.equal(scores["triton"], scores["reference"])
    state, _ = _state(torch.Generator().manual_seed(1), width)
    written = (results["reference"] != state).any(-1)
    assert written.sum() == B * H and written[1, 0, 12] and written[1, 1, 12]  # one slot per (row, KV head)
    at = (torch.arange(B).view(B, 1), torch.arange(H), slots)
    assert (results["reference"][..., -1][at] == 0).all(), "the slot's received attention restarts at 0"
    assert (scores["reference"][at] == torch.inf).all() and torch.isfinite(scores["reference"]).sum() == B * H * (S - 1)
    _, (projected, norm, kind, _) = _state(torch.Generator().manual_seed(1), width)
    projected.copy_(results["reference"][..., : (width + 1) // 2].view(torch.bfloat16)[..., :width])
    norm.copy_(results["reference"][..., (width + 1) // 2])
    kind.copy_(results["reference"][..., (width + 1) // 2 + 1])
    assert torch.equal(projected[0, 0, 4], projected[0, 1, 0]), "every KV head holds the row's projection"
    assert kind[1, 2, 7] == types[99] + 1 and kind[0, 2, 39] == types[17] + 1
    torch.testing.assert_close(norm[1, 1, 12], hidden[1].float().norm())


def _mlp(g, width: int, without=()):
    spec = FeatureSpec(D_MODEL, SCALAR_FEATURES, num_layers=3, num_kv_heads=H)
    mlp = RelevanceMLP(spec, reduced_width=width, hidden=80, without=without).eval()  # 80: a partial chunk
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        mlp.scalar_norm.running_mean.copy_(torch.randn(len(SCALAR_FEATURES), generator=g))
        mlp.scalar_norm.running_var.copy_(torch.rand(len(SCALAR_FEATURES), generator=g) + 0.5)
    return mlp


def _slots(g):
    """Slot positions with free slots, positions unique per (row, KV head), a left-padded row."""
    pos = torch.rand(B, H, POSITIONS - 20, generator=g).argsort(-1)[..., :S] + 20
    pos = pos.masked_fill(torch.rand(B, H, S, generator=g) < 0.2, -1)
    context = torch.tensor([POSITIONS - 15, POSITIONS - 30])  # seen POSITIONS - 15: row 1 has 15 pads
    return pos, context, torch.tensor([POSITIONS - 15])


@pytest.mark.parametrize("case", ["first layer", "with previous", "without some inputs"])
def test_the_refresh_matches_its_reference(monkeypatch, case):
    g = torch.Generator().manual_seed(2)
    width = 12
    mlp = _mlp(g, width, without=("log_age", "token_type") if case == "without some inputs" else ())
    _, views = _state(g, width)
    keys = torch.randn(B, H, S, D, generator=g).bfloat16()
    slot_pos, context, seen = _slots(g)
    previous = None
    if case != "first layer":
        previous = torch.zeros(B, 2, POSITIONS + 1)
        previous[:, 0].uniform_(0, 1, generator=g)
        previous[:, 1] = torch.randint(0, H + 1, (B, POSITIONS + 1), generator=g).float()
    results = {}
    for choice in ("reference", "triton"):
        monkeypatch.setenv("ATSKV_KERNELS", choice)
        sums, score = torch.zeros(B, 2, POSITIONS + 1), torch.full((B, H, S), 7.0)
        refresh_scores(mlp, 1, *views, keys, slot_pos, context, seen, 4, previous, sums, score)
        results[choice] = sums, score
    (sums, score), (sums_k, score_k) = results["reference"], results["triton"]
    torch.testing.assert_close(score_k, score, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums_k, sums, rtol=1e-6, atol=1e-7)
    held = slot_pos >= 0
    assert torch.isinf(score[~held]).all() and (score[~held] < 0).all() and torch.isfinite(score[held]).all()
    assert sums[:, 1].sum() == held.sum() and (sums[:, 1] <= H).all()


def test_the_refresh_reference_is_the_predictors_score_of_the_features():
    """What the fused refresh computes: `RelevanceMLP.score` of `slot_scalars` row by row, with
    the type from the kind and this layer and head's embeddings."""
    g = torch.Generator().manual_seed(3)
    mlp = _mlp(g, 8)
    _, (projected, norm, kind, received) = _state(g, 8)
    keys = torch.randn(B, H, S, D, generator=g)
    slot_pos, context, seen = _slots(g)
    score = torch.empty(B, H, S)
    refresh_scores(mlp, 2, projected, norm, kind, received, keys, slot_pos, context, seen, 4, None,
                   torch.zeros(B, 2, POSITIONS + 1), score)  # fmt: skip
    scalars = slot_scalars(received, norm, keys, slot_pos, context, seen, 4, None)
    b, h, s = 1, 2, int((slot_pos[1, 2] >= 0).nonzero()[0])
    with torch.no_grad():
        expected = mlp.score(projected[b, h, s : s + 1].float(), scalars[b, h, s : s + 1],
                             (kind[b, h, s : s + 1] - 1).clamp(min=0).long(), torch.tensor([2]), torch.tensor([h]))
    torch.testing.assert_close(score[b, h, s : s + 1], expected)
    pos = slot_pos[b, h, s] - (seen - context[b])  # its position within row b's own text
    assert scalars[b, h, s, SCALAR_FEATURES.index("position")] == pos / (context[b] - 1)


def test_the_refresh_follows_the_weights_when_they_change(monkeypatch):
    """The kernel reads W1 packed once per set of weights (`_pack`): an in-place update repacks."""
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    g = torch.Generator().manual_seed(4)
    mlp = _mlp(g, 8)
    _, views = _state(g, 8)
    keys = torch.randn(B, H, S, D, generator=g)
    slot_pos, context, seen = _slots(g)
    scores = []
    for _ in range(2):
        score = torch.empty(B, H, S)
        refresh_scores(mlp, 0, *views, keys, slot_pos, context, seen, 4, None, torch.zeros(B, 2, POSITIONS + 1), score)
        scores.append(score)
        with torch.no_grad():
            mlp.w1.weight.mul_(-1)
    monkeypatch.setenv("ATSKV_KERNELS", "reference")
    expected = torch.empty(B, H, S)
    refresh_scores(mlp, 0, *views, keys, slot_pos, context, seen, 4, None, torch.zeros(B, 2, POSITIONS + 1), expected)
    torch.testing.assert_close(scores[0], expected, rtol=1e-5, atol=1e-5)  # weights negated twice: as at first
    assert not torch.allclose(scores[1], scores[0])
