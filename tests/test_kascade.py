"""Kascade: the anchor dynamic program, the per-model profile, and the selector on a tiny Llama."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import atskv
from atskv.models import model_geometry
from atskv.selectors import make_selector
from atskv.selectors.base import select_top_budget
from atskv.selectors.kascade import KascadeProfile, KascadeSelector, choose_anchors, compute_kascade_profile
from tests.conftest import COMMON, random_prompt, tiny_model


def six_layer_llama(num_kv_heads: int = 2):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=6, num_key_value_heads=num_kv_heads, **COMMON)).eval()
    model.set_attn_implementation("sdpa")
    return model


def hand_profile(model, anchors=(1, 3), head_map=None) -> KascadeProfile:
    managed = [1, 2, 3, 4, 5]
    return KascadeProfile(
        model="six-layer",
        geometry=model_geometry(model.config),
        managed_layers=managed,
        anchors=list(anchors),
        head_map=head_map if head_map is not None else {2: [1, 0], 4: [0, 0], 5: [1, 1]},
        similarity=[[1.0] * 5 for _ in managed],
        importance=[1.0] * 5,
        topk=8,
        queries=8,
        dev_set="hand-made",
    )


# --- the dynamic program -------------------------------------------------------------------------
def brute_force_anchors(weighted: torch.Tensor, m: int) -> list[int]:
    n = weighted.shape[0]

    def value(anchors):
        return sum(float(weighted[max(a for a in anchors if a <= b), b]) for b in range(n))

    return list(max(((0, *rest) for rest in itertools.combinations(range(1, n), m - 1)), key=value))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_dynamic_program_equals_brute_force(n):
    g = torch.Generator().manual_seed(n)
    for trial in range(4):
        weighted = torch.rand(n, n, generator=g) * torch.rand(n, generator=g)  # importance-weighted columns
        for m in range(1, n + 1):
            assert choose_anchors(weighted, m) == brute_force_anchors(weighted, m), (trial, m)


def test_dynamic_program_on_a_hand_made_matrix():
    """Two blocks of mutually similar layers: two anchors go to the starts of the blocks, a third to
    the layer that resembles nothing."""
    sim = torch.full((6, 6), 0.1)
    sim[:3, :3] = 0.95
    sim[3:, 3:] = 0.9
    sim[5, :] = 0.1
    sim[:, 5] = 0.05
    sim.fill_diagonal_(1.0)
    assert choose_anchors(sim, 2) == [0, 3]
    assert choose_anchors(sim, 3) == [0, 3, 5]
    with pytest.raises(ValueError, match="n_anchors"):
        choose_anchors(sim, 7)


# --- the selector ----------------------------------------------------------------------------------
class RecordingKascade(KascadeSelector):
    """Records, per call, the keep-mask the hook derives from the scores and a direct reference."""

    def scores(self, view):
        out = super().scores(view)
        b, hkv, tq, s = view.valid.shape
        g = view.query.shape[1] // hkv
        keys = view.keys.repeat_interleave(g, dim=1)
        logits = (view.query @ keys.transpose(-1, -2)) * view.scaling
        logits = logits.masked_fill(~view.valid.repeat_interleave(g, dim=1), float("-inf"))
        direct = logits.softmax(-1).view(b, hkv, g, tq, s).sum(2)
        args = (view.valid, view.budget, view.slot_pos, view.context)
        self.calls.append((view.layer_idx, select_top_budget(out, *args), select_top_budget(direct, *args),
                           view.slot_pos.clone()))
        return out


def decode(model, ids, steps=4):
    with torch.no_grad():
        cache = model(ids).past_key_values
        for t in range(steps):
            model(ids[:, t : t + 1], past_key_values=cache)


@pytest.mark.parametrize("sparse_prefill", [False, True])
def test_anchors_take_pooled_topk_and_reuse_layers_take_the_anchor_set(sparse_prefill):
    model = six_layer_llama()
    profile = hand_profile(model)
    selector = RecordingKascade(profile)
    selector.calls = []
    with atskv.sparse(model, selector, budget=5, dense_layers=1, sparse_prefill=sparse_prefill):
        decode(model, random_prompt(20, batch=2))
    assert len(selector.calls) == 5 * (4 + sparse_prefill)
    steps = [selector.calls[i : i + 5] for i in range(0, len(selector.calls), 5)]
    for step in steps:
        by_layer = {layer: (keep, direct, pos) for layer, keep, direct, pos in step}
        assert sorted(by_layer) == [1, 2, 3, 4, 5]
        for layer, (keep, direct, pos) in by_layer.items():
            anchor = profile.anchor_of(layer)
            if layer == anchor:
                assert torch.equal(keep, direct), f"anchor layer {layer}: not the exact pooled top-k"
            else:
                anchor_keep, _, anchor_pos = by_layer[anchor]
                assert torch.equal(pos, anchor_pos)  # same slot layout, so slots compare as positions
                mapped = anchor_keep[:, profile.head_map[layer]]
                assert torch.equal(keep, mapped), f"reuse layer {layer}: not its anchor's set through the head map"
        assert not torch.equal(by_layer[2][0], by_layer[1][0]), "the head map [1, 0] should swap the sets"
        assert keep.sum(-1).max() == 5


def test_every_layer_an_anchor_equals_the_oracle():
    model = six_layer_llama()
    ids = random_prompt(24, seed=3)
    profile = hand_profile(model, anchors=[1, 2, 3, 4, 5], head_map={})
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    runs = []
    for selector in [KascadeSelector(profile), make_selector("oracle")]:
        with atskv.sparse(model, selector, budget=6, dense_layers=1), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        runs.append((out.sequences, torch.stack(out.logits)))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1])


def test_choices_never_leak_across_prompts():
    """A second prompt gets the same result as with a fresh selector; and a reuse layer whose
    anchor did not run in the current forward step (here: the hook keeps the anchor dense) is an
    error, even though the previous prompt's anchor choice, at the same length, is still alive."""
    model = six_layer_llama()
    profile = hand_profile(model)
    prompt_a, prompt_b = random_prompt(20, seed=1), random_prompt(20, seed=2)
    shared = KascadeSelector(profile)

    def logits(selector, ids, dense_layers=1):
        with atskv.sparse(model, selector, budget=5, dense_layers=dense_layers) as session, torch.no_grad():
            cache = model(ids).past_key_values
            out = model(ids[:, :1], past_key_values=cache).logits
        return out, session

    logits(shared, prompt_a)
    after_a, _ = logits(shared, prompt_b)
    fresh, _ = logits(KascadeSelector(profile), prompt_b)
    assert torch.equal(after_a, fresh)
    _, session_a = logits(shared, prompt_a)  # keeps prompt A's cache (anchor layer 1 at seen=21) alive
    assert session_a.cache.layers[1].seen == 21
    with pytest.raises(RuntimeError, match="anchor layer 1"):
        logits(shared, prompt_b, dense_layers=2)


def test_kascade_without_profile_says_how_to_make_one():
    with pytest.raises(ValueError, match="profile.*atskv profile kascade"):
        make_selector("kascade")


def test_selector_refuses_a_model_of_another_geometry():
    profile = hand_profile(six_layer_llama())
    other = six_layer_llama(num_kv_heads=1)
    with atskv.sparse(other, KascadeSelector(profile), budget=4, dense_layers=1):
        with pytest.raises(ValueError, match="kascade profile of .*this model has"):
            decode(other, random_prompt(12))
    with pytest.raises(ValueError, match="computed for"):
        profile.check_model(other)
    with atskv.sparse(six_layer_llama(), KascadeSelector(profile), budget=4, dense_layers=0) as session:
        with pytest.raises(ValueError, match="layer 0 is managed by the hook but the kascade profile"):
            decode(session.model, random_prompt(12))


# --- the profile -------------------------------------------------------------------------------------
def direct_profile_parts(model, windows, queries, topk):
    """Similarity and importance from eager attention weights and plain module hooks."""
    model.set_attn_implementation("eager")
    layers = model.model.layers
    io = {}
    hooks = [
        layer.self_attn.register_forward_hook(
            lambda m, args, kwargs, out: io.__setitem__(m.layer_idx, (kwargs["hidden_states"], out[0])),
            with_kwargs=True,
        )
        for layer in layers
    ]
    managed = list(range(1, len(layers)))
    hkv = model.config.num_key_value_heads
    heads_sum, importance_sum = 0.0, 0.0
    with torch.no_grad():
        for ids in windows:
            att = model(ids[None], output_attentions=True).attentions
            probs = [att[i][0, :, -queries:].reshape(hkv, -1, queries, ids.numel()).mean(1) for i in managed]
            n = len(managed)
            sims = torch.zeros(n, hkv, n, hkv)
            for a, ha, b, hb in itertools.product(range(n), range(hkv), range(n), range(hkv)):
                ratios = []
                for q in range(queries):
                    p_b = probs[b][hb, q]
                    chosen = probs[a][ha, q].topk(topk).indices
                    ratios.append(float(p_b[chosen].sum() / p_b.topk(topk).values.sum()))
                sims[a, ha, b, hb] = min(ratios)
            heads_sum = heads_sum + sims
            cos = [torch.cosine_similarity(io[i][0][0, -queries:], io[i][1][0, -queries:], dim=-1).mean()
                   for i in managed]
            importance_sum = importance_sum + 1 - torch.stack(cos)
    for h in hooks:
        h.remove()
    model.set_attn_implementation("sdpa")
    return heads_sum / len(windows), importance_sum / len(windows)


def test_profile_matches_a_direct_computation_and_round_trips(tmp_path):
    model = six_layer_llama()
    windows = [random_prompt(32, seed=10 + i)[0] for i in range(3)]
    profile = compute_kascade_profile(model, windows, n_anchors=2, topk=6, sparse=atskv.sparse, queries=5,
                                      dense_layers=1, model_name="six-layer")
    heads, importance = direct_profile_parts(model, windows, queries=5, topk=6)
    best, best_head = heads.max(dim=1)
    similarity = best.mean(-1)
    assert profile.managed_layers == [1, 2, 3, 4, 5]
    torch.testing.assert_close(torch.tensor(profile.similarity), similarity, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(profile.importance), importance, atol=1e-4, rtol=0)
    assert float(similarity.min()) < 0.99, "random layers should not all agree"
    anchors = brute_force_anchors(similarity * importance[None, :], 2)
    assert profile.anchors == [1 + a for a in anchors] and profile.anchors[0] == 1
    for layer, heads_of_layer in profile.head_map.items():
        anchor = profile.anchor_of(layer)
        assert heads_of_layer == best_head[anchor - 1, layer - 1].tolist()
    assert sorted(profile.head_map) == sorted(set(range(1, 6)) - set(profile.anchors))

    path = profile.save(tmp_path / "p" / "kascade.json")
    assert KascadeProfile.load(path, model=model) == profile
    selector = make_selector("kascade", profile=str(path))
    assert selector.profile == profile

    other = tiny_model("llama")  # 4 layers instead of 6
    with pytest.raises(ValueError, match="computed for 'six-layer'.*4 layers"):
        KascadeProfile.load(path, model=other)
    with pytest.raises(FileNotFoundError, match="atskv profile kascade"):
        KascadeProfile.load(tmp_path / "missing.json")


def test_default_anchors_are_the_papers_five_or_every_managed_layer_where_fewer():
    """Gemma 3 270M manages only its 3 global layers: the paper's 5 anchors cannot be had, so the
    default takes every managed layer; an explicit count above the managed layers still fails."""
    model = six_layer_llama()
    windows = [random_prompt(32, seed=20)[0]]
    fewer = compute_kascade_profile(model, windows, topk=6, sparse=atskv.sparse, queries=5, dense_layers=3)
    assert fewer.managed_layers == [3, 4, 5] and fewer.anchors == [3, 4, 5] and not fewer.head_map
    five = compute_kascade_profile(model, windows, topk=6, sparse=atskv.sparse, queries=5, dense_layers=0)
    assert len(five.anchors) == 5 and five.anchors[0] == 0 and len(five.head_map) == 1
    with pytest.raises(ValueError, match="between 1 and the 3 managed layers, got 5"):
        compute_kascade_profile(model, windows, n_anchors=5, topk=6, sparse=atskv.sparse, queries=5, dense_layers=3)
