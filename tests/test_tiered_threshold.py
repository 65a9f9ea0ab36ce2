"""A learned selector's absolute `threshold` under `atskv.tiered`: the manager's momentum votes on
what the selector wants (`Selector.unwanted`: `score > threshold`) instead of its quantile, so the
GPU tier holds what the predictor wants (the budget a cap), as `atskv.sparse` keeps it."""

from __future__ import annotations

import pytest
import torch

import atskv
from atskv.runtime.reference.sparsity import LayerPolicy, SparsityBudget, SparsityManager
from atskv.selectors.learned import LearnedSelector
from tests.conftest import random_prompt, tiny_model
from tests.test_selector_learned import predictor_dir as learned_predictor_dir

predictor_dir = learned_predictor_dir  # the fixture: an exported predictor for the tiny Llama

# one row, one KV head, 12 tokens; position 0 is a sink, 10 and 11 are recent
SCORES = torch.tensor([[[-3.0, 0.5, -1.0, 2.0, 0.0, 1.5, -0.2, 3.0, 0.1, -2.0, -5.0, -4.0]]])
PROTECTED = {0, 10, 11}


def _decide(threshold: float | None, max_active: int = 12):
    policy = LayerPolicy(q_min=0.5, q_max=0.5, momentum=0.0)
    manager = SparsityManager(policy, SparsityBudget(max_active, sinks=1, recent=2))
    n = SCORES.shape[-1]
    active = torch.ones_like(SCORES, dtype=torch.bool)
    positions = torch.arange(n).expand_as(SCORES)
    unwanted = None if threshold is None else SCORES <= threshold  # what `LearnedSelector.unwanted` says
    return manager.decide(0, SCORES, active, positions, torch.ones_like(SCORES), seen=n, unwanted=unwanted)


def _kept(decision) -> set[int]:
    return set(decision.keep[0, 0].nonzero().flatten().tolist())


def test_decide_votes_on_the_absolute_level_instead_of_the_quantile():
    by_quantile = _decide(None)  # tau = the median, -0.1: -1.0 and -0.2 lose the vote
    assert _kept(by_quantile) == PROTECTED | {1, 3, 4, 5, 7, 8}
    at_zero = _decide(0.0)  # at the level (position 4) is out; protected tokens stay whatever they score
    assert _kept(at_zero) == PROTECTED | {1, 3, 5, 7, 8}
    assert torch.equal(at_zero.demote, ~at_zero.keep)
    low = _decide(-2.0)  # -1.0 and -0.2 stay although the quantile demotes them; -2.0 is at the level
    assert _kept(low) == set(range(12)) - {9}
    assert torch.equal(low.tau, by_quantile.tau)  # still the quantile's, for whoever promotes by it
    capped = _decide(-2.0, max_active=8)  # 11 want to stay: the protected ones and the 5 best others
    assert _kept(capped) == PROTECTED | {7, 3, 5, 1, 8}
    assert int(capped.free) == 0


class Recording(LearnedSelector):
    """Keeps the scores each layer was last ranked by, with their slots' positions."""

    def scores(self, view):
        out = super().scores(view)
        self.ranked = getattr(self, "ranked", {})
        self.ranked[view.layer_idx] = (out[:, :, 0].clone(), view.slot_pos.clone())
        return out


def _after_prompt(model, prompt, predictor_dir, threshold):
    """GPU positions per (row, KV head) of every managed layer after the prompt, and the selector."""
    selector = Recording(predictor=predictor_dir, refresh_every=4, threshold=threshold)
    options = dict(sinks=2, recent=8, refresh_every=4, policy={"momentum": 0.0})
    with torch.no_grad(), atskv.tiered(model, selector, budget=0.9, **options) as session:
        cache = session.new_cache()
        model(prompt, past_key_values=cache)
    held = {}
    for i in cache.managed_layers:
        gpu, _ = cache.layers[i].held_positions()
        held[i] = [[set(g[g >= 0].tolist()) for g in row] for row in gpu]
    return held, selector


def test_the_gpu_tier_holds_the_protected_tokens_and_those_the_predictor_wants(predictor_dir):
    model = tiny_model("llama")
    prompt = random_prompt(64, seed=3, batch=2)
    protected = {0, 1, *range(56, 64)}  # 2 sinks, 8 recent
    held, selector = _after_prompt(model, prompt, predictor_dir, threshold=1e9)
    assert all(heads == protected for rows in held.values() for row in rows for heads in row)
    scores = torch.cat([s.flatten() for s, _ in selector.ranked.values()])
    threshold = float(scores.median())  # about half of the tokens clear it: well under the cap of 0.9 x 64 - 4
    held, selector = _after_prompt(model, prompt, predictor_dir, threshold=threshold)
    by_quantile, _ = _after_prompt(model, prompt, predictor_dir, threshold=None)
    for i, rows in held.items():
        scores, positions = selector.ranked[i]
        for b, row in enumerate(rows):
            for h, gpu in enumerate(row):
                wanted = set(positions[b, h][scores[b, h] > threshold].tolist())
                assert gpu == protected | wanted
                assert len(gpu) <= 54
    # the quantile (near q_max with the tier full) keeps fewer: without a threshold the old rule holds
    pairs = [(gpu, old) for i in held for rows in zip(held[i], by_quantile[i]) for gpu, old in zip(*rows)]
    assert any(gpu - old for gpu, old in pairs)


def test_a_policy_given_as_a_dict_is_checked():
    assert atskv.TieringConfig(200, policy={"momentum": 0.0}).policy == LayerPolicy(momentum=0.0)
    options = "beta, momentum, promote_margin"
    with pytest.raises(ValueError, match=f"the tiering policy has no option 'bogus'; its options: {options}"):
        atskv.TieringConfig(200, policy={"bogus": 1})
    with pytest.raises(ValueError, match="momentum"):
        atskv.TieringConfig(200, policy={"momentum": 1.0})
    with pytest.raises(TypeError, match="LayerPolicy or a dict"):
        atskv.TieringConfig(200, policy=0.8)
