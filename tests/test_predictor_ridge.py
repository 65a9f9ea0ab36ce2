"""The ridge scorer: the closed-form fit recovers a known linear relation, an export round-trips
and drives the learned selector (its own weights per layer and KV head), and `atskv ridge` fits
and exports a collection in one command."""

import pytest
import torch
import torch.nn.functional as F

import atskv
from atskv.features import SCALAR_FEATURES
from atskv.models import model_geometry
from atskv.predictor.export import export_predictor, load_predictor
from atskv.predictor.model import FeatureSpec
from atskv.predictor.ridge import RidgeScorer, fit_ridge
from atskv.predictor.shards import ShardWriter
from atskv.selectors.learned import LearnedSelector
from tests.conftest import VOCAB, random_prompt, run_cli, tiny_bpe_tokenizer, tiny_model

MANAGED = [2, 3]  # a 4-layer tiny Llama with dense_layers=2
NEWEST_FIRST = [1, 0, 0, 1]  # per (managed layer, KV head): whether the position scorer keeps the newest


def _linear_collection(folder, spec: FeatureSpec, truth: dict, windows: int = 4, rows: int = 160):
    """Shards whose label score is exp(a known linear function of the scorer's inputs)."""
    g = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, {"feature_spec": spec.to_dict(), "label": "kvzip"})
    units = spec.num_layers * spec.num_kv_heads
    for w in range(windows):
        n = rows * units
        hidden = torch.randn(n, spec.d_model, generator=g).half()
        scalars = torch.rand(n, len(spec.scalar_features), generator=g) * 5 + 2
        types = torch.randint(0, spec.num_token_types, (n,), generator=g)
        unit = torch.arange(units).repeat_interleave(rows)
        log_score = ((F.rms_norm(hidden.float(), (spec.d_model,)) * truth["hidden"][unit]).sum(-1)
                     + (scalars * truth["scalars"][unit]).sum(-1) + truth["types"][unit, types] + truth["bias"][unit])
        score = log_score.exp()
        top = torch.cat([score[unit == u] > score[unit == u].median() for u in range(units)])
        writer.write(f"w{w}", {
            "hidden": hidden, "scalars": scalars, "token_type": types.to(torch.int8),
            "layer": (unit // spec.num_kv_heads).to(torch.int16), "head": (unit % spec.num_kv_heads).to(torch.int8),
            "mass": torch.rand(n, generator=g), "kvzip": score, "in_topk": top, "group": unit + 100 * w,
        })


def test_the_fit_recovers_a_known_linear_relation(tmp_path):
    spec = FeatureSpec(16, SCALAR_FEATURES, num_layers=2, num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    units, f = 4, len(SCALAR_FEATURES)
    truth = {"hidden": torch.randn(units, 16, generator=g) * 0.3, "scalars": torch.randn(units, f, generator=g) * 0.2,
             "types": torch.randn(units, spec.num_token_types, generator=g) * 0.5, "bias": torch.randn(units) - 4}
    _linear_collection(tmp_path, spec, truth)
    fit = fit_ridge(tmp_path, alphas=(1e-6, 10.0), validation_fraction=0.25)
    assert fit.alpha == 1e-6 and fit.validation[1e-6] > 0.999 and fit.validation[10.0] < fit.validation[1e-6]
    scorer = fit.scorer
    torch.testing.assert_close(scorer.hidden_weight, truth["hidden"], atol=1e-3, rtol=0)
    torch.testing.assert_close(scorer.scalar_weight / scorer.scalar_std, truth["scalars"], atol=1e-3, rtol=0)
    n = 50
    hidden, scalars = torch.randn(n, 16).half(), torch.rand(n, f) * 5 + 2
    types, layer, head = torch.randint(0, 8, (n,)), torch.randint(0, 2, (n,)), torch.randint(0, 2, (n,))
    unit = layer * 2 + head
    expected = ((F.rms_norm(hidden.float(), (16,)) * truth["hidden"][unit]).sum(-1)
                + (scalars * truth["scalars"][unit]).sum(-1) + truth["types"][unit, types] + truth["bias"][unit])
    torch.testing.assert_close(scorer(hidden, scalars, types, layer, head), expected, atol=1e-3, rtol=0)


def _position_ridge(model) -> RidgeScorer:
    """Rates a token by its position (keeps the newest) in layer 0 head 0 and layer 1 head 1, by
    minus it (keeps the oldest) in the other two; hidden-state weights random but too small to
    change an order."""
    config = model.config
    scorer = RidgeScorer(FeatureSpec(config.hidden_size, SCALAR_FEATURES, len(MANAGED), config.num_key_value_heads))
    torch.manual_seed(0)
    scorer.hidden_weight.normal_(std=1e-5)
    position = SCALAR_FEATURES.index("position")
    scorer.scalar_weight[:, position] = torch.tensor(NEWEST_FIRST) * 2.0 - 1.0
    return scorer.eval()


def test_an_exported_ridge_scorer_loads_and_drives_the_learned_selector(tmp_path):
    model = tiny_model("llama")
    scorer = _position_ridge(model)
    export_predictor(scorer, torch.zeros(VOCAB, dtype=torch.int8), tmp_path, base_model="tiny-llama",
                     geometry=model_geometry(model.config), managed_layers=MANAGED)
    loaded = load_predictor(tmp_path, model=model)
    assert loaded.header.kind == "ridge" and isinstance(loaded.mlp, RidgeScorer)
    inputs = (torch.randn(6, 64), torch.rand(6, len(SCALAR_FEATURES)), torch.randint(0, 8, (6,)),
              torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([0, 0, 1, 1, 0, 1]))
    assert torch.equal(loaded.mlp(*inputs), scorer(*inputs))
    ids = random_prompt(24, seed=2)
    with atskv.sparse(model, LearnedSelector(predictor=tmp_path), budget=8, dense_layers=2) as s, torch.no_grad():
        model(ids)
    for li, layer in enumerate(MANAGED):
        held = s.cache.layers[layer]
        for h in range(2):
            newest = NEWEST_FIRST[li * 2 + h]
            kept = torch.arange(16, 24) if newest else torch.arange(8)
            assert held.slot_pos[0, h][held.occupied[0, h]].sort().values.tolist() == kept.tolist()
            scores = held.slot_tensor("learned_score")[0, h][held.occupied[0, h]].sort().values
            torch.testing.assert_close(scores, ((kept / 23) * (1 if newest else -1)).sort().values, atol=1e-3, rtol=0)


def test_the_ridge_command_fits_and_exports_a_collection(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from atskv.predictor.collect import collect
    from tests.conftest import COMMON

    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, num_key_value_heads=2,
                                         **{**COMMON, "vocab_size": len(tokenizer)})).eval()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    collect(model, tokenizer, random_prompt(64, batch=3), tmp_path / "data", decision_points=(0.5,),
            future_queries=8, topk=6, progress=False, model_name="tiny")
    assert run_cli(["ridge", str(tmp_path / "data"), "--out", str(tmp_path / "ridge"), "--model",
                    str(tmp_path / "tiny"), "--alphas", "[0.1, 1.0]", "--validation_fraction", "0.34"]) == 0
    header = load_predictor(tmp_path / "ridge", model=model).header
    assert header.kind == "ridge" and header.managed_layers == (2, 3)
    assert header.training["stage"] == "ridge" and set(header.training["validation_mass_recall"]) == {"0.1", "1.0"}


def test_full_windows_change_only_what_picks_the_ridge_penalty(tmp_path):
    """Ridge trains on the `sampled` rows of a collection with full windows, on the windows `atskv
    fit` trains on (the full ones held out first): the same solution as the collection without
    them when those are the same windows; the penalty is then picked by the held-out full
    windows' recall (every row of their groups), not the sampled rows' mass recall."""
    from atskv.predictor.collect import collect
    from atskv.predictor.shards import ShardDataset
    from atskv.predictor.training import mass_recall, training_columns

    kw = {"decision_points": (0.5, 0.75), "future_queries": 8, "topk": 6, "dense_layers": 1, "progress": False}
    model, tokenizer, windows = tiny_model("llama"), tiny_bpe_tokenizer(), random_prompt(64, batch=4)
    plain = collect(model, tokenizer, windows, tmp_path / "plain", **kw)
    full = collect(model, tokenizer, windows, tmp_path / "full", full_windows=4, **kw)
    a, b = (fit_ridge(folder, alphas=(0.1,), validation_fraction=0.25) for folder in (plain, full))
    assert (a.metric, b.metric) == ("mass_recall", "window_recall") and a.validation != b.validation
    for name, value in a.scorer.state_dict().items():
        torch.testing.assert_close(b.scorer.state_dict()[name], value)
    columns = training_columns(ShardDataset(full).meta)
    held = ShardDataset(full, columns).split_by_key(0.25, 0, [f"corpus-w{i}" for i in range(4)])[1]
    rows = held.__getitems__(list(range(len(held))))
    assert rows["full"].all() and not rows["sampled"].all()
    with torch.no_grad():
        preds = b.scorer(rows["hidden"], rows["scalars"], rows["token_type"], rows["layer"], rows["head"])
    assert b.validation[0.1] == pytest.approx(float(mass_recall(preds, rows["mass"], rows["in_topk"], rows["group"])))
