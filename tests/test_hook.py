"""The sparse-attention hook on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import atskv
from atskv.models.cache_names import returned_cache, with_cache
from atskv.slot_cache import SlotLayer
from tests.conftest import EVERY_TOKEN, random_prompt, tiny_model

DECODE_STEPS = 32


def greedy(model, ids, attention_mask=None, steps=DECODE_STEPS):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=attention_mask if attention_mask is not None else torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences, torch.stack(out.logits, dim=1)  # logits [B, steps, V]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(("selector", "sparse_prefill"), [("dense", False), ("oracle", True)])
def test_keep_all_matches_unpatched_model(family, selector, sparse_prefill):
    """Keeping every token (dense selector, or oracle with a budget above the context) reproduces
    the unpatched model's prefill and 32 greedy decode steps, every layer managed."""
    model = tiny_model(family)
    ids = random_prompt(24)
    ref_seq, ref_logits = greedy(model, ids)
    with torch.no_grad():
        ref_prefill = model(ids).logits
    with atskv.sparse(model, selector, budget=EVERY_TOKEN, dense_layers=0, sparse_prefill=sparse_prefill) as session:
        assert session.managed_layers, "no layer was managed"
        with torch.no_grad():
            prefill = model(ids).logits
        seq, logits = greedy(model, ids)
    assert rel_err(prefill, ref_prefill) <= 1e-5
    assert torch.equal(seq, ref_seq)
    assert rel_err(logits, ref_logits) <= 1e-5
    assert model.config._attn_implementation == "sdpa", "the context manager must restore the implementation"


def _reference_oracle_attention(budget: int, managed: set[int]):
    """Explicit masked attention: KV expanded to the query heads, exact probabilities pooled over
    each KV group, top-`budget` per query among the causal positions, softmax over those."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if module.layer_idx not in managed:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        b, hq, tq, d = query.shape
        hkv, t = key.shape[1], key.shape[2]
        g = hq // hkv
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        allowed = torch.ones(tq, t, dtype=torch.bool).tril(t - tq)
        logits = (query @ k.transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~allowed, float("-inf"))
        pooled = logits.softmax(-1).view(b, hkv, g, tq, t).sum(2)  # per KV head
        top = pooled.masked_fill(~allowed, float("-inf")).topk(min(budget, t), dim=-1).indices
        keep = torch.zeros(b, hkv, tq, t, dtype=torch.bool).scatter_(-1, top, True) & allowed
        keep = keep.repeat_interleave(g, dim=1)
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        return (probs @ v).transpose(1, 2), None

    return attention


def test_oracle_topk_equals_masked_attention_reference(family):
    model = tiny_model(family)
    ids = random_prompt(20, seed=1)
    budget = 6
    with atskv.sparse(model, "oracle", budget=budget, dense_layers=1, sparse_prefill=True) as session:
        seq, logits = greedy(model, ids, steps=12)
        managed = set(session.managed_layers)
    AttentionInterface.register("oracle_reference", _reference_oracle_attention(budget, managed))
    AttentionMaskInterface.register("oracle_reference", sdpa_mask)  # sliding layers need their window mask
    model.set_attn_implementation("oracle_reference")
    ref_seq, ref_logits = greedy(model, ids, steps=12)
    model.set_attn_implementation("sdpa")
    assert torch.equal(seq, ref_seq)
    assert rel_err(logits, ref_logits) <= 1e-5
    _, dense_logits = greedy(model, ids, steps=12)
    assert rel_err(logits, dense_logits) > 1e-3, "a budget of 6 of 20+ tokens should change the logits"


@pytest.mark.parametrize(
    "selector",
    [
        atskv.make_selector("dense"),
        atskv.make_selector("oracle"),
        atskv.make_selector("streaming_llm"),
        atskv.make_selector("snapkv", window=4),  # the window must be shorter than the prompts
        atskv.make_selector("h2o"),
    ],
    ids=lambda s: s.name,
)
def test_batch_with_left_padding_equals_one_at_a_time(family, selector):
    model = tiny_model(family)
    short, long = random_prompt(13, seed=2), random_prompt(21, seed=3)
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    with atskv.sparse(model, selector, budget=10, dense_layers=1):
        seq_b, logits_b = greedy(model, batch, attention_mask=mask, steps=16)
        seq_s, logits_s = greedy(model, short, steps=16)
        seq_l, logits_l = greedy(model, long, steps=16)
    assert torch.equal(seq_b[0, pad:], seq_s[0])
    assert torch.equal(seq_b[1], seq_l[0])
    assert rel_err(logits_b[0], logits_s[0]) <= 1e-4
    assert rel_err(logits_b[1], logits_l[0]) <= 1e-4


def test_cache_holds_kv_heads_not_query_heads(family):
    model = tiny_model(family)
    cfg = model.config
    with atskv.sparse(model, "oracle", budget=4, dense_layers=0) as session:
        greedy(model, random_prompt(12, batch=2), steps=4)
    slot_layers = [layer for layer in session.cache.layers if isinstance(layer, SlotLayer)]
    assert len(slot_layers) == len(session.managed_layers) > 0
    for layer in session.cache.layers:
        assert layer.keys.shape[:2] == (2, cfg.num_key_value_heads)
        assert layer.values.shape[:2] == (2, cfg.num_key_value_heads)
    assert cfg.num_key_value_heads < cfg.num_attention_heads


def test_gemma3_manages_only_global_layers():
    model = tiny_model("gemma3")
    with atskv.sparse(model, "oracle", budget=4, dense_layers=0) as session:
        assert session.managed_layers == {2, 5}
    with atskv.sparse(model, "oracle", budget=4, dense_layers=3) as session:
        assert session.managed_layers == {5}


@pytest.mark.parametrize("selector", ["streaming_llm", "snapkv", "h2o"])
def test_evicting_selectors_hold_budget_and_keep_tokens_intact(selector):
    """Evicting selectors keep at most `budget` tokens per KV head, reuse freed slots, really
    shrink the KV held, and every kept token is bit-identical to the dense cache's copy."""
    model = tiny_model("llama")
    ids = random_prompt(64, seed=4)
    budget = 12

    def prefill_and_decode(cache=None):  # the same calls, so the same float arithmetic
        with torch.no_grad():
            cache = returned_cache(model(ids, **with_cache(model, cache)))
            for t in range(8):  # teacher-forced decode steps
                model(ids[:, t : t + 1], **with_cache(model, cache))
        return cache

    dense_cache = prefill_and_decode()
    with atskv.sparse(model, selector, budget=budget, dense_layers=0) as session:
        prefill_and_decode()
    for idx, layer in enumerate(session.cache.layers):
        assert int(layer.occupied.sum(-1).max()) <= budget
        assert layer.keys.shape[2] <= budget + SlotLayer.min_growth, "buffers were not compacted after eviction"
        pos = layer.slot_pos[..., : layer.length]
        dense_keys = dense_cache.layers[idx].keys
        expected = dense_keys.gather(2, pos.clamp(min=0).unsqueeze(-1).expand(*pos.shape, dense_keys.shape[-1]))
        held = layer.keys[:, :, : layer.length]
        if idx == 0:  # same inputs as the dense run at every step: every kept token bit-identical
            assert torch.equal(held[pos >= 0], expected[pos >= 0])
        else:  # deeper inputs differ after sparse steps (and by float rounding): prompt tokens only
            prompt = (pos >= 0) & (pos < ids.shape[1])
            torch.testing.assert_close(held[prompt], expected[prompt], rtol=1e-4, atol=1e-5)
        assert bool((pos >= ids.shape[1]).any()), "decode tokens should have been written into freed slots"
    assert atskv.kv_bytes(session.cache) < atskv.kv_bytes(dense_cache) / 2


@pytest.mark.parametrize("selector", ["streaming_llm", "snapkv", "h2o"])
def test_fractional_budget_is_a_fraction_of_the_whole_context(selector):
    """A budget of 0.25 keeps a quarter of every token seen, not a quarter of what is left after
    earlier evictions (which would shrink the cache geometrically)."""
    model = tiny_model("llama")
    ids = random_prompt(64, seed=5)
    with atskv.sparse(model, selector, budget=0.25, dense_layers=0) as session:
        with torch.no_grad():
            model(ids)
            held_after_prefill = [int(layer.occupied.sum(-1).max()) for layer in session.cache.layers]
            for t in range(8):
                model(ids[:, t : t + 1], past_key_values=session.cache)
    assert held_after_prefill == [16] * len(held_after_prefill)
    assert all(int(layer.occupied.sum(-1).min()) == 18 for layer in session.cache.layers)  # ceil(0.25 * 72)


def test_streaming_llm_keeps_sinks_and_recent_window():
    model = tiny_model("llama")
    with atskv.sparse(model, "streaming_llm", budget=10, dense_layers=0) as session:
        with torch.no_grad():
            model(random_prompt(40))
    for layer in session.cache.layers:
        kept = sorted(layer.slot_pos[0, 0][layer.slot_pos[0, 0] >= 0].tolist())
        assert kept == [0, 1, 2, 3, 34, 35, 36, 37, 38, 39]


@pytest.mark.parametrize("budget", [0, -3, 0.0, 1.5, "10"])
def test_bad_budget_is_refused_before_any_work(budget):
    model = tiny_model("llama")
    with pytest.raises((ValueError, TypeError), match="budget"):
        with atskv.sparse(model, "oracle", budget=budget):
            pass
    assert model.config._attn_implementation == "sdpa"


def test_unknown_selector_lists_valid_names():
    with pytest.raises(ValueError, match="oracle.*snapkv|snapkv.*oracle"):
        atskv.make_selector("nope")


def test_foreign_cache_is_refused():
    from transformers import DynamicCache

    model = tiny_model("llama")
    with atskv.sparse(model, "oracle", budget=4):
        with pytest.raises(TypeError, match="SparseKVCache"):
            model(random_prompt(5), past_key_values=DynamicCache())


@pytest.mark.slow
def test_real_smollm2_short_prompt():
    """SmolLM2-135M (the embedded default): keep-all equals the unpatched model on a short prompt,
    and an evicting selector holds a fraction of the KV while still generating."""
    from atskv.models import load_model

    loaded = load_model("smollm2-135m")
    model, tok = loaded.model, loaded.tokenizer
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    ref_seq, ref_logits = greedy(model, ids, steps=8)
    with atskv.sparse(model, "dense", budget=EVERY_TOKEN, dense_layers=0):
        seq, logits = greedy(model, ids, steps=8)
    assert torch.equal(seq, ref_seq)
    assert rel_err(logits, ref_logits) <= 1e-5
    assert "Rome" in tok.decode(ref_seq[0, ids.shape[1] :])
    with atskv.sparse(model, "streaming_llm", budget=8) as session:
        greedy(model, ids, steps=8)
    slot_layers = [layer for layer in session.cache.layers if isinstance(layer, SlotLayer)]
    assert len(slot_layers) == 28 and all(int(layer.occupied.sum(-1).max()) <= 8 for layer in slot_layers)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_on_cuda_keep_all_matches_and_bf16_sparse_runs(family):
    model = tiny_model(family).cuda()
    ids = random_prompt(40).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_seq, ref_logits = greedy(model, ids, steps=16)
    with atskv.sparse(model, "dense", budget=EVERY_TOKEN, dense_layers=0):
        seq, logits = greedy(model, ids, steps=16)
    assert torch.equal(seq, ref_seq)
    assert rel_err(logits, ref_logits) <= 1e-5
    model = model.to(torch.bfloat16)
    for selector in ["oracle", "snapkv", "h2o", "streaming_llm"]:
        with atskv.sparse(model, selector, budget=8, dense_layers=0) as session:
            _, logits = greedy(model, ids, steps=8)
        assert torch.isfinite(logits).all()
        assert all(layer.keys.device.type == "cuda" for layer in session.cache.layers)


@pytest.mark.parametrize("base", ["dense", "oracle"])
def test_attention_runs_on_the_selectors_attention_keys(base):
    """A selector that changes the keys attention sees (as SparK does) is honoured on the mask path
    (dense prefill) and on the index path (query-aware decode): the result equals a model whose
    attention function uses the same changed keys."""
    from atskv.selectors import SELECTORS

    class Flipped(SELECTORS[base]):
        def attention_keys(self, view):
            return view.keys.flip(-1)

    def flipped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return sdpa_attention_forward(module, query, key.flip(-1), value, attention_mask, dropout, scaling, **kwargs)

    AttentionInterface.register("flipped_keys", flipped_attention)
    AttentionMaskInterface.register("flipped_keys", sdpa_mask)
    model = tiny_model("llama")
    ids = random_prompt(20)
    model.set_attn_implementation("flipped_keys")
    ref_seq, ref_logits = greedy(model, ids, steps=6)
    model.set_attn_implementation("sdpa")
    with atskv.sparse(model, Flipped(), budget=EVERY_TOKEN, dense_layers=0):
        seq, logits = greedy(model, ids, steps=6)
    assert torch.equal(seq, ref_seq)
    assert rel_err(logits, ref_logits) <= 1e-5


def test_nested_sessions_on_one_model_are_refused_and_the_outer_one_survives():
    model = tiny_model("llama")
    with atskv.sparse(model, "oracle", budget=8) as outer:
        with pytest.raises(RuntimeError, match="already under atskv.sparse"):
            with atskv.sparse(model, "h2o", budget=8):
                pass
        with torch.no_grad():
            model(random_prompt(12))
        assert outer.cache is not None and model.config._attn_implementation == "atskv"
    assert model.config._attn_implementation == "sdpa"


def test_hidden_states_and_token_ids_reach_selectors_that_ask():
    """A selector with `needs_hidden` sees, in every managed layer and step, the attention module's
    input (the normed layer input) of the new tokens and their ids; others see None. The session
    holds the running layer's input alone (every layer's would keep a prompt chunk's activations
    alive through the forward)."""
    from atskv.selectors import SELECTORS

    seen, held, running = [], [], {}

    class Reading(SELECTORS["h2o"]):
        needs_hidden = True

        def scores(self, view):
            seen.append((view.layer_idx, view.hidden.clone(), view.token_ids.clone()))
            held.append((view.layer_idx, set(running["session"].hidden)))
            return super().scores(view)

    model = tiny_model("llama")
    ids = random_prompt(16, seed=2, batch=2)
    # every token kept, so the run's hidden states are the dense model's
    with atskv.sparse(model, Reading(), budget=EVERY_TOKEN, dense_layers=1) as session, torch.no_grad():
        running["session"] = session
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    assert not session.hidden, "captured states must not outlive the session"
    assert held and all(layers == {layer} for layer, layers in held)
    assert not model.model.layers[1].self_attn._forward_pre_hooks, "hooks must be removed"
    with torch.no_grad():
        states = model(out, output_hidden_states=True).hidden_states  # layer inputs, before the norm
    decode = [s for s in seen if s[1].shape[1] == 1]
    assert {s[0] for s in decode} == {1, 2, 3} and len(decode) == 3 * 2  # 2 sparse decode steps
    by_layer = {}
    for layer, hidden, token_ids in decode:
        by_layer.setdefault(layer, []).append((hidden, token_ids))
    for layer, steps in by_layer.items():
        norm = model.model.layers[layer].input_layernorm
        for step, (hidden, token_ids) in enumerate(steps):
            position = ids.shape[1] + step  # decode steps feed the generated tokens one at a time
            assert torch.equal(token_ids, out[:, position : position + 1])
            torch.testing.assert_close(hidden, norm(states[layer][:, position : position + 1]), rtol=1e-4, atol=1e-5)
    with atskv.sparse(model, "h2o", budget=8) as plain, torch.no_grad():
        model(ids)
        assert not plain.hidden


def test_slot_state_with_a_width_follows_its_token_through_eviction_reuse_and_compaction():
    """A `[B, Hkv, S, width]` slot tensor (e.g. a learned selector's projected hidden states) stays
    attached to its token whatever the cache does with the slots."""
    torch.manual_seed(0)
    layer = SlotLayer()
    layer.min_growth = 4
    for step in range(40):
        n = 12 if step == 0 else 1
        keys = torch.randn(2, 3, n, 8)
        layer.update(keys, torch.randn_like(keys))
        state = layer.slot_tensor("snapshot", init=float("nan"), width=8)
        fresh = torch.isnan(state[..., 0]) & layer.occupied
        state[fresh] = layer.keys[:, :, : layer.length][fresh]  # a token's state is written when it enters
        drop = layer.occupied & (torch.rand(layer.occupied.shape) < 0.3)
        layer.evict(drop)
    occupied = layer.occupied
    assert layer.length < layer.seen, "eviction must have freed and reused slots"
    state = layer.slot_tensor("snapshot", width=8)
    assert torch.equal(state[occupied], layer.keys[:, :, : layer.length][occupied])


def test_a_session_object_can_be_entered_again_and_takes_a_numpy_budget():
    """`s = atskv.sparse(...)` entered twice gives a fresh session each time (contextlib's one-shot
    manager raised AttributeError on the second `with`), and a NumPy count is a token budget."""
    import numpy as np

    model, ids = tiny_model("llama"), random_prompt(48)
    for make in (lambda b: atskv.sparse(model, "snapkv", b), lambda b: atskv.tiered(model, "h2o", b, recent=8)):
        session = make(np.int64(32))
        with session as first:
            model(ids)
        with session as second:
            model(ids)
        assert second is not first and second.config.budget == 32 and type(second.config.budget) is int
        assert first.cache.get_seq_length() == second.cache.get_seq_length() == 48
