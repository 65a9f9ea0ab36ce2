"""The learned selector: run-time features equal the collection's, it evicts to its budget, it
refreshes on its cadence, and it refuses a predictor made for another model."""

from __future__ import annotations

import logging

import pytest
import torch

import atskv
import atskv.runtime.fast.loop as fast_loop
from atskv.errors import InputError
from atskv.features import SCALAR_FEATURES
from atskv.kernels import learned_features
from atskv.models import model_geometry
from atskv.predictor.export import default_predictor_dir, export_predictor
from atskv.predictor.features import attention_so_far, scalar_features
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.selectors.learned import LearnedSelector
from tests.conftest import EVERY_TOKEN, VOCAB, random_prompt, tiny_model

MANAGED = [2, 3]  # a 4-layer tiny Llama with dense_layers=2


@pytest.fixture
def predictor_dir(tmp_path):
    model = tiny_model("llama")
    torch.manual_seed(1)
    spec = FeatureSpec(model.config.hidden_size, SCALAR_FEATURES, len(MANAGED), model.config.num_key_value_heads)
    mlp = RelevanceMLP(spec, reduced_width=8, hidden=16).eval()
    types = torch.randint(0, spec.num_token_types, (VOCAB,), dtype=torch.int8)
    export_predictor(mlp, types, tmp_path, base_model="tiny-llama", geometry=model_geometry(model.config),
                     managed_layers=MANAGED)
    return tmp_path


class Capturing(LearnedSelector):
    def features(self, view):
        features = super().features(view)
        self.captured = getattr(self, "captured", {})
        self.captured[view.layer_idx] = (features, view.keys.clone(), view.hidden.clone())
        return features


def test_run_time_features_equal_the_collections(predictor_dir):
    model = tiny_model("llama")
    ids = random_prompt(20, seed=4, batch=2)
    selector = Capturing(predictor=predictor_dir)
    with atskv.sparse(model, selector, budget=EVERY_TOKEN, dense_layers=2), torch.no_grad():
        model(ids)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(ids, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    t, hkv = ids.shape[1] - 1, model.config.num_key_value_heads
    previous = None
    for layer in MANAGED:
        p = probs[layer]
        pooled = p.view(p.shape[0], hkv, -1, *p.shape[-2:]).mean(2)
        attention = attention_so_far(pooled, t)
        features, keys, hidden = selector.captured[layer]
        expected = scalar_features(attention, previous, hidden, keys, t)
        torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)
        previous = attention.mean(1)


def test_evicts_to_its_budget_and_left_padding_does_not_change_a_rows_choice(predictor_dir):
    model = tiny_model("llama")
    ids = random_prompt(30, seed=5, batch=2)
    budget = 12

    def run(batch, mask):
        with atskv.sparse(model, LearnedSelector(predictor=predictor_dir, refresh_every=4), budget=budget) as s:
            with torch.no_grad():
                out = model.generate(batch, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                                     do_sample=False, pad_token_id=0)
            held = int(s.cache.layers[3].occupied.sum(-1).max())
        return out, held

    alone, held = run(ids[:1, 5:], torch.ones_like(ids[:1, 5:]))
    assert held <= budget
    padded = ids.clone()
    padded[0, :5] = 0
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    batched, _ = run(padded, mask)
    assert torch.equal(batched[0, 5:], alone[0])


def test_scores_refresh_every_n_steps_and_new_tokens_wait_at_plus_inf(predictor_dir):
    model = tiny_model("llama")
    ids = random_prompt(16, seed=6)
    selector = LearnedSelector(predictor=predictor_dir, refresh_every=3)
    snapshots = []
    with atskv.sparse(model, selector, budget=EVERY_TOKEN) as s, torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            snapshots.append(s.cache.layers[3].slot_tensor("learned_score").clone())
    prompt = slice(0, ids.shape[1])
    assert torch.isinf(snapshots[0][..., -1]).all(), "a new token waits at +inf for the next refresh"
    assert torch.equal(snapshots[0][..., prompt], snapshots[1][..., prompt]), "no refresh before 3 steps"
    assert not torch.equal(snapshots[1][..., prompt], snapshots[2][..., prompt]), "refresh at step 3"
    assert torch.isfinite(snapshots[2]).all()


def test_refresh_every_zero_scores_the_prompt_once_and_keeps_every_generated_token(predictor_dir):
    """`refresh_every` 0, as the vLLM plugin runs by default: the prompt's scores never change after
    its end, every generated token waits at +inf for good, the fast path gives the reference's
    tokens, and a negative count or a bool is refused."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = random_prompt(16, seed=6)
    snapshots = []
    with atskv.sparse(model, LearnedSelector(predictor=predictor_dir, refresh_every=0), budget=EVERY_TOKEN) as s, \
            torch.no_grad():  # fmt: skip
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            snapshots.append(s.cache.layers[3].slot_tensor("learned_score").clone())
    prompt = slice(0, ids.shape[1])
    assert all(torch.equal(snapshots[0][..., prompt], later[..., prompt]) for later in snapshots[1:])
    assert torch.isinf(snapshots[-1][..., ids.shape[1] :]).all() and torch.isfinite(snapshots[-1][..., prompt]).all()
    ids = random_prompt(100, seed=3)
    with torch.no_grad(), atskv.sparse(model, LearnedSelector(predictor=predictor_dir, refresh_every=0), 0.2,
                                       dense_layers=2):  # fmt: skip
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    fast = atskv.generate(model, ids, LearnedSelector(predictor=predictor_dir, refresh_every=0), 0.2,
                          max_new_tokens=8, dense_layers=2, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, expected)
    for bad in (-1, True):
        with pytest.raises(ValueError, match="refresh_every"):
            LearnedSelector(predictor=predictor_dir, refresh_every=bad)


def test_window_share_keeps_what_the_prompts_last_queries_attend_most_through_every_refresh(predictor_dir):
    """The pinned tokens are SnapKV's top votes (the window first), held at +inf after refreshes
    that rescore everything else; with no share the same predictor drops some of them, so the
    option changes what is kept rather than agreeing with the predictor by chance."""
    from atskv.selectors.snapkv import SnapKVSelector

    model = tiny_model("llama")
    ids = random_prompt(60, seed=7)
    budget, share = 16, 0.5

    def held_positions(selector):
        with atskv.sparse(model, selector, budget=budget) as s, torch.no_grad():
            model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0)
            layer = s.cache.layers[3]
            held = layer.slot_pos[0, :, : layer.occupied.shape[-1]]
            return [set(held[h][layer.occupied[0, h]].tolist()) for h in range(held.shape[0])]

    with atskv.sparse(model, SnapKVSelector(window=4), budget=EVERY_TOKEN) as s, torch.no_grad():
        model(ids)
        votes = s.cache.layers[3].slot_tensor("snapkv")[0]  # [Hkv, T]: SnapKV's score, slot = position
    pinned = [set(votes[h].topk(int(share * budget)).indices.tolist()) for h in range(votes.shape[0])]
    shared = held_positions(LearnedSelector(predictor=predictor_dir, refresh_every=3, window_share=share, window=4))
    plain = held_positions(LearnedSelector(predictor=predictor_dir, refresh_every=3))
    assert all(p <= held for p, held in zip(pinned, shared))
    assert not all(p <= held for p, held in zip(pinned, plain))


def test_a_window_share_outside_zero_to_one_or_a_window_the_fast_path_lacks_is_refused(predictor_dir):
    from atskv.selectors.snapkv import SnapKVSelector

    with pytest.raises(ValueError, match="window_share"):
        LearnedSelector(predictor=predictor_dir, window_share=1.5)
    for window in (0, 65):  # the fast path shows `prefill` the prompt's last 64 queries
        with pytest.raises(ValueError, match="1 to 64"):
            LearnedSelector(predictor=predictor_dir, window_share=0.5, window=window)
        with pytest.raises(ValueError, match="1 to 64"):
            SnapKVSelector(window=window)


def _state_by_position(layer, positions: int) -> torch.Tensor:
    """`[B, Hkv, positions, 4]`: each held token's hidden-state norm, kind, received attention and
    score, by position (NaN where not held): the two paths' slot layouts differ."""
    parts = layer.slot_tensor("learned_state")[..., -2:], layer.slot_tensor("learned_received")[..., None]
    state = torch.cat([*parts, layer.slot_tensor("learned_score")[..., None]], -1)
    b, h, s = (layer.slot_pos[..., : state.shape[2]] >= 0).nonzero(as_tuple=True)
    out = torch.full((*state.shape[:2], positions, 4), float("nan"))
    out[b, h, layer.slot_pos[b, h, s]] = state[b, h, s]
    return out


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_the_fast_path_gives_the_reference_tokens_and_state(predictor_dir, monkeypatch, kernels):
    """The fast path as it runs on a GPU (the selector's kernels, `atskv.kernels.learned_features`,
    with the decode write, eviction and attention kernels; Triton's interpreter on the CPU), and
    with their torch references, a left-padded batch refreshing on decode steps 3 and 6, against
    the reference session in torch: the same tokens, and each held token the same state after the
    last step (the fast path's features write restarts a reused slot's received attention and
    score, and the attention kernel adds the mass to them in place)."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = random_prompt(100, seed=3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :20], ids[1, :20] = 0, 0
    with torch.no_grad(), atskv.sparse(model, LearnedSelector(predictor=predictor_dir, refresh_every=3), 0.2,
                                       dense_layers=2) as reference:  # fmt: skip
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    launched, sessions = [], []
    for name in ("write_token_features_triton", "refresh_scores_triton"):
        kernel = getattr(learned_features, name)
        monkeypatch.setattr(learned_features, name, lambda *a, kernel=kernel: launched.append(kernel) or kernel(*a))
    plain_generate = fast_loop._generate
    monkeypatch.setattr(fast_loop, "_generate", lambda model, session, *a: sessions.append(session) or
                        plain_generate(model, session, *a))  # fmt: skip
    monkeypatch.setenv("ATSKV_KERNELS", kernels)
    fast = atskv.generate(model, ids, LearnedSelector(predictor=predictor_dir, refresh_every=3), 0.2,
                          attention_mask=mask, max_new_tokens=8, dense_layers=2, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, expected)
    # 7 decode steps (the first token comes from the prompt) x 2 managed layers, two of them refreshing
    assert len(launched) == (7 * 2 + 2 * 2 if kernels == "triton" else 0)
    for i in MANAGED:
        got, want = (_state_by_position(c.layers[i], fast.shape[1]) for c in (sessions[0].cache, reference.cache))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, equal_nan=True)
        assert torch.isinf(want[..., -1]).any() and (want[..., 2] > 0).any()  # new tokens wait; mass was added


def test_the_fast_path_holds_a_prompt_tokens_features_once_for_all_kv_heads(predictor_dir, monkeypatch):
    """The prompt's projected hidden states, norms and types are the token's, not the KV head's:
    held `[B, 1, S]` while every head holds the whole prompt, each head's own only for the slots it
    keeps after the prompt's eviction (2 KV heads here; 8 at the Llama-3.1-8B shape)."""
    from atskv.runtime.fast.static_cache import StaticSlotLayer

    shapes, shrink = [], StaticSlotLayer.shrink

    def spy(layer, capacity):
        managed = "learned" in layer.state
        before = layer.slot_tensor("learned_state").shape if managed else None
        shrink(layer, capacity)
        if managed:
            shapes.append((before, layer.slot_tensor("learned_state").shape))

    monkeypatch.setattr(StaticSlotLayer, "shrink", spy)
    model = tiny_model("llama")
    atskv.generate(model, random_prompt(100, seed=1), LearnedSelector(predictor=predictor_dir), 0.2,
                   max_new_tokens=2, dense_layers=2, prefill_chunk=64)  # fmt: skip
    assert len(shapes) == len(MANAGED)
    for before, after in shapes:
        assert before[:3] == (1, 1, 100) and after[:2] == (1, 2) and after[2] <= 25  # the budget's slots


def test_a_predictor_for_another_model_or_layout_is_refused(predictor_dir):
    other = tiny_model("gemma3")  # one KV head, head dim 16
    with pytest.raises(ValueError, match="trained for 'tiny-llama'"):
        with atskv.sparse(other, LearnedSelector(predictor=predictor_dir)), torch.no_grad():
            other(random_prompt(8))
    with pytest.raises(ValueError, match="trained for 'tiny-llama'"):  # the fast path checks alike
        atskv.generate(other, random_prompt(8), LearnedSelector(predictor=predictor_dir), 4, max_new_tokens=2)
    with pytest.raises(InputError, match="has no name to find it by"):  # a name: the model's own predictor
        atskv.generate(other, random_prompt(8), "learned", 4, max_new_tokens=2)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="run with the dense_layers"):
        with atskv.sparse(model, LearnedSelector(predictor=predictor_dir), dense_layers=1), torch.no_grad():
            model(random_prompt(8))
    with pytest.raises(ValueError, match="needs an exported predictor"):
        LearnedSelector()


def test_a_threshold_keeps_what_the_predictor_rates_above_it_with_the_budget_as_a_cap(predictor_dir):
    """With `threshold`, a row keeps its tokens whose logit exceeds it (at most the budget), so rows
    keep different amounts; without one every row fills its budget."""
    model = tiny_model("llama")
    ids = random_prompt(40, seed=7, batch=2)

    def held(**options):
        selector = LearnedSelector(predictor=predictor_dir, **options)
        with atskv.sparse(model, selector, budget=30, dense_layers=2) as s, torch.no_grad():
            model(ids)
            layer = s.cache.layers[3]
            return layer.occupied, layer.slot_tensor("learned_score")

    occupied, score = held()
    assert (occupied.sum(-1) == 30).all()
    threshold = score[occupied].float().median().item()  # about half of each row's tokens rate above it
    kept, score_t = held(threshold=threshold)
    torch.testing.assert_close(score_t, score)  # the same scores: only what is kept differs
    above = occupied & (score > threshold)
    assert torch.equal(kept, above), "exactly the held tokens above the threshold stay"
    counts = kept.sum(-1)
    assert (counts < 30).all() and counts.unique().numel() > 1, "rows keep different amounts, under the cap"
    capped, _ = held(threshold=-1e9)  # everything is above it: the budget is the cap
    assert torch.equal(capped, occupied)


def _export_for(model, folder, name: str = "tiny-llama") -> None:
    """A predictor for `model` as `atskv export` writes it: with the model's config hash."""
    torch.manual_seed(1)
    spec = FeatureSpec(model.config.hidden_size, SCALAR_FEATURES, len(MANAGED), model.config.num_key_value_heads)
    export_predictor(RelevanceMLP(spec, reduced_width=8, hidden=16).eval(), torch.zeros(VOCAB, dtype=torch.int8),
                     folder, base_model=name, geometry=model_geometry(model.config), managed_layers=MANAGED,
                     config=model, training={"data": {"folder": "data/collect-austen"}})


def test_sparse_and_tiered_by_name_find_the_models_exported_predictor(tmp_path, monkeypatch):
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    model = tiny_model("llama")
    model.atskv_name = "tiny-llama"  # what load_model records
    _export_for(model, default_predictor_dir("tiny-llama"))
    ids = random_prompt(64, seed=3)
    with atskv.sparse(model, "learned", 0.25) as session, torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert isinstance(session.selector, LearnedSelector)
    assert session.selector.predictor.header.base_model == "tiny-llama"
    assert int(session.cache.layers[MANAGED[0]].occupied.sum(-1).max()) <= 17, "it evicted to its budget"
    tiering = dict(sinks=2, recent=8, refresh_every=4)
    with atskv.tiered(model, selector="learned", budget=0.5, **tiering) as session, torch.no_grad():
        model.generate(ids, max_new_tokens=20, do_sample=False)
    assert isinstance(session.selector, LearnedSelector) and session.cache.stats.demoted_tokens > 0


def test_load_model_records_the_name_the_predictor_is_found_by(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from atskv.models import load_model, model_name
    from tests.conftest import COMMON, tiny_bpe_tokenizer

    tokenizer = tiny_bpe_tokenizer()
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(tmp_path / "my-llama")
    tokenizer.save_pretrained(tmp_path / "my-llama")
    loaded = load_model(tmp_path / "my-llama")
    assert model_name(loaded.model) == loaded.name == "my-llama"
    assert model_name(tiny_model("llama")) is None


def test_a_model_without_a_predictor_is_told_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    model = tiny_model("llama")
    with pytest.raises(InputError, match="no name to find it by.*load_model.*LearnedSelector\\(predictor=PATH\\)"):
        atskv.sparse(model, "learned", 0.1).__enter__()
    model.atskv_name = "unknown-model"
    with pytest.raises(InputError, match="no predictor for 'unknown-model'.*atskv export"):
        atskv.tiered(model, selector="learned").__enter__()


def test_a_hashed_predictor_refuses_a_model_of_equal_shapes_before_any_forward(tmp_path):
    model = tiny_model("llama")
    _export_for(model, tmp_path)
    other = tiny_model("llama")
    other.config.vocab_size = VOCAB + 1  # same geometry, another vocabulary
    other.atskv_name = "other-llama"
    selector = LearnedSelector(predictor=tmp_path)
    with pytest.raises(InputError, match="predictor for 'tiny-llama' \\(config \\w+\\) cannot run on 'other-llama'"):
        atskv.sparse(other, selector, 0.5).__enter__()
    with atskv.sparse(model, selector, 0.5), torch.no_grad():
        model(random_prompt(8))


def test_loading_logs_one_line_with_path_base_model_and_training_data(tmp_path, caplog):
    model = tiny_model("llama")
    _export_for(model, tmp_path)
    with caplog.at_level(logging.INFO, logger="atskv"):
        LearnedSelector(predictor=tmp_path)
    (record,) = [r for r in caplog.records if r.name == "atskv"]
    line = record.getMessage()
    assert str(tmp_path) in line and "'tiny-llama'" in line and "data/collect-austen" in line and "\n" not in line
    assert line.endswith("(best measured: window_share 0.5, --selector_options '{learned: {window_share: 0.5}}')")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="atskv"):
        LearnedSelector(predictor=tmp_path, window_share=0.5)
    assert "best measured" not in caplog.records[0].getMessage()


@pytest.mark.slow
def test_real_smollm2_runs_the_shipped_predictor_by_name(caplog):
    from atskv.models import load_model

    lm = load_model("smollm2-135m")
    ids = lm.tokenizer(" ".join(["The cat sat on the mat."] * 40), return_tensors="pt").input_ids
    with caplog.at_level(logging.INFO, logger="atskv"):
        with atskv.sparse(lm.model, "learned", 0.1) as session, torch.no_grad():
            lm.model.generate(ids, max_new_tokens=4, do_sample=False)
        with atskv.tiered(lm.model, selector="learned", budget=0.5) as tiered, torch.no_grad():
            lm.model.generate(ids, max_new_tokens=4, do_sample=False)
    assert session.selector.predictor.header.config_hash is not None, "the shipped header records the config"
    assert isinstance(tiered.selector, LearnedSelector)
    assert any("shipped/smollm2-135m" in r.getMessage() for r in caplog.records)
