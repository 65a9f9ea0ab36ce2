"""Exported predictors round-trip exactly and refuse other base models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from atskv.models import model_geometry
from atskv.predictor.export import export_predictor, load_predictor
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from tests.conftest import tiny_model

SCALARS = ("attention", "position", "log_age", "hidden_norm", "key_norm", "prev_attention")


def trained_like(model) -> RelevanceMLP:
    torch.manual_seed(0)
    config = model.config
    spec = FeatureSpec(config.hidden_size, SCALARS, num_layers=2, num_kv_heads=config.num_key_value_heads)
    mlp = RelevanceMLP(spec, reduced_width=16, hidden=32)
    mlp.train()
    mlp(torch.randn(64, config.hidden_size), torch.rand(64, len(SCALARS)) * 5, torch.randint(0, 8, (64,)),
        torch.randint(0, 2, (64,)), torch.randint(0, config.num_key_value_heads, (64,)))  # moves the norm statistics
    return mlp.eval()


def test_round_trip_gives_the_same_logits_and_header(tmp_path):
    model = tiny_model("llama")
    mlp = trained_like(model)
    types = torch.randint(0, 8, (model.config.vocab_size,), dtype=torch.int8)
    path = export_predictor(mlp, types, tmp_path, base_model="tiny-llama", geometry=model_geometry(model.config),
                            managed_layers=[2, 3], training={"seed": 0})
    loaded = load_predictor(path.parent, model=model)
    inputs = (torch.randn(5, model.config.hidden_size), torch.rand(5, len(SCALARS)), torch.randint(0, 8, (5,)),
              torch.tensor([0, 1, 0, 1, 1]), torch.tensor([0, 1, 1, 0, 1]))
    with torch.no_grad():
        assert torch.equal(loaded.mlp(*inputs), mlp(*inputs))
    assert torch.equal(loaded.token_types, types)
    assert loaded.header.managed_layers == (2, 3) and loaded.header.training == {"seed": 0}
    readable = json.loads((tmp_path / "predictor.json").read_text())
    assert readable["geometry"]["num_kv_heads"] == 2 and readable["feature_spec"]["scalar_features"] == list(SCALARS)


def test_another_base_model_is_refused_with_both_geometries(tmp_path):
    model = tiny_model("llama")
    export_predictor(trained_like(model), torch.zeros(96, dtype=torch.int8), tmp_path, base_model="tiny-llama",
                     geometry=model_geometry(model.config), managed_layers=[2, 3])
    with pytest.raises(ValueError, match="trained for 'tiny-llama'.*but the model is gemma3"):
        load_predictor(tmp_path, model=tiny_model("gemma3"))


def test_bad_files_and_inconsistent_exports_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="atskv export"):
        load_predictor(tmp_path / "missing")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "predictor.safetensors"))
    with pytest.raises(ValueError, match="not an atskv predictor"):
        load_predictor(tmp_path)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="3 managed layers given"):
        export_predictor(trained_like(model), torch.zeros(96, dtype=torch.int8), tmp_path / "x", base_model="m",
                         geometry=model_geometry(model.config), managed_layers=[1, 2, 3])
