"""Residency + query-aware composition (`learned+sparq`, `h2o+quest`, ...): what it holds and attends,
what it reduces to at the edges, that the recall probe sees what the real run holds, and names."""

from __future__ import annotations

import math

import pytest
import torch

import atskv
from atskv.errors import InputError
from atskv.eval.recall import RecallProbe, attention_recall
from atskv.features import SCALAR_FEATURES
from atskv.models import model_geometry
from atskv.predictor.export import default_predictor_dir, export_predictor
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.runtime.reference.sparse import SparseSession, SparsityConfig, attach
from atskv.selectors import check_selector_names, make_selector, selector_options, selectors_for_model
from atskv.selectors.base import LayerView, select_top_budget
from atskv.selectors.hybrid import HybridBudget, HybridSelector
from atskv.slot_cache import SlotLayer
from tests.conftest import EVERY_TOKEN, VOCAB, random_prompt, tiny_model

MANAGED = [2, 3]  # a 4-layer tiny Llama with dense_layers=2
PROMPT, STEPS = 40, 6


def export_random_predictor(model, folder) -> None:
    """A random predictor for the tiny Llama `model`, as `atskv export` writes one."""
    torch.manual_seed(1)
    spec = FeatureSpec(model.config.hidden_size, SCALAR_FEATURES, len(MANAGED), model.config.num_key_value_heads)
    export_predictor(RelevanceMLP(spec, reduced_width=8, hidden=16).eval(), torch.zeros(VOCAB, dtype=torch.int8),
                     folder, base_model="tiny-llama", geometry=model_geometry(model.config), managed_layers=MANAGED,
                     config=model)  # fmt: skip


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("predictor")
    export_random_predictor(tiny_model("llama"), folder)
    return folder


def hybrid(name: str, predictor_dir, **options) -> HybridSelector:
    learned = {"learned": {"predictor": predictor_dir, "refresh_every": 2}} if name.startswith("learned") else {}
    return make_selector(name, **learned, **options)


class Recording(SparseSession):
    """The real session, recording per decode step and managed layer the positions attended
    and, after the step, the positions held (both `[B, Hkv, seen]` bool)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.attended: list[tuple[int, torch.Tensor]] = []
        self.held: list[torch.Tensor] = []

    def attend_kept(self, view, values, keep):
        if view.query.shape[2] == 1:
            self.attended.append((view.layer_idx, by_position(view.slot_pos, keep[:, :, -1], view.layer.seen)))
        return super().attend_kept(view, values, keep)

    def attend(self, module, *args):
        out = super().attend(module, *args)
        self.held.append(held_positions(self.cache.layers[module.layer_idx]))
        return out


class RecordingProbe(RecallProbe):
    """The recall probe, recording the positions it counts as kept, as `Recording` does."""

    def __init__(self, *args):
        super().__init__(*args)
        self.attended: list[tuple[int, torch.Tensor]] = []

    def _record(self, step, kept):
        self.attended.append((step.view.layer_idx, by_position(step.view.slot_pos, kept[0], step.view.layer.seen)))
        super()._record(step, kept)


def by_position(slot_pos: torch.Tensor, chosen: torch.Tensor, seen: int) -> torch.Tensor:
    """`chosen` slots `[B, Hkv, S]` as a mask over positions `[B, Hkv, seen]`."""
    out = torch.zeros(*slot_pos.shape[:2], seen + 1, dtype=torch.bool)
    return out.scatter_(-1, slot_pos.masked_fill(~chosen, seen), chosen)[..., :seen]


def held_positions(layer) -> torch.Tensor:
    """The positions a slot layer holds, `[B, Hkv, seen]` bool."""
    return by_position(layer.slot_pos[..., : layer.length], layer.occupied, layer.seen)


def teacher_forced(model, session, ids: torch.Tensor, prompt: int = PROMPT) -> torch.Tensor:
    """Dense prefill of `ids[:, :prompt]`, then the rest one token at a time; the decode logits."""
    logits = []
    with attach(model, session), torch.no_grad():
        cache = session.new_cache()
        model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


COMPOSITIONS = ["h2o+sparq", "snapkv+quest", "streaming_llm+oracle", "learned+quest", "learned+sparq"]


@pytest.mark.parametrize("name", COMPOSITIONS)
@pytest.mark.parametrize("budget", [4, 0.1])
def test_holds_at_most_the_residency_and_attends_at_most_the_attention_budget(name, budget, predictor_dir):
    model = tiny_model("llama")
    ids = random_prompt(PROMPT + STEPS, seed=3, batch=2)
    selector = hybrid(name, predictor_dir)
    session = Recording(model, selector, SparsityConfig(budget))
    teacher_forced(model, session, ids)
    residency = selector.budgets(budget).residency  # 4 times the attention budget by default
    assert residency == 4 * budget

    def tokens(fraction_or_count, context: int) -> int:
        return math.ceil(fraction_or_count * context) if isinstance(fraction_or_count, float) else fraction_or_count

    assert len(session.attended) == STEPS * len(MANAGED)
    for i, (_, attended) in enumerate(session.attended):
        context = PROMPT + 1 + i // len(MANAGED)
        assert (attended.sum(-1) == tokens(budget, context)).all(), "it attends its attention budget, no more"
    held = torch.stack([h.sum(-1) for h in session.held]).unflatten(0, (-1, len(MANAGED)))
    for t, step in enumerate(held):  # after the prompt, then after each decode step
        assert (step == tokens(residency, PROMPT + t)).all(), "it holds its residency budget, no more"


@pytest.mark.parametrize("part", ["sparq", "quest", "oracle"])
@pytest.mark.parametrize("residency", ["h2o", "learned"])
def test_with_every_token_resident_it_is_the_query_aware_part_alone(part, residency, predictor_dir):
    model = tiny_model("llama")
    ids = random_prompt(PROMPT + STEPS, seed=4, batch=2)
    alone = teacher_forced(model, SparseSession(model, make_selector(part), SparsityConfig(5)), ids)
    composed = hybrid(f"{residency}+{part}", predictor_dir, residency_budget=EVERY_TOKEN)
    together = teacher_forced(model, SparseSession(model, composed, SparsityConfig(5)), ids)
    torch.testing.assert_close(together, alone)  # alone decodes through the sparse kernel, the hybrid by mask


class Checking(SparseSession):
    """The real session, checking at every decode step that the hybrid attends what its attention
    part alone would choose on a fresh cache holding only the resident tokens."""

    checked = 0

    def attend_kept(self, view, values, keep):
        if view.query.shape[2] == 1:
            assert torch.equal(keep[:, :, -1], alone_on_the_resident_tokens(self.selector.attention, view))
            self.checked += 1
        return super().attend_kept(view, values, keep)


def alone_on_the_resident_tokens(part, view) -> torch.Tensor:
    """What `part` keeps `[B, Hkv, S]` when the cache holds the tokens `view` may attend, in
    position order (every row holds as many: no padding), and nothing else."""
    held = view.valid[:, :, -1]
    order = view.slot_pos.masked_fill(~held, view.layer.seen).argsort(-1)[..., : int(held.sum(-1)[0, 0])]
    keys = view.keys.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, view.keys.shape[-1]))
    valid = torch.ones_like(order, dtype=torch.bool).unsqueeze(2)
    fresh = LayerView(view.layer_idx, view.query, keys, valid, view.slot_pos.gather(-1, order), view.context,
                      view.scaling, view.budget, SlotLayer())  # fmt: skip
    kept = select_top_budget(part.scores(fresh), valid, view.budget, fresh.slot_pos, view.context)[:, :, 0]
    return torch.zeros_like(held).scatter_(-1, order, kept)


@pytest.mark.parametrize("part", ["sparq", "quest", "oracle"])
@pytest.mark.parametrize("residency", ["h2o", "learned"])
def test_it_attends_what_its_query_aware_part_chooses_among_the_resident_tokens(part, residency, predictor_dir):
    """After evictions too: the part's state built on an earlier resident set (Quest's page bounds)
    does not leak into the next step's choice."""
    model = tiny_model("llama")
    ids = random_prompt(PROMPT + STEPS, seed=10, batch=2)
    session = Checking(model, hybrid(f"{residency}+{part}", predictor_dir, residency_budget=24), SparsityConfig(4))
    teacher_forced(model, session, ids)
    assert session.checked == STEPS * len(MANAGED)


@pytest.mark.parametrize("residency", ["snapkv", "streaming_llm"])
def test_it_holds_what_its_residency_part_holds_alone(residency):
    """A residency part that does not observe attention keeps the same tokens whatever the
    attention part attends: the hybrid holds what the part alone holds at the residency budget."""
    model = tiny_model("llama")
    ids = random_prompt(PROMPT + STEPS, seed=5, batch=2)

    def held(selector, budget):
        session = SparseSession(model, selector, SparsityConfig(budget))
        teacher_forced(model, session, ids)
        return [held_positions(session.cache.layers[i]) for i in MANAGED]

    options = {"snapkv": {"window": 4}, "streaming_llm": {"sinks": 2}}[residency]
    composed = held(make_selector(f"{residency}+quest", residency_budget=12, **{residency: options}), 3)
    for together, alone in zip(composed, held(make_selector(residency, **options), 12)):
        assert torch.equal(together, alone)


@pytest.mark.parametrize("name", ["h2o+quest", "learned+quest", "snapkv+sparq", "learned+oracle"])
def test_the_recall_probe_chooses_as_the_real_run(name, predictor_dir):
    """The probe marks evicted slots instead of freeing them and attends densely; in the first
    managed layer (whose queries and keys both runs share) it must still choose exactly what the
    real run, which frees, reuses and compacts slots, attends: evicted tokens are gone in both."""
    model = tiny_model("llama")
    ids = random_prompt(PROMPT + STEPS, seed=6, batch=2)
    config = SparsityConfig(3)
    real = Recording(model, hybrid(name, predictor_dir), config)
    teacher_forced(model, real, ids)
    probe = RecordingProbe(model, hybrid(name, predictor_dir), config)
    teacher_forced(model, probe, ids)
    first = [mask for layer, mask in real.attended if layer == MANAGED[0]]
    probed = [mask for layer, mask in probe.attended if layer == MANAGED[0]]
    assert len(first) == len(probed) == STEPS
    assert sum(int(m.sum()) for m in first) > 0
    for a, b in zip(first, probed):
        assert torch.equal(a, b)
    held_before = real.held[:: len(MANAGED)]  # first managed layer: after the prompt, after each step
    for t, chosen in enumerate(probed):
        evicted = ~torch.nn.functional.pad(held_before[t], (0, 1), value=True)  # the step's new token is held
        assert evicted.any() and not (chosen & evicted).any(), "the probe never counts an evicted token"


def test_recall_of_a_composition_with_every_token_resident_is_the_query_aware_parts():
    model = tiny_model("llama")
    windows = random_prompt(PROMPT + 4, seed=7, batch=2)
    selectors = [make_selector("sparq"), make_selector("h2o+sparq", residency_budget=EVERY_TOKEN),
                 make_selector("h2o+oracle", residency_budget=8), make_selector("oracle")]  # fmt: skip
    report = attention_recall(model, windows, selectors, [2], n_queries=4, progress=False)
    recall = {name: value for (name, _), value in report.mean_over_layers().items()}
    assert recall["h2o+sparq"] == recall["sparq"]
    assert recall["h2o+oracle"] < recall["oracle"], "a token evicted is a token no query can have"


def test_left_padding_does_not_change_a_rows_choice():
    """The attention part sees each row's resident tokens packed from the front, so even Quest's
    pages are those of the row run alone."""
    model = tiny_model("llama")
    ids = random_prompt(30, seed=8, batch=2)

    def run(batch, mask):
        with atskv.sparse(model, make_selector("h2o+quest", residency_budget=20), budget=4) as s, torch.no_grad():
            out = model.generate(batch, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        return out, int(s.cache.layers[3].occupied.sum(-1).max())

    alone, held = run(ids[:1, 5:], torch.ones_like(ids[:1, 5:]))
    assert held == 20
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[0, :5], mask[0, :5] = 0, 0
    batched, _ = run(padded, mask)
    assert torch.equal(batched[0, 5:], alone[0])


def test_budgets_default_to_four_times_the_attention_budget_in_the_same_units():
    assert HybridBudget.of(128) == HybridBudget(128, 512)
    assert HybridBudget.of(0.1) == HybridBudget(0.1, 0.4)
    assert HybridBudget.of(0.25).residency is None, "a fraction that reaches 1 keeps every token"
    assert HybridBudget.of(128, 0.5) == HybridBudget(128, 0.5)
    with pytest.raises(InputError, match="below the attention budget"):
        HybridBudget.of(128, 64)
    for bad in (0, 1.0, -3, True):
        with pytest.raises(InputError, match="bad budget"):
            HybridBudget.of(128, bad)
        with pytest.raises(InputError, match="bad budget"):
            make_selector("h2o+sparq", residency_budget=bad)


def test_names_resolve_through_the_registry_with_each_parts_options(predictor_dir):
    selector = make_selector("learned+sparq", learned={"predictor": predictor_dir, "refresh_every": 4},
                             sparq={"rank_fraction": 0.25}, residency_budget=64)  # fmt: skip
    assert selector.name == "learned+sparq" and selector.residency_budget == 64
    assert selector.residency.refresh_every == 4 and selector.attention.rank_fraction == 0.25
    assert selector.query_aware and selector.evicts and selector.needs_attention and selector.needs_hidden
    check_selector_names(["h2o+quest", "snapkv+oracle", "streaming_llm+sparcas"])
    for name, message in [
        ("sparq+h2o", "'sparq' cannot decide residency"),
        ("h2o+snapkv", "'snapkv' cannot choose among the resident tokens"),
        ("h2o+quest+sparq", "a composition has two parts"),
        ("h2o+nope", "unknown selector 'nope'"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_selector_names([name])
        with pytest.raises(ValueError, match=message):
            make_selector(name)


def test_options_and_the_predictor_reach_the_parts(predictor_dir, tmp_path, monkeypatch):
    names = ["learned", "learned+sparq"]
    options = {"learned+sparq": {"residency_budget": 32, "sparq": {"rank_fraction": 0.5}}}
    by_name = selector_options(names, options, predictor_dir)
    assert by_name == {
        "learned": {"predictor": predictor_dir},
        "learned+sparq": {
            "residency_budget": 32, "sparq": {"rank_fraction": 0.5}, "learned": {"predictor": predictor_dir}
        },
    }
    with pytest.raises(InputError, match="'sparq' has no option 'window'"):
        selector_options(names, {"learned+sparq": {"sparq": {"window": 3}}})
    with pytest.raises(InputError, match="'h2o\\+sparq' has no option 'window'.*residency_budget"):
        selector_options(["h2o+sparq"], {"window": 3})
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))  # the model's own predictor, found by name
    model = tiny_model("llama")
    with pytest.raises(InputError, match="the learned selector is made per model"):
        atskv.sparse(model, "learned+sparq", 0.1).__enter__()
    export_random_predictor(model, default_predictor_dir("tiny-llama"))
    built = selectors_for_model(["learned+quest"], "tiny-llama")[0]
    assert built.residency.predictor.header.base_model == "tiny-llama"
    model.atskv_name = "tiny-llama"
    with atskv.sparse(model, "learned+sparq", 4) as session, torch.no_grad():
        model.generate(random_prompt(40, seed=9), max_new_tokens=3, do_sample=False)
    assert int(session.cache.layers[MANAGED[0]].occupied.sum(-1).max()) == 16



def test_spark_names_its_base_and_the_base_finds_its_per_model_default(tmp_path, monkeypatch):
    """SparK over the learned selector from a command line: the base's options are checked like any
    selector's, and the base finds the model's predictor as `learned` alone does."""
    options = selector_options(["spark"], {"spark": {"base": "learned", "base_options": {"window_share": 0.5}}})
    with pytest.raises(InputError, match="'learned' has no option 'nope'"):
        selector_options(["spark"], {"spark": {"base": "learned", "base_options": {"nope": 1}}})
    with pytest.raises(ValueError, match="unknown selector 'nosuch'"):
        selector_options(["spark"], {"spark": {"base": "nosuch"}})
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    export_random_predictor(tiny_model("llama"), default_predictor_dir("tiny-llama"))
    built = selectors_for_model(["spark"], "tiny-llama", options)[0]
    assert built.base.window_share == 0.5 and built.base.predictor.header.base_model == "tiny-llama"
