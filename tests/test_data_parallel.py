"""Data-parallel training: two CPU processes (gloo) train as one process on the same data and seeds."""

import pytest
import torch
import torch.distributed as dist
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from atskv.predictor.batches import GroupBatchSampler
from atskv.predictor.distributed import counter_hash
from atskv.predictor.training import ReleaseProcessGroup, fit_main
from tests.test_predictor_training import SMALL, write_shards
from tests.test_rl import tiny  # noqa: F401 (the fixture)


def test_ranks_share_every_batch_in_whole_groups():
    group = torch.tensor([5] * 7 + [1] * 3 + [9] * 2 + [4] * 6 + [2] * 1 + [8] * 5)
    one = list(GroupBatchSampler(group, 12, shuffle=True, seed=3))
    ranks = [GroupBatchSampler(group, 12, shuffle=True, seed=3, rank=r, world_size=3) for r in range(3)]
    shares = list(zip(*(list(s) for s in ranks)))
    assert len(shares) == len(one) == len(ranks[0])
    for batch, parts in zip(one, shares):
        assert sorted(batch) == sorted(sum(parts, []))  # the same rows, each on one rank
        for part in parts:  # whole groups
            assert all((group[part] == g).sum() == (group == g).sum() for g in group[part].unique())
    assert any(not part for parts in shares for part in parts)  # a batch with fewer groups than ranks
    with pytest.raises(ValueError, match="rank 3"):
        GroupBatchSampler(group, 12, shuffle=False, rank=3, world_size=3)


def test_counter_hash_is_a_function_of_its_keys():
    keys = torch.arange(1000)
    a = counter_hash(7, keys, 3)
    assert torch.equal(counter_hash(7, keys.flip(0), 3), a.flip(0))
    assert torch.equal(counter_hash(7, keys[500:], 3), a[500:])
    assert (a >= 0).all() and a.unique().numel() == 1000 and not torch.equal(a, counter_hash(8, keys, 3))
    assert abs((a % 2).float().mean().item() - 0.5) < 0.05


def test_a_fit_releases_its_process_group(tmp_path):
    """A gloo group left to interpreter shutdown can abort a process after a fit that succeeded."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ReleaseProcessGroup().teardown(None, None, "fit")
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fit(folder, root, devices: int) -> dict:
    config = {
        "seed_everything": 3,
        "trainer": {
            "max_epochs": 2, "accelerator": "cpu", "devices": devices,
            "strategy": "ddp_spawn" if devices > 1 else "auto",
            "default_root_dir": str(root), "log_every_n_steps": 1,
            "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(root / "tb"), "name": "run"}},
        },
        "data": {"folder": str(folder), "batch_size": 150, "validation_fraction": 0.34},
        "model": {**SMALL, "ranking_pairs": 2},
    }  # fmt: skip
    root.mkdir()
    path = root / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = fit_main(["fit", "--config", str(path)])
    assert any(isinstance(c, ReleaseProcessGroup) for c in cli.trainer.callbacks)
    log_dir = root / "tb" / "run" / "version_0"
    events = EventAccumulator(str(log_dir)).Reload()
    curves = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    state = torch.load(log_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    return {"curves": curves, "predictor": {k: v for k, v in state.items() if k.startswith("model.")}}


def test_two_processes_train_as_one(tmp_path):
    """Same loss curve, metrics and predictor weights with DDP on two gloo processes. A batch holds
    nine groups, so the processes' shares are unequal (5 and 4), which per-process means would weigh wrong."""
    folder = tmp_path / "shards"
    write_shards(folder, shards=6, groups=10, seed=1)
    one, two = _fit(folder, tmp_path / "one", 1), _fit(folder, tmp_path / "two", 2)
    assert one["curves"].keys() == two["curves"].keys() >= {"train/loss", "val/loss", "val/mass_recall", "val/auroc"}
    assert len(one["curves"]["train/loss"]) >= 10
    for tag, values in one["curves"].items():
        torch.testing.assert_close(torch.tensor(two["curves"][tag]), torch.tensor(values), rtol=1e-4, atol=1e-5)
    assert one["predictor"].keys() == two["predictor"].keys()
    for name, value in one["predictor"].items():
        torch.testing.assert_close(two["predictor"][name], value, rtol=1e-4, atol=1e-5)


def _finetune(tiny, root, devices: int) -> dict:  # noqa: F811 (the fixture's value)
    from atskv.rl.training import finetune_main
    from tests.test_rl import _finetune_args

    strategy = "ddp_spawn" if devices > 1 else "auto"
    args = _finetune_args(tiny, root, "--data.batch_size", "3", "--trainer.devices", str(devices))
    cli = finetune_main([*args[1:], "--trainer.strategy", strategy, "--seed_everything", "5"])
    assert any(isinstance(c, ReleaseProcessGroup) for c in cli.trainer.callbacks)
    checkpoint = next(root.rglob("last.ckpt"))
    events = EventAccumulator(str(checkpoint.parent.parent)).Reload()
    curves = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {"curves": curves, "predictor": state}


def test_two_processes_fine_tune_as_one(tiny, tmp_path):  # noqa: F811 (the fixture)
    """Three contexts per step dealt to two processes (2 and 1): the same curves and weights."""
    one, two = _finetune(tiny, tmp_path / "one", 1), _finetune(tiny, tmp_path / "two", 2)
    assert one["curves"].keys() == two["curves"].keys() >= {"train/reward", "train/nll", "train/grad_norm"}
    assert len(one["curves"]["train/reward"]) == 3
    for tag, values in one["curves"].items():
        torch.testing.assert_close(torch.tensor(two["curves"][tag]), torch.tensor(values), rtol=1e-4, atol=1e-5)
    for name, value in one["predictor"].items():
        torch.testing.assert_close(two["predictor"][name], value, rtol=1e-4, atol=1e-5)
