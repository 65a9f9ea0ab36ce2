"""Exported predictors round-trip exactly, refuse other base models (by config hash, or by shape for
older exports), fail in one line on damaged files, and never overwrite the shipped ones unasked."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from atskv.errors import InputError
from atskv.models import config_hash, model_geometry
from atskv.predictor import export
from atskv.predictor.checkpoints import load_module, read_checkpoint
from atskv.predictor.export import checkpoint_provenance, export_predictor, load_predictor
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from tests.conftest import run_cli, tiny_model

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
    with pytest.raises(InputError, match="no predictor at .*missing.*atskv export"):
        load_predictor(tmp_path / "missing")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "predictor.safetensors"))
    with pytest.raises(ValueError, match="not an atskv predictor"):
        load_predictor(tmp_path)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="3 managed layers given"):
        export_predictor(trained_like(model), torch.zeros(96, dtype=torch.int8), tmp_path / "x", base_model="m",
                         geometry=model_geometry(model.config), managed_layers=[1, 2, 3])


def _export(folder, model, **kwargs):
    return export_predictor(trained_like(model), torch.zeros(96, dtype=torch.int8), folder, base_model="tiny-llama",
                            geometry=model_geometry(model.config), managed_layers=[2, 3], **kwargs)


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import COMMON

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, **overrides})).eval()


def test_the_config_hash_ignores_dtype_and_paths_but_not_vocab_or_rope():
    model = _llama()
    same = _llama().to(torch.bfloat16)
    same.config._name_or_path = "/somewhere/else"
    assert config_hash(same) == config_hash(model) == config_hash(model.config)
    assert config_hash(_llama(vocab_size=128)) != config_hash(model)
    assert config_hash(_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})) != config_hash(model)
    assert config_hash(tiny_model("gemma3")) != config_hash(model)


def test_a_model_with_the_same_shapes_but_another_config_is_refused_naming_both(tmp_path):
    model = _llama()
    _export(tmp_path, model, config=model)
    header = json.loads((tmp_path / "predictor.json").read_text())
    assert header["config_hash"] == config_hash(model)
    other = _llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # same geometry, other RoPE
    other.atskv_name = "other-llama"
    assert model_geometry(other.config) == model_geometry(model.config)
    message = (f"predictor for 'tiny-llama' (config {config_hash(model)}) cannot run on 'other-llama' "
               f"(config {config_hash(other)}); export one for this model")
    with pytest.raises(InputError) as refused:
        load_predictor(tmp_path, model=other)
    assert str(refused.value) == message
    load_predictor(tmp_path, model=_llama())  # the same model, built again, loads


def test_a_predictor_exported_without_the_hash_falls_back_to_the_shape_check(tmp_path):
    model = _llama()
    _export(tmp_path, model)
    assert "config_hash" not in json.loads((tmp_path / "predictor.json").read_text())
    load_predictor(tmp_path, model=_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    with pytest.raises(InputError, match="trained for 'tiny-llama'.*but the model is gemma3"):
        load_predictor(tmp_path, model=tiny_model("gemma3"))


def test_a_config_of_another_geometry_is_refused_at_export(tmp_path):
    with pytest.raises(InputError, match="not the model the predictor was trained on"):
        _export(tmp_path, _llama(), config=tiny_model("gemma3"))


@pytest.mark.parametrize("damage", ["truncate", "scramble", "empty"])
def test_a_damaged_predictor_file_is_one_line_naming_it(tmp_path, damage):
    path = _export(tmp_path, _llama(), config=_llama())
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "scramble":
        path.write_bytes(data[:8] + bytes(reversed(data[8:200])) + data[200:])
    else:
        path.write_bytes(b"")
    with pytest.raises(InputError) as failed:
        load_predictor(tmp_path)
    assert str(path) in str(failed.value) and "\n" not in str(failed.value)


def test_the_shipped_predictors_are_not_overwritten_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "SHIPPED", tmp_path / "shipped")
    target = tmp_path / "shipped" / "tiny-llama"
    with pytest.raises(InputError, match="shipped with atskv.*overwrite=True"):
        _export(target, _llama())
    assert not target.exists()
    _export(target, _llama(), overwrite=True)
    _export(tmp_path / "mine", _llama())  # anywhere else: written where it is told
    assert (target / "predictor.safetensors").is_file() and (tmp_path / "mine" / "predictor.safetensors").is_file()
    assert not list(tmp_path.rglob("*.partial"))


def test_a_damaged_or_missing_checkpoint_is_one_line_naming_it(tmp_path):
    from atskv.predictor.training import RelevanceModule

    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 0.1}, "global_step": 3}, good)
    assert checkpoint_provenance(good)["steps"] == 3
    data = good.read_bytes()
    for name, content in {"truncated.ckpt": data[: len(data) // 2], "garbage.ckpt": b"\x80\x02}q\x00(X" * 40}.items():
        (tmp_path / name).write_bytes(content)
        for read in (read_checkpoint, checkpoint_provenance, lambda p: load_module(RelevanceModule, p)):
            with pytest.raises(InputError) as failed:
                read(tmp_path / name)
            assert name in str(failed.value) and "\n" not in str(failed.value)
    with pytest.raises(InputError, match="missing.ckpt: no such checkpoint"):
        read_checkpoint(tmp_path / "missing.ckpt")
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(InputError, match="not a training checkpoint"):
        read_checkpoint(tmp_path / "list.ckpt")


def test_an_ablated_mlp_round_trips_and_runs_in_the_learned_selector(tmp_path):
    import atskv
    from atskv.features import SCALAR_FEATURES
    from atskv.selectors.learned import LearnedSelector
    from tests.conftest import random_prompt

    model = tiny_model("llama")
    spec = FeatureSpec(model.config.hidden_size, SCALAR_FEATURES, 2, model.config.num_key_value_heads)
    mlp = RelevanceMLP(spec, reduced_width=0, hidden=16, without=["key_norm"]).eval()
    export_predictor(mlp, torch.zeros(96, dtype=torch.int8), tmp_path, base_model="tiny-llama",
                     geometry=model_geometry(model.config), managed_layers=[2, 3])
    loaded = load_predictor(tmp_path, model=model)
    assert loaded.header.kind == "mlp" and loaded.header.widths["without"] == ["key_norm"]
    assert loaded.mlp.arguments() == mlp.arguments()
    with atskv.sparse(model, LearnedSelector(predictor=loaded), budget=8) as session, torch.no_grad():
        model.generate(random_prompt(20), max_new_tokens=3, do_sample=False)
    assert int(session.cache.layers[3].occupied.sum(-1).max()) <= 8


def test_a_text_file_or_a_folder_given_as_a_checkpoint_is_named_plainly(tmp_path, capsys):
    """No advice to unpickle with weights_only=False, and a folder is a folder, not "no such checkpoint"."""
    (tmp_path / "README.md").write_text("# not a checkpoint\n")
    assert run_cli(["export", str(tmp_path / "README.md")]) == 2
    err = capsys.readouterr().err
    assert "weights_only" not in err and "README.md is not a readable checkpoint (UnpicklingError: not a" in err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert run_cli(["export", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"atskv: error: {tmp_path / 'run'} is a folder, not a checkpoint; give a .ckpt "
                                       f"file (it holds {tmp_path / 'run' / 'checkpoints' / 'last.ckpt'})\n")


def test_an_exported_predictor_is_readable_as_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        path = _export(tmp_path, _llama(vocab_size=96))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
