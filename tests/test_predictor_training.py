"""`atskv fit`: the Lightning training of the RelevanceMLP on synthetic shards laid out as the
collection writes them (contract4), where mass follows the `attention` feature so it is learnable."""

import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from atskv.predictor.model import FeatureSpec
from atskv.predictor.shards import ShardDataset, ShardWriter
from atskv.predictor.token_types import TOKEN_TYPES
from atskv.predictor.training import (
    MassRecall,
    RelevanceData,
    RelevanceModule,
    WindowRecall,
    fit_main,
    mass_recall,
    pairwise_ranking_loss,
    training_curves,
)

SCALARS = ("attention", "position", "log_age", "hidden_norm", "key_norm", "prev_attention")
SPEC = FeatureSpec(d_model=16, scalar_features=SCALARS, num_layers=2, num_kv_heads=2)
K = 8  # positives per group; as many sampled negatives
SMALL = {"reduced_width": 8, "hidden": 32, "lr": 1e-2}


def write_shards(folder, shards=6, groups=24, seed=0, label="mass") -> dict[str, torch.Tensor]:
    """One shard per window, `groups` groups of 2K rows each; returns all rows concatenated. With
    `label` kvzip the learnable score is the `kvzip` column and `mass` is noise."""
    meta = {"model": "synthetic", "feature_spec": SPEC.to_dict(), "topk": K}
    writer = ShardWriter(folder, {**meta, "label": label} if label != "mass" else meta)
    g = torch.Generator().manual_seed(seed)
    written = []
    for s in range(shards):
        n = groups * 2 * K
        index = torch.arange(groups).repeat_interleave(2 * K)  # group within the shard
        scalars = torch.rand(n, len(SCALARS), generator=g)
        mass = torch.exp(4 * scalars[:, 0] + 0.3 * torch.randn(n, generator=g))
        mass = mass.view(groups, 2 * K)
        mass = mass / mass.sum(1, keepdim=True) * torch.rand(groups, 1, generator=g)  # sampled share of the mass
        in_topk = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, mass.topk(K, dim=1).indices, True)
        rows = {
            "hidden": torch.randn(n, SPEC.d_model, generator=g).half(),
            "scalars": scalars,
            "token_type": torch.randint(0, len(TOKEN_TYPES), (n,), generator=g).to(torch.int8),
            "layer": (index % SPEC.num_layers).to(torch.int16),
            "head": (index // SPEC.num_layers % SPEC.num_kv_heads).to(torch.int8),
            "mass": mass.flatten(),
            "in_topk": in_topk.flatten(),
            "influence": torch.full((n,), float("nan")),
            "group": (s * groups + torch.arange(groups)).repeat_interleave(2 * K),
            "position": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
            "decision": torch.full((n,), 100, dtype=torch.int32),
        }
        if label == "kvzip":
            rows["kvzip"], rows["mass"] = rows["mass"], rows["mass"][torch.randperm(n, generator=g)]
        writer.write(f"synthetic-w{s}", rows)
        written.append(rows)
    return {c: torch.cat([w[c] for w in written]) for c in written[0]}


def random_ranking_recall(rows) -> float:
    """Expected mass recall of a uniformly random ranking: k/n of each group's mass over its top-k mass."""
    mass = rows["mass"].view(-1, 2 * K)
    return float((mass.sum(1) * K / (2 * K) / mass.topk(K, dim=1).values.sum(1)).mean())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    return folder, write_shards(folder)


def test_mass_recall_metric_against_hand_computation():
    # group 7: predicted top-2 = rows 0, 1 (mass 0.6) against the true top-2 (0.8) -> 0.75
    # group 3: predicted top-1 = mass 0.2 against 0.4 -> 0.5; group 5 has no positive: left out
    group = torch.tensor([7, 3, 7, 3, 7, 5, 3, 7])
    mass = torch.tensor([0.5, 0.2, 0.1, 0.4, 0.3, 0.9, 0.1, 0.05])
    in_topk = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    preds = torch.tensor([0.9, 0.5, 0.8, 0.2, 0.1, 3.0, 0.1, 0.0])
    metric = MassRecall()
    metric.update(preds[:3], mass[:3], in_topk[:3], group[:3])  # groups span the two updates
    metric.update(preds[3:], mass[3:], in_topk[3:], group[3:])
    assert metric.compute().item() == pytest.approx(0.625)
    assert mass_recall(mass, mass, in_topk, group).item() == pytest.approx(1.0)
    metric.reset()
    metric.update(-mass, mass, in_topk, group)  # worst ranking
    assert metric.compute().item() == pytest.approx(((0.1 + 0.05) / 0.8 + 0.1 / 0.4) / 2)


def test_ranking_loss_pairs_only_within_groups():
    torch.manual_seed(0)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    mass = torch.tensor([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    ordered = torch.tensor([1.0, 2.0, 3.0, -3.0, -2.0, -1.0]) * 20  # right within groups, wrong across
    assert pairwise_ranking_loss(ordered, mass, group, pairs=16).mean().item() < 1e-6
    assert pairwise_ranking_loss(-ordered, mass, group, pairs=16).mean().item() > 10


def fit_two_epochs(folder):
    """The small module fitted for two epochs on the collection in `folder` (seeded, CPU, quiet)."""
    L.seed_everything(0)
    data = RelevanceData(str(folder), batch_size=128, validation_fraction=0.34)
    model = RelevanceModule(data.collection, **SMALL)
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    return data, model, trainer


def test_fit_learns_and_checkpoint_reloads(shards, tmp_path):
    folder, rows = shards
    data, model, trainer = fit_two_epochs(folder)
    assert data.feature_spec == SPEC
    assert not set(data.train_set.keys) & set(data.val_set.keys) and len(data.val_set.keys) == 2
    metrics = trainer.callback_metrics
    assert metrics["val/auroc"] > 0.85
    assert metrics["val/mass_recall"] > random_ranking_recall(rows) + 0.15

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    reloaded = RelevanceModule.load_from_checkpoint(path, map_location="cpu")
    assert reloaded.model.spec == SPEC and reloaded.hparams.hidden == SMALL["hidden"]
    batch = next(iter(data.val_dataloader()))
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch), model(batch), rtol=0, atol=0)


def test_a_kvzip_collection_trains_and_validates_on_its_kvzip_column(tmp_path):
    rows = write_shards(tmp_path, label="kvzip")
    data, _, trainer = fit_two_epochs(tmp_path)
    assert "kvzip" in data.dataset.columns and "mass" not in data.dataset.columns
    assert trainer.callback_metrics["val/mass_recall"] > random_ranking_recall({"mass": rows["kvzip"]}) + 0.15


def test_batches_hold_whole_groups_and_reshuffle(shards):
    folder, _ = shards
    data = RelevanceData(str(folder), batch_size=40)
    data.setup("fit")
    loader = data.train_dataloader()
    epochs = [[b["group"] for b in loader] for _ in range(2)]
    for batches in epochs:
        groups = torch.cat(batches)
        assert len(groups) == len(data.train_set)
        assert all(len(b) <= 40 and torch.bincount(b)[b].eq(2 * K).all() for b in batches)  # whole groups
    assert [b[0].item() for b in epochs[0]] != [b[0].item() for b in epochs[1]]


def test_bad_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RelevanceData(str(tmp_path / "missing"))
    ShardWriter(tmp_path / "empty", {"feature_spec": SPEC.to_dict()})
    with pytest.raises(ValueError, match="no finished shards"):
        RelevanceData(str(tmp_path / "empty"))


def test_fit_main_end_to_end_and_curves(shards, tmp_path):
    folder, _ = shards
    config = {
        "seed_everything": 1,
        "trainer": {
            "max_epochs": 2, "accelerator": "cpu", "default_root_dir": str(tmp_path), "log_every_n_steps": 1,
            "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path / "tb"), "name": "tiny"}},
        },
        "data": {"folder": str(folder), "batch_size": 128, "validation_fraction": 0.34},
        "model": SMALL,
    }  # fmt: skip
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = fit_main(["fit", "--config", str(path)])
    log_dir = tmp_path / "tb" / "tiny" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*"))
    checkpoints = sorted((log_dir / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in checkpoints} >= {"last.ckpt"} and len(checkpoints) == 2
    best = RelevanceModule.load_from_checkpoint(cli.trainer.checkpoint_callback.best_model_path)
    assert best.model.spec == SPEC
    assert cli.trainer.checkpoint_callback.monitor == "val/mass_recall"  # an old-style collection: no full groups
    assert "val/window_recall" not in cli.trainer.callback_metrics
    assert all(p.name.startswith("epoch1-recall") for p in checkpoints if p.name != "last.ckpt")

    png = training_curves(tmp_path / "tb", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError):
        training_curves(tmp_path / "nothing", tmp_path / "none.png")


def test_window_recall_against_hand_computation():
    # group 4, six tokens, k = 2 (rows 0, 2: mass 0.55); group 9, four tokens, k = 1 (row 1: 0.4)
    group = torch.tensor([4, 4, 4, 4, 4, 4, 9, 9, 9, 9])
    mass = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.2, 0.08, 0.1, 0.4, 0.3, 0.2])
    in_topk = torch.tensor([1, 0, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool)
    metric = WindowRecall()

    def recall(preds):
        metric.reset()
        metric.update(preds[:4], mass[:4], in_topk[:4], group[:4])  # a group spans the two updates
        metric.update(preds[4:], mass[4:], in_topk[4:], group[4:])
        return metric.compute().item()

    assert recall(mass) == pytest.approx(1.0)  # ranks perfectly
    assert recall(-mass) == pytest.approx(((0.05 + 0.08) / 0.55 + 0.1 / 0.4) / 2)  # reversed: ~0.243
    # picks rows 4 and 0 (0.5 of 0.55) and row 8 (0.3 of 0.4)
    preds = torch.tensor([0.7, 0.1, 0.2, 0.3, 0.9, 0.0, 0.1, 0.2, 0.8, 0.3])
    assert recall(preds) == pytest.approx((0.5 / 0.55 + 0.3 / 0.4) / 2)


@pytest.fixture(scope="module")
def full_collection(tmp_path_factory):
    """A tiny model's collection of four windows, the first two kept whole."""
    from atskv.predictor.collect import collect
    from tests.conftest import random_prompt, tiny_bpe_tokenizer, tiny_model

    folder = tmp_path_factory.mktemp("full") / "collect"
    return collect(tiny_model("llama"), tiny_bpe_tokenizer(), random_prompt(64, batch=4), folder,
                   decision_points=(0.5, 0.75), future_queries=8, topk=6, dense_layers=1, full_windows=2,
                   progress=False)


def split_seed(folder, full_in_validation: bool) -> int:
    """A `data.seed` whose held-out window (one of four), drawn among all alike, is full, or is not."""
    dataset = ShardDataset(folder, [])
    for seed in range(50):
        (held,) = dataset.split_by_key(0.25, seed)[1].keys
        if (held in ("corpus-w0", "corpus-w1")) == full_in_validation:
            return seed
    raise AssertionError("no such split")


def without_full_keys(folder, tmp_path) -> Path:
    """A copy of `folder` whose manifest does not say which windows are full (a collection made
    before it did): its split draws the full windows like any other."""
    import json
    import shutil

    copy = shutil.copytree(folder, tmp_path / "older")
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["meta"]["full_keys"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_the_full_windows_are_held_out_first_whatever_the_seed(full_collection):
    for seed in range(6):
        data = RelevanceData(full_collection, validation_fraction=0.25, num_workers=0, seed=seed)
        data.setup()
        assert data.val_set.keys in (["corpus-w0"], ["corpus-w1"]) and data.full_validation


def fit_cli(folder, tmp_path, seed):
    config = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 2, "accelerator": "cpu", "default_root_dir": str(tmp_path), "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "data": {"folder": str(folder), "batch_size": 64, "validation_fraction": 0.25, "num_workers": 0,
                 "seed": seed},
        "model": SMALL,
    }  # fmt: skip
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    return fit_main(["fit", "--config", str(tmp_path / "fit.yaml")])


def test_fit_checkpoints_on_window_recall_over_the_full_validation_groups(full_collection, tmp_path):
    cli = fit_cli(full_collection, tmp_path, split_seed(full_collection, True))
    callback, metrics, data = cli.trainer.checkpoint_callback, cli.trainer.callback_metrics, cli.datamodule
    assert data.full_validation and callback.monitor == "val/window_recall"
    assert {"val/window_recall", "val/mass_recall"} <= set(metrics)
    assert re.fullmatch(r"epoch[01]-window_recall0\.\d{4}\.ckpt", Path(callback.best_model_path).name)
    assert callback.best_model_score >= metrics["val/window_recall"]
    # the logged values against the last model over the held-out rows: all of every full group for
    # the window recall, only the sampled ones for the mass recall
    rows = data.val_set.__getitems__(list(range(len(data.val_set))))
    assert rows["full"].all() and not rows["sampled"].all()
    model = cli.model.eval()
    with torch.no_grad():
        preds = model(rows)
    full, sampled = rows["full"], rows["sampled"]
    window = mass_recall(preds[full], rows["mass"][full], rows["in_topk"][full], rows["group"][full])
    sample = mass_recall(preds[sampled], rows["mass"][sampled], rows["in_topk"][sampled], rows["group"][sampled])
    assert metrics["val/window_recall"].item() == pytest.approx(window.item(), rel=1e-5)
    assert metrics["val/mass_recall"].item() == pytest.approx(sample.item(), rel=1e-5)
    assert window < sample  # the sample's top-k plus as many others is the easier set to rank


def test_full_windows_only_in_training_train_on_their_sampled_rows(full_collection, tmp_path):
    older = without_full_keys(full_collection, tmp_path)
    with pytest.warns(UserWarning, match="none of the collection's 2 full windows is in the validation split"):
        cli = fit_cli(older, tmp_path, split_seed(older, False))
    data = cli.datamodule
    assert not data.full_validation and cli.trainer.checkpoint_callback.monitor == "val/mass_recall"
    assert "val/window_recall" not in cli.trainer.callback_metrics
    assert cli.trainer.checkpoint_callback.filename == "epoch{epoch}-recall{val/mass_recall:.4f}"
    loaded = torch.cat([b["sampled"] for b in data.train_dataloader()])
    sampled = data.train_set.column("sampled")
    assert loaded.all() and len(loaded) == int(sampled.sum()) < len(sampled)
