"""SparK: key-channel pruning with recovery, composed with a token selector."""

from __future__ import annotations

import math

import pytest
import torch

import atskv
from atskv.attention import grouped_probs
from atskv.selectors import make_selector
from atskv.selectors.base import Selector
from atskv.selectors.oracle import OracleSelector
from atskv.selectors.spark import SparKSelector
from atskv.selectors.sparq import SparQSelector
from tests.conftest import EVERY_TOKEN, random_prompt, tiny_model

WINDOW = 4


class RecordingSparK(SparKSelector):
    """Records the prompt's queries and keys at prefill, and at decode what attention would use
    (the fast path asks an evicting base for `eviction_scores`, the reference for `scores`, a
    query-aware one for `decode_indices`)."""

    def prefill(self, view):
        self.prompt[view.layer_idx] = (view.query.clone(), view.keys.clone(), view.slot_pos.clone())
        super().prefill(view)

    def scores(self, view):
        self._record(view)
        return super().scores(view)

    def eviction_scores(self, view):
        self._record(view)
        return super().eviction_scores(view)

    def decode_indices(self, view):
        self._record(view)
        return super().decode_indices(view)

    def _record(self, view):
        self.decode[view.layer_idx] = (self.attention_keys(view), view.keys.clone(), view.slot_pos.clone())


class RecordingOracle(OracleSelector):
    """Records its scores and the view it ranked."""

    scored: dict

    def scores(self, view):
        out = super().scores(view)
        self.scored[view.layer_idx] = (out, view)
        return out


def record(model, selector: RecordingSparK, ids, budget=EVERY_TOKEN):
    selector.prompt, selector.decode = {}, {}
    with atskv.sparse(model, selector, budget=budget, dense_layers=0), torch.no_grad():
        cache = model(ids).past_key_values
        model(ids[:, :1], past_key_values=cache)  # one decode step
    return selector


def direct_recovery(query, keys, prune_ratio, window=WINDOW):
    """The paper's pruning and degenerate recovery, written out: saliency |q_j| * |k_tj| with the
    window's query magnitude, top-T channels per token kept, the rest set to sign * mu_t / |q_j|."""
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    q = query[:, :, -window:].reshape(b, hkv, hq // hkv * window, d)
    magnitude = q.square().mean(2).sqrt()  # [B, Hkv, D]
    saliency = magnitude[:, :, None] * keys.abs()
    t = math.floor((1 - prune_ratio) * d + 1e-9)
    kept = torch.zeros_like(keys, dtype=torch.bool).scatter_(-1, saliency.topk(t, dim=-1).indices, True)
    mu = (saliency * ~kept).sum(-1, keepdim=True) / (d - t)
    return torch.where(kept, keys, keys.sign() * mu / magnitude[:, :, None]), kept


@pytest.mark.parametrize("prune_ratio", [0.5, 0.8])
def test_recovered_keys_equal_a_direct_computation(prune_ratio):
    model = tiny_model("llama")
    ids = random_prompt(24, seed=1, batch=2)
    selector = record(model, RecordingSparK(base=make_selector("oracle"), prune_ratio=prune_ratio, window=WINDOW), ids)
    d = model.config.hidden_size // model.config.num_attention_heads
    t = math.floor((1 - prune_ratio) * d + 1e-9)
    assert selector.key_channel_fraction(d) == t / d
    for layer, (query, keys, _) in selector.prompt.items():
        expected, kept = direct_recovery(query, keys, prune_ratio)
        used, raw, _ = selector.decode[layer]
        assert torch.equal(raw[:, :, :24], keys)
        torch.testing.assert_close(used[:, :, :24], expected, rtol=1e-6, atol=1e-6)
        assert (kept.sum(-1) == t).all()
        assert ((used[:, :, :24] == keys).sum(-1) == t).all(), "each prompt token keeps exactly T channels"
        assert torch.equal(used[:, :, 24:], raw[:, :, 24:]), "tokens after the prompt are not pruned"


def test_recovery_follows_tokens_through_eviction():
    """With an evicting base (SnapKV) the cache is compacted; each kept token's recovered key is
    still the one computed for it at prefill."""
    model = tiny_model("llama")
    ids = random_prompt(48, seed=2)
    selector = record(model, RecordingSparK(base=make_selector("snapkv", window=4), window=WINDOW), ids, budget=8)
    for layer, (query, keys, _) in selector.prompt.items():
        expected, _ = direct_recovery(query, keys, 0.5)
        used, _, pos = selector.decode[layer]
        assert used.shape[2] < 48, "the base selector should have evicted and compacted"
        prompt = (pos >= 0) & (pos < 48)
        gathered = expected.gather(2, pos.clamp(min=0, max=47).unsqueeze(-1).expand_as(used))
        torch.testing.assert_close(used[prompt], gathered[prompt], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("base", "options"), [("snapkv", {"window": 4}), ("oracle", {}), ("h2o", {})], ids=["snapkv", "oracle", "h2o"]
)
def test_keeping_every_channel_equals_the_base_selector(base, options):
    model = tiny_model("llama")
    ids = random_prompt(24, seed=3)
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    runs = []
    for selector in [make_selector("spark", base=base, prune_ratio=0.0, base_options=options),
                     make_selector(base, **options)]:
        with atskv.sparse(model, selector, budget=6, dense_layers=1), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        runs.append((out.sequences, torch.stack(out.logits)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
    spark = SparKSelector(base=make_selector(base, **options), prune_ratio=0.0)
    plain = make_selector(base, **options)
    assert spark.key_channel_fraction(16) == 1.0
    for flag in ("query_aware", "evicts", "keeps_all", "needs_attention", "needs_hidden"):
        assert getattr(spark, flag) == getattr(plain, flag), flag


def test_a_query_aware_base_scores_the_recovered_keys():
    """The base ranks tokens on the keys attention will use (the full keys are not stored)."""
    model = tiny_model("llama")
    ids = random_prompt(24, seed=4)
    base = RecordingOracle()
    base.scored = {}
    selector = record(model, RecordingSparK(base=base, prune_ratio=0.8, window=WINDOW), ids, budget=4)
    differs = 0
    for layer, (base_scores, view) in base.scored.items():
        used, full, _ = selector.decode[layer]
        on_recovered = grouped_probs(view.query, used, view.valid, view.scaling).sum(2)
        on_full = grouped_probs(view.query, full, view.valid, view.scaling).sum(2)
        torch.testing.assert_close(base_scores, on_recovered)
        differs += not torch.allclose(base_scores, on_full)
    assert differs == len(base.scored) > 0


@pytest.mark.parametrize("base,rows", [("oracle", 2), ("snapkv", 1)])
def test_the_fast_path_holds_the_recovered_keys_in_its_cache(base, rows):
    """`atskv.generate` attends on its cache's keys: after the prompt each held prompt token's
    cached key is its recovered one, computed directly (the oracle: a left-padded batch, whose
    padding the fast path drops; SnapKV: what its eviction kept)."""
    model = tiny_model("llama")
    ids = random_prompt(100, seed=6, batch=rows)
    mask = torch.ones_like(ids)
    mask[1:, :10] = 0
    selector = RecordingSparK(base=make_selector(base), window=WINDOW)
    selector.prompt, selector.decode = {}, {}
    atskv.generate(model, ids, selector, 8, attention_mask=mask, max_new_tokens=2, dense_layers=0, prefill_chunk=64)
    assert set(selector.decode) == set(selector.prompt) == set(range(4))
    for layer, (query, keys, _) in selector.prompt.items():
        expected, _ = direct_recovery(query, keys[:, :, :100], 0.5)
        cached, full, pos = selector.decode[layer]
        assert torch.equal(cached, full), "the fast path recovers nothing at decode: its cache holds the result"
        prompt = (pos >= 0) & (pos < 100)
        assert (prompt.sum(-1) == (100 if base == "oracle" else 8) - 10 * torch.arange(rows).view(-1, 1)).all()
        gathered = expected.gather(2, pos.clamp(min=0, max=99).unsqueeze(-1).expand_as(cached))
        torch.testing.assert_close(cached[prompt], gathered[prompt], rtol=1e-6, atol=1e-6)
        raw = keys.gather(2, pos.clamp(min=0, max=99).unsqueeze(-1).expand_as(cached))
        assert not torch.equal(cached[prompt], raw[prompt])


def test_the_base_runs_its_own_fast_step():
    """On the fast path SparK hands the step to its base: SparQ's channel-major copy is built
    (`static_write`) and its fused pick runs (`decode_indices`), not a ranking of its scores."""
    picks = []

    class CountingSparQ(SparQSelector):
        def decode_indices(self, view):
            picks.append(self.name in view.layer.state)
            return super().decode_indices(view)

    model = tiny_model("llama")
    atskv.generate(model, random_prompt(80, seed=7), SparKSelector(base=CountingSparQ()), 8, max_new_tokens=3,
                   dense_layers=1, prefill_chunk=64)  # fmt: skip
    assert picks == [True] * 2 * 3  # two decode steps, three managed layers


@pytest.mark.parametrize("bad", [dict(prune_ratio=1.0), dict(prune_ratio=-0.1), dict(base="spark")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SparKSelector(**bad)
    with pytest.raises(ValueError):
        make_selector("spark", **bad)


def test_the_bases_needs_and_unwanted_slots_are_forwarded():
    """What the hook asks of a selector (hidden states, attention mass, slots it drops below its
    budget) is the base's: SparK passes each through, with the view on the recovered keys."""

    class Needy(Selector):
        name = "needy"
        evicts = True
        needs_hidden = True
        needs_attention = True

        def scores(self, view):  # the oldest tokens first: position 0 is kept unless unwanted
            return -view.slot_pos.float().unsqueeze(2)

        def unwanted(self, view):
            return view.slot_pos == 0

    base = Needy()
    spark = SparKSelector(base=base, prune_ratio=0.5, window=WINDOW)
    assert spark.needs_hidden and spark.needs_attention and spark.evicts and not spark.query_aware
    assert not SparKSelector().needs_hidden  # the default base, SnapKV, needs neither

    model = tiny_model("llama")
    ids = random_prompt(24, seed=5)
    with atskv.sparse(model, spark, budget=8, dense_layers=0) as session, torch.no_grad():
        cache = model(ids).past_key_values
        assert session.hidden, "the hook must keep the hidden states a needs_hidden base reads"
        model(ids[:, :1], past_key_values=cache)
    held = [layer.slot_pos[..., : layer.length] for layer in cache.layers]
    assert held and all(not (positions == 0).any() for positions in held), "the base's unwanted slot must go"
    assert all((positions > 0).sum(-1).min() > 0 for positions in held)
