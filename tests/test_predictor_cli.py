"""`atskv collect`, `atskv fit` and `atskv export` chained on a tiny model, then the exported
predictor found by name and used as the `learned` selector."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atskv.data import synthetic_filler
from atskv.errors import InputError
from atskv.eval.recall import attention_recall
from atskv.models import load_model
from atskv.models.identity import config_hash
from atskv.selectors import selectors_for_model
from tests.conftest import COMMON, run_cli, tiny_bpe_tokenizer


def collect_tiny(tmp_path):
    """`atskv collect` of 4 full windows of 96 tokens by a tiny random Llama saved under
    `tmp_path`: (model folder, tokenizer, collection folder, the collect command)."""
    model_dir, corpus = tmp_path / "tiny-llama", tmp_path / "corpus"
    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(synthetic_filler(600, seed=i))
    collected = tmp_path / "collect"
    command = ["collect", "--model", str(model_dir), "--corpus", str(corpus), "--windows", "4",
               "--window_tokens", "96", "--decision_points", "[0.5]", "--future_queries", "8", "--topk", "8",
               "--full_windows", "4", "--out", str(collected), "--device", "cpu"]  # fmt: skip
    assert run_cli(command) == 0
    return model_dir, tokenizer, collected, command


def fit_command(collected, tmp_path) -> list[str]:
    return ["fit", "--config", "configs/fit.yaml", "--data.folder", str(collected), "--data.num_workers", "0",
            "--data.batch_size", "256", "--data.validation_fraction", "0.25", "--trainer.max_epochs", "1",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path / "fit"),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "fit")]  # fmt: skip


def test_collect_fit_export_then_the_learned_selector_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path / "cache"))
    model_dir, tokenizer, collected, _ = collect_tiny(tmp_path)
    assert run_cli(fit_command(collected, tmp_path)) == 0
    assert next((tmp_path / "fit").rglob("last.ckpt"))
    assert (tmp_path / "fit" / "collect" / "version_0").is_dir(), "the run is named after the collection"
    # every window full: kept by window recall
    checkpoint = next((tmp_path / "fit").rglob("epoch0-window_recall*.ckpt"))
    assert f"next: atskv export {checkpoint}" in capsys.readouterr().out, "fit points at the best checkpoint"
    assert run_cli(["export", str(checkpoint), "--model", str(model_dir)]) == 0
    loaded = load_model(str(model_dir))
    (learned,) = selectors_for_model(["learned"], loaded.name)
    assert learned.predictor.header.managed_layers == (2, 3)
    assert learned.predictor.header.config_hash == config_hash(loaded.model), "export records the base model"
    training = learned.predictor.header.training
    assert training["stage"] == "fit" and training["hyperparameters"]["lr"] == 1e-3 and "started_from" not in training
    windows = torch.randint(3, len(tokenizer), (2, 64))
    report = attention_recall(loaded.model, windows, [learned], [16], n_queries=4, progress=False)
    recalls = [r.recall for r in report.records if r.selector == "learned"]
    assert recalls and all(0 < r <= 1 for r in recalls)


@pytest.mark.parametrize("received", [True, False])
def test_the_vllm_fit_config_makes_a_predictor_the_plugin_runs(tmp_path, received):
    """`--config configs/fit-vllm.yaml` over fit.yaml: the exported predictor reads only what an
    attention backend sees, so the plugin's learned selector takes it (and computes the prompt's
    received mass only if the predictor reads the attention received)."""
    from atskv.runtime.vllm.learned import engine_predictor
    from atskv.runtime.vllm.selection import PagedLearned

    model_dir, _, collected, _ = collect_tiny(tmp_path)
    without = [] if received else ["--model.without", "[hidden_norm, token_type, attention, prev_attention]"]
    assert run_cli([*fit_command(collected, tmp_path), "--config", "configs/fit-vllm.yaml", *without]) == 0
    out = tmp_path / "predictor"
    assert run_cli(["export", str(next((tmp_path / "fit").rglob("last.ckpt"))), "--model", str(model_dir),
                    "--out", str(out)]) == 0  # fmt: skip
    engine_predictor.cache_clear()
    selector = PagedLearned(predictor=str(out))
    assert selector.loaded.mlp.projected_width == 0
    assert selector.scores_mass == received


def test_a_truncated_shard_is_collected_again_and_refused_by_fit_in_one_line(tmp_path, capsys):
    """A rerun of `collect` over a truncated shard makes it again (the same bytes as before); `fit`
    on a truncated shard is one line naming the file, exit code 2, and leaves no run folder."""
    _, _, collected, command = collect_tiny(tmp_path)
    shard = collected / "shard-2.safetensors"
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 2])
    assert run_cli(command) == 0
    assert shard.read_bytes() == intact
    shard.write_bytes(intact[: len(intact) // 2])
    capsys.readouterr()
    assert run_cli(fit_command(collected, tmp_path)) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"atskv: error: {shard}: damaged shard (")
    assert not [line for line in err if "Traceback" in line]
    assert not (tmp_path / "fit").exists() or not any((tmp_path / "fit").rglob("version_*"))


def test_the_learned_selector_without_an_exported_predictor_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="no predictor for 'some-model'.*atskv export"):
        selectors_for_model(["learned"], "some-model")


def test_a_users_export_wins_over_the_shipped_predictor(tmp_path, monkeypatch):
    from atskv.predictor import export

    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(export, "SHIPPED", tmp_path / "shipped")
    (tmp_path / "shipped" / "m").mkdir(parents=True)
    (tmp_path / "shipped" / "m" / "predictor.safetensors").write_bytes(b"")
    assert export.find_predictor("m") == tmp_path / "shipped" / "m"
    own = export.default_predictor_dir("m")
    own.mkdir(parents=True)
    (own / "predictor.safetensors").write_bytes(b"")
    assert export.find_predictor("m") == own
    assert export.find_predictor("other") == export.default_predictor_dir("other")


def test_the_shipped_smollm2_predictor_loads_and_fits_the_embedded_model():
    from atskv.predictor.export import SHIPPED, load_predictor

    predictor = load_predictor(SHIPPED / "smollm2-135m")
    assert predictor.header.base_model == "smollm2-135m"
    assert predictor.header.geometry.num_layers == 30 and predictor.header.managed_layers[0] == 2
    assert 100_000 <= predictor.mlp.parameter_count() <= 500_000


def test_every_shipped_predictor_is_found_by_its_named_model():
    """A shipped predictor's folder is the named model it serves (what `find_predictor` looks up),
    and its header says so: Gemma 3's manages exactly the model's global layers."""
    from atskv.models.loading import MODELS
    from atskv.predictor.export import SHIPPED, find_predictor, load_predictor

    folders = sorted(p.name for p in SHIPPED.iterdir() if (p / "predictor.safetensors").is_file())
    assert folders == ["gemma3-270m", "smollm2-135m"]
    headers = {name: load_predictor(SHIPPED / name).header for name in folders}
    for name, header in headers.items():
        assert name in MODELS and find_predictor(name) == SHIPPED / name
        assert header.base_model == name
    gemma = headers["gemma3-270m"]
    globals_ = [i for i, kind in enumerate(gemma.geometry.layer_types) if kind == "full_attention"]
    assert list(gemma.managed_layers) == globals_ == [5, 11, 17]


@pytest.mark.parametrize(
    ("monitor", "best", "exported"),
    [("val/window_recall", "b.ckpt", "b.ckpt"), ("val/mass_recall", "b.ckpt", "l.ckpt"), (None, "", "l.ckpt")],
)
def test_fit_points_at_the_best_checkpoint_only_where_whole_windows_chose_it(capsys, monitor, best, exported):
    """The sampled mass recall a collection without full windows falls back on is near 1 throughout,
    so its 'best' is no better than the last checkpoint; fine-tuning keeps no monitor."""
    from types import SimpleNamespace

    from atskv.cli.predictor import wrote_checkpoints

    callback = SimpleNamespace(monitor=monitor, best_model_path=best, last_model_path="l.ckpt", dirpath="d")
    wrote_checkpoints(SimpleNamespace(checkpoint_callback=callback))
    assert capsys.readouterr().out.strip().endswith(f"next: atskv export {exported}")


def test_the_shipped_predictors_headers_name_no_local_paths():
    """A shipped header says what it was trained on, not a folder on the machine that trained it."""
    from atskv.predictor.export import SHIPPED, load_predictor

    for folder in sorted(p for p in SHIPPED.iterdir() if (p / "predictor.safetensors").is_file()):
        training = load_predictor(folder).header.training
        for value in (training["checkpoint"], training["data"]["folder"]):
            assert not value.startswith(("/", "~")) and "/tmp/" not in value, (folder.name, value)
        assert "austen and moby-dick" in training["data"]["folder"]
