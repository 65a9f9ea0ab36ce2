"""A composition `residency+attention` (`learned+sparq`, `h2o+quest`, ...) under `atskv.tiered`:
the residency part ranks the active tier for demotion at the residency budget (the GPU tier), the
attention part picks what each decode query reads among the active tokens at the session's budget,
beside the retrieved parked candidates. With every token resident and retrieval off it decodes
as the composition does under `atskv.sparse`; with a tight budget a query reads fewer tokens than
the tier holds; bad combinations fail before any work."""

from __future__ import annotations

import re

import pytest
import torch

import atskv
import atskv.runtime.reference.tiered as tiered_module
from atskv.eval.perplexity import evaluate_perplexity
from atskv.runtime.reference.sparsity import LayerPolicy
from atskv.runtime.reference.tiered import TieredSession
from atskv.runtime.reference.tiered_cache import TierStats
from atskv.selectors import make_selector
from atskv.selectors.base import LayerView, select_top_budget
from atskv.selectors.hybrid import HybridSelector
from atskv.selectors.learned import LearnedSelector
from atskv.slot_cache import SlotLayer
from tests.conftest import EVERY_TOKEN, random_prompt, tiny_model
from tests.test_hybrid import MANAGED
from tests.test_hybrid import predictor_dir as hybrid_predictor_dir

predictor_dir = hybrid_predictor_dir  # the fixture: an exported predictor for the tiny Llama

GENERATE = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
# moves on a 64-token prompt: the GPU tier holds 40 (the residency), a query reads 8 of them
TIGHT = dict(sinks=2, recent=8, refresh_every=4, retrieve=8)


def composition(name: str, predictor_dir=None, **options) -> HybridSelector:
    learned = {"learned": {"predictor": predictor_dir, "refresh_every": 2}} if name.startswith("learned") else {}
    return make_selector(name, **learned, **options)


def keep_everything() -> dict:
    """Tiering that parks nothing: the tier's cap is beyond the context, and the only rebalance is
    the prompt's end, where every token keeps (momentum starts at 1)."""
    return dict(policy=LayerPolicy(beta=1e-9, q_min=0.0, q_max=0.0), sinks=4, recent=8, refresh_every=1000, retrieve=0)


@pytest.mark.parametrize("name", ["h2o+sparq", "learned+sparq", "snapkv+quest", "streaming_llm+oracle"])
def test_with_every_token_resident_and_retrieval_off_it_decodes_as_under_sparse(name, predictor_dir):
    model = tiny_model("llama")
    prompt = random_prompt(48, seed=1, batch=2)
    with torch.no_grad():
        with atskv.sparse(model, composition(name, predictor_dir, residency_budget=EVERY_TOKEN), budget=5):
            sparse = model.generate(prompt, **GENERATE)
        chosen = composition(name, predictor_dir, residency_budget=EVERY_TOKEN)
        with atskv.tiered(model, chosen, budget=5, **keep_everything()) as session:
            tiered = model.generate(prompt, **GENERATE)
        dense = model.generate(prompt, **GENERATE)
    assert vars(session.cache.stats) == vars(TierStats()), "nothing moved"
    assert torch.equal(tiered.sequences, sparse.sequences)
    assert torch.equal(torch.stack(tiered.logits), torch.stack(sparse.logits))
    assert not torch.allclose(torch.stack(tiered.logits), torch.stack(dense.logits)), "5 tokens a query: not dense"


class Recorder:
    """What attention really reads in the tiered session's managed layers: for every decode call,
    the active slots it attends and the active slots the layer holds (`[B, Hkv]` counts each), and
    the retrieved candidates attended beside them."""

    def __init__(self, monkeypatch):
        self.attended: list[torch.Tensor] = []
        self.held: list[torch.Tensor] = []
        self.fetched = 0
        recorder, grouped, sdpa, attend = self, tiered_module.attention_and_mass, tiered_module.sdpa_attention, None

        def note(query, mask):
            if query.shape[2] == 1:
                recorder.attended.append(mask[:, :, -1].sum(-1))

        class Stream(tiered_module.StreamedAttention):
            def add(self, keys, values, mask):
                if self.peak is None:  # the first block is the active tier
                    note(self.query, mask)
                else:
                    recorder.fetched += int(mask.sum())
                super().add(keys, values, mask)

        def recorded_attend(session, module, query, *args):
            if query.shape[2] == 1:
                recorder.held.append(session.cache.layers[module.layer_idx].occupied.sum(-1))
            return attend(session, module, query, *args)

        attend = TieredSession.attend
        monkeypatch.setattr(tiered_module, "StreamedAttention", Stream)
        monkeypatch.setattr(tiered_module, "attention_and_mass", lambda q, k, v, m, *a, **kw: note(q, m) or
                            grouped(q, k, v, m, *a, **kw))  # fmt: skip
        monkeypatch.setattr(tiered_module, "sdpa_attention", lambda q, k, v, m, *a: note(q, m) or sdpa(q, k, v, m, *a))
        monkeypatch.setattr(TieredSession, "attend", recorded_attend)


@pytest.mark.parametrize("name", ["learned+sparq", "h2o+quest"])
def test_a_query_reads_its_budget_among_a_fuller_gpu_tier_plus_the_retrieved_tokens(name, predictor_dir, monkeypatch):
    model = tiny_model("llama")
    recorder = Recorder(monkeypatch)
    selector = composition(name, predictor_dir, residency_budget=40)
    with torch.no_grad(), atskv.tiered(model, selector, budget=8, **TIGHT) as session:
        out = model.generate(random_prompt(64, seed=2, batch=2), max_new_tokens=16, do_sample=False)
    assert out.shape == (2, 80)
    stats = session.cache.stats
    assert stats.demoted_tokens > 0 and stats.read_tokens > 0 and recorder.fetched > 0
    steps = 15 * len(MANAGED)  # the first new token comes from the prompt's forward
    assert len(recorder.attended) == len(recorder.held) == steps
    for attended, held in zip(recorder.attended, recorder.held):
        assert (attended == 8).all(), "a query reads its attention budget of the GPU tier"
        assert (held <= 40).all() and (held > 8).all(), "the GPU tier holds up to the residency budget"
    assert max(int(h.min()) for h in recorder.held) >= 32


def test_a_plain_selector_still_reads_the_whole_gpu_tier(monkeypatch):
    model = tiny_model("llama")
    recorder = Recorder(monkeypatch)
    with torch.no_grad(), atskv.tiered(model, "h2o", budget=40, **TIGHT):
        model.generate(random_prompt(64, seed=2, batch=2), max_new_tokens=8, do_sample=False)
    assert len(recorder.attended) == 7 * len(MANAGED)
    assert all(torch.equal(a, h) for a, h in zip(recorder.attended, recorder.held))


@pytest.mark.parametrize("residency", ["snapkv", "streaming_llm"])
def test_the_residency_part_decides_what_stays_on_the_gpu(residency):
    """A residency part whose scores do not depend on what was attended (SnapKV's prompt scores,
    StreamingLLM's positions) parks and keeps the same tokens as it does alone under atskv.tiered at
    the residency budget, whatever its attention part reads (teacher-forced, retrieval off)."""
    model = tiny_model("llama")
    ids = random_prompt(96, seed=6, batch=2)

    def held(selector, budget):
        with torch.no_grad(), atskv.tiered(model, selector, budget=budget, **{**TIGHT, "retrieve": 0}) as session:
            cache = session.new_cache()
            model(ids[:, :64], past_key_values=cache)
            for t in range(64, 96):
                model(ids[:, t : t + 1], past_key_values=cache)
        assert session.cache.stats.demoted_tokens > 0
        return [session.cache.layers[i].held_positions() for i in MANAGED]

    options = {"snapkv": {"window": 4}, "streaming_llm": {"sinks": 2}}[residency]
    composed = held(make_selector(f"{residency}+oracle", residency_budget=40, **{residency: options}), 6)
    for (gpu, host), (gpu_alone, host_alone) in zip(composed, held(make_selector(residency, **options), 40)):
        assert torch.equal(gpu.sort(-1).values, gpu_alone.sort(-1).values)
        assert torch.equal(host.sort(-1).values, host_alone.sort(-1).values)


class Checking(TieredSession):
    """The tiered session, checking at every decode step that the composition's attention part
    picks what it would pick alone on a fresh cache holding only the active tokens, in position
    order: state it built on an earlier active tier (Quest's page bounds) must not leak after moves."""

    checked = 0

    def attended(self, view, query):
        attended = super().attended(view, query)
        if query.shape[2] == 1:
            assert torch.equal(attended[:, :, -1], alone_on_the_active_tokens(self.selector.attention, view))
            self.checked += 1
        return attended


def alone_on_the_active_tokens(part, view: LayerView) -> torch.Tensor:
    """What `part` picks `[B, Hkv, S]` per row and KV head (each holds its own count) from a cache
    of the slots `view` may attend, in position order, and nothing else."""
    held = view.valid[:, :, -1]
    picked = torch.zeros_like(held)
    group = view.group_size
    for b in range(held.shape[0]):
        for h in range(held.shape[1]):
            slots = held[b, h].nonzero()[:, 0]
            slots = slots[view.slot_pos[b, h, slots].argsort()]
            keys = view.keys[b : b + 1, h : h + 1, slots]
            query = view.query[b : b + 1, h * group : (h + 1) * group]
            valid = torch.ones(1, 1, 1, len(slots), dtype=torch.bool)
            positions = view.slot_pos[b : b + 1, h : h + 1, slots]
            context = view.context[b : b + 1] if view.context.shape[0] > 1 else view.context
            fresh = LayerView(view.layer_idx, query, keys, valid, positions, context, view.scaling, view.budget,
                              SlotLayer())  # fmt: skip
            kept = select_top_budget(part.scores(fresh), valid, view.budget, positions, context)[0, 0, 0]
            picked[b, h, slots] = kept
    return picked


@pytest.mark.parametrize(
    ("family", "batch", "name", "page_size"),
    [
        ("gemma3", 1, "h2o+quest", 4),  # one row, one KV head: the layout changes by moves only
        ("llama", 2, "h2o+quest", 1),  # rows of different lengths: a new token lands inside the packed pages
        ("llama", 2, "h2o+sparq", None),
        # rows of different lengths whose pages hold several tokens: the shorter row's packed tail
        # (keys of slots it may not attend) must not enter its last page's bounds
        ("llama", 2, "h2o+quest", 4),
    ],
)
def test_after_moves_the_attention_part_picks_among_the_active_tokens_alone(family, batch, name, page_size):
    model = tiny_model(family)
    options = {"quest": {"page_size": page_size}} if page_size else {}
    selector = make_selector(name, residency_budget=32, **options)
    session = Checking(model, selector, atskv.SparsityConfig(6), atskv.TieringConfig(32, **TIGHT))
    with torch.no_grad(), tiered_module.attach(model, session):
        model.generate(random_prompt(64, seed=3, batch=batch), max_new_tokens=16, do_sample=False)
    assert session.checked == 15 * len(session.managed_layers)
    stats = session.cache.stats
    assert stats.demoted_tokens > 0 and stats.promoted_tokens > 0, "the active tier changed under the part"


@pytest.mark.parametrize("name", ["learned+sparq", "learned"])
def test_the_learned_part_enters_every_decode_token_with_its_own_hidden_state(predictor_dir, name):
    """Its features are fixed when a token is written (its hidden state); the tiered store ranks
    only every `refresh_every` tokens, and still every token gets its own, as under atskv.sparse
    (alone as in a composition)."""
    model = tiny_model("llama")
    ids = random_prompt(60, seed=4)

    def features(run, **options) -> torch.Tensor:
        if name == "learned":
            selector = make_selector(name, predictor=predictor_dir, refresh_every=2)
        else:
            selector = composition(name, predictor_dir, residency_budget=EVERY_TOKEN)
        budget = EVERY_TOKEN if name == "learned" else 5
        with torch.no_grad(), run(model, selector, budget=budget, **options) as session:
            cache = session.new_cache()
            model(ids[:, :48], past_key_values=cache)
            for t in range(48, 60):
                model(ids[:, t : t + 1], past_key_values=cache)
        layer = session.cache.layers[MANAGED[-1]]
        learned: LearnedSelector = selector if name == "learned" else selector.residency
        by_slot = learned._slots(layer).hidden_norm  # of the tokens held on the GPU, by position
        positions = layer.slot_pos[..., : layer.length]
        order = positions.masked_fill(positions < 0, EVERY_TOKEN).argsort(-1)
        return by_slot.gather(-1, order)[..., : int((positions >= 0).sum(-1).min())]

    sparse = features(atskv.sparse)[..., 48:]
    tiered = features(atskv.tiered, **{**keep_everything(), "refresh_every": 4, "recent": 16})[..., -12:]
    assert len(set(sparse[0, 0].tolist())) == 12
    assert torch.equal(tiered, sparse)


def test_perplexity_of_a_composition_tiered_with_nothing_moved_is_its_perplexity_under_sparse():
    model = tiny_model("llama")
    windows = random_prompt(80, seed=5, batch=2)
    selector = make_selector("h2o+sparq", residency_budget=EVERY_TOKEN)
    common = dict(n_eval=16, progress=False)
    sparse = evaluate_perplexity(model, {80: windows}, [selector], [6], **common)
    tiered = evaluate_perplexity(model, {80: windows}, [selector], [6], tiering=keep_everything(), **common)
    assert tiered[1].perplexity == sparse[1].perplexity != tiered[0].perplexity  # [0]: dense


@pytest.mark.parametrize(
    ("selector", "budget", "message"),
    [
        ("sparq+quest", 8, "'sparq' cannot decide residency"),
        ("h2o+snapkv", 8, "'snapkv' cannot choose among the resident tokens"),
        (lambda: make_selector("h2o+sparq"), 0.25, "h2o+sparq at budget 0.25 keeps every token on the GPU"),
        (lambda: make_selector("h2o+sparq", residency_budget=16), 32, "residency budget 16 is below the attention"),
        (lambda: make_selector("h2o+sparq"), 16, "h2o+sparq holds its residency budget 64 on the GPU: a GPU budget"),
    ],
)
def test_bad_compositions_fail_in_one_line_before_any_work(selector, budget, message):
    model = tiny_model("llama")
    selector = selector if isinstance(selector, str) else selector()
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        with atskv.tiered(model, selector, budget=budget):
            pytest.fail("the session started")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="below the attention"):  # a session built directly refuses too
        TieredSession(model, make_selector("h2o+sparq", residency_budget=16), atskv.SparsityConfig(32),
                      atskv.TieringConfig(100))  # fmt: skip
