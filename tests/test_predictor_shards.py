import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from atskv.errors import InputError
from atskv.predictor import shards
from atskv.predictor.shards import MANIFEST, ShardDataset, ShardWriter

META = {"model": "tiny", "layers": 4, "kv_heads": (2,), "features": ["h", "a", "type"]}


def unit(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(rows, 6, generator=g).to(torch.float16),
        "mass": torch.rand(rows, generator=g, dtype=torch.float32).to(torch.bfloat16),
        "layer": torch.randint(0, 4, (rows,), generator=g),
        "member": torch.rand(rows, generator=g) > 0.5,
    }


def rows_of(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[i] for k, v in tensors.items()} for i in range(n)]


def assert_rows_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def test_round_trip_spans_shards_in_order(tmp_path):
    units = {f"window-{i}": unit(rows, i) for i, rows in enumerate([3, 5, 1])}
    writer = ShardWriter(tmp_path, META)
    for key, tensors in units.items():
        writer.write(key, tensors)
    ds = ShardDataset(tmp_path)
    assert len(ds) == 9 and ds.keys == list(units) and ds.meta == json.loads(json.dumps(META))
    expected = [r for t in units.values() for r in rows_of(t)]
    for i, want in enumerate(expected):
        assert_rows_equal(ds[i], want)
    assert_rows_equal(ds[-1], expected[-1])
    with pytest.raises(IndexError):
        ds[9]
    only = ShardDataset(tmp_path, columns=["mass"])
    assert list(only[4]) == ["mass"] and torch.equal(only[4]["mass"], expected[4]["mass"])
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["shards"][1]["rows"] == 5
    assert manifest["shards"][1]["tensors"]["hidden"] == {"shape": [5, 6], "dtype": "float16"}


def test_reopened_writer_resumes(tmp_path):
    ShardWriter(tmp_path, META).write("window-0", unit(2, 0))
    writer = ShardWriter(tmp_path, META)
    assert writer.has("window-0") and not writer.has("window-1")
    with pytest.raises(ValueError, match="already finished"):
        writer.write("window-0", unit(2, 0))
    writer.write("window-1", unit(4, 1))
    ds = ShardDataset(tmp_path)
    assert ds.keys == ["window-0", "window-1"] and len(ds) == 6
    assert_rows_equal(ds[2], rows_of(unit(4, 1))[0])


def _kill_on(monkeypatch, name):
    real = os.replace

    def replace(src, dst):
        if os.path.basename(dst).startswith(name):
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(shards.os, "replace", replace)


@pytest.mark.parametrize("killed_at", [MANIFEST, "shard-"])
def test_kill_loses_no_finished_shard_and_lists_no_partial(tmp_path, monkeypatch, killed_at):
    ShardWriter(tmp_path, META).write("window-0", unit(3, 0))
    writer = ShardWriter(tmp_path, META)
    _kill_on(monkeypatch, killed_at)
    with pytest.raises(KeyboardInterrupt):
        writer.write("window-1", unit(2, 1))
    monkeypatch.undo()
    assert {p.name for p in tmp_path.iterdir()} > {MANIFEST, "shard-0.safetensors"}  # leftovers exist

    ds = ShardDataset(tmp_path)
    assert ds.keys == ["window-0"] and len(ds) == 3
    resumed = ShardWriter(tmp_path, META)
    assert {p.name for p in tmp_path.iterdir()} == {MANIFEST, "shard-0.safetensors"}
    assert resumed.has("window-0") and not resumed.has("window-1")
    resumed.write("window-1", unit(2, 1))
    ds = ShardDataset(tmp_path)
    assert ds.keys == ["window-0", "window-1"]
    assert_rows_equal(ds[3], rows_of(unit(2, 1))[0])
    assert_rows_equal(ds[0], rows_of(unit(3, 0))[0])


def test_a_kill_inside_safetensors_write_leaves_nothing_after_a_resume(tmp_path, monkeypatch):
    """safetensors' `save_file` writes through a `.tmpXXXXXX` file of its own and renames it: a
    process killed there (a collection's rank ended with its group) leaves that file behind."""
    ShardWriter(tmp_path, META).write("window-0", unit(3, 0))
    writer = ShardWriter(tmp_path, META)

    def killed(tensors, path, metadata=None):
        (Path(path).parent / ".tmpK1ll3d").write_bytes(b"partial")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shards, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        writer.write("window-1", unit(2, 1))
    monkeypatch.undo()
    resumed = ShardWriter(tmp_path, META)
    assert {p.name for p in tmp_path.iterdir()} == {MANIFEST, "shard-0.safetensors"}
    resumed.write("window-1", unit(2, 1))
    assert ShardDataset(tmp_path).keys == ["window-0", "window-1"]


def test_meta_mismatch_refused_unless_empty(tmp_path):
    ShardWriter(tmp_path / "empty", META)
    assert ShardWriter(tmp_path / "empty", {**META, "layers": 5}).meta["layers"] == 5
    ShardWriter(tmp_path / "used", META).write("window-0", unit(1, 0))
    with pytest.raises(ValueError, match=r"holds another collection \(layers 4, not 5\); pass start_over"):
        ShardWriter(tmp_path / "used", {**META, "layers": 5})
    assert ShardWriter(tmp_path / "used", dict(META)).has("window-0")  # tuple vs list is the same meta


def test_bad_shards_refused(tmp_path):
    writer = ShardWriter(tmp_path, META)
    bad_rows = {**unit(3, 0), "mass": torch.zeros(2)}
    with pytest.raises(ValueError, match="first dimension"):
        writer.write("window-0", bad_rows)
    with pytest.raises(ValueError, match="first dimension"):
        writer.write("window-0", {"scalar": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="no tensors"):
        writer.write("window-0", {})
    writer.write("window-0", unit(3, 0))
    with pytest.raises(ValueError, match="columns"):
        writer.write("window-1", {**unit(3, 1), "hidden": torch.zeros(3, 7, dtype=torch.float16)})
    assert writer.keys == ["window-0"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ShardDataset(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ShardDataset(tmp_path)
    ShardWriter(tmp_path, META).write("window-0", unit(2, 0))
    with pytest.raises(KeyError, match="attention"):
        ShardDataset(tmp_path, columns=["hidden", "attention"])
    with pytest.raises(KeyError, match="window-9"):
        ShardDataset(tmp_path, keys=["window-9"])


def test_split_by_key_is_disjoint_and_deterministic(tmp_path):
    writer = ShardWriter(tmp_path, META)
    for i in range(10):
        writer.write(f"window-{i}", unit(i % 3 + 1, i))
    ds = ShardDataset(tmp_path)
    train, held = ds.split_by_key(0.2, seed=1)
    assert len(held.keys) == 2 and set(train.keys).isdisjoint(held.keys)
    assert set(train.keys) | set(held.keys) == set(ds.keys)
    assert len(train) + len(held) == len(ds)
    assert ds.split_by_key(0.2, seed=1)[1].keys == held.keys
    assert any(ds.split_by_key(0.2, seed=s)[1].keys != held.keys for s in range(2, 6))
    # a held-out row is exactly the row its shard wrote
    k = held.keys[0]
    assert_rows_equal(held[0], rows_of(unit(int(k.split("-")[1]) % 3 + 1, int(k.split("-")[1])))[0])
    with pytest.raises(ValueError):
        ds.split_by_key(1.0)
    # keys named first are held out first, in an order the seed draws
    first = ["window-7", "window-3", "window-9"]
    for s in range(4):
        assert set(ds.split_by_key(0.2, seed=s, first=first)[1].keys) < set(first)
    assert set(ds.split_by_key(0.5, seed=1, first=first)[1].keys) > set(first)
    assert {k for s in range(8) for k in ds.split_by_key(0.1, seed=s, first=first)[1].keys} == set(first)


def test_dataset_pickles_for_workers(tmp_path):
    ShardWriter(tmp_path, META).write("window-0", unit(2, 0))
    ds = ShardDataset(tmp_path)
    first = ds[1]
    clone = pickle.loads(pickle.dumps(ds))
    assert_rows_equal(clone[1], first)


def test_batched_reads_equal_row_reads_in_any_order(tmp_path):
    """`__getitems__` (one slice per shard) returns exactly the rows `__getitem__` does, in the
    order asked, across shards; `column` reads a whole column."""
    writer = ShardWriter(tmp_path, {"m": 1})
    for n, rows in enumerate([5, 3, 7]):
        writer.write(f"w{n}", {"x": torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) + 100 * n,
                               "g": torch.full((rows,), n, dtype=torch.int64)})
    dataset = ShardDataset(tmp_path)
    asked = [14, 0, 6, 5, 9, 2, 13]
    batch = dataset.__getitems__(asked)
    for position, i in enumerate(asked):
        row = dataset[i]
        assert torch.equal(batch["x"][position], row["x"]) and torch.equal(batch["g"][position], row["g"])
    assert torch.equal(dataset.column("g"), torch.tensor([0] * 5 + [1] * 3 + [2] * 7))
    with pytest.raises(IndexError):
        dataset.__getitems__([15])


def test_a_truncated_shard_is_collected_again_on_resume(tmp_path, caplog):
    """A reopened writer checks each listed shard's size and hash: a truncated one is dropped
    (logged, its file removed), so the collection makes it again; the intact ones stay."""
    writer = ShardWriter(tmp_path, META)
    writer.write("window-0", unit(3, 0))
    writer.write("window-1", unit(4, 1))
    damaged = tmp_path / "shard-1.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-7])
    writer = ShardWriter(tmp_path, META)
    assert writer.keys == ["window-0"] and not damaged.exists()
    assert f"{damaged}: damaged shard of 'window-1'" in caplog.text
    writer.write("window-1", unit(4, 1))
    assert_rows_equal(ShardDataset(tmp_path)[3], rows_of(unit(4, 1))[0])


def test_a_shard_with_other_bytes_of_the_same_size_is_collected_again(tmp_path):
    ShardWriter(tmp_path, META).write("window-0", unit(3, 0))
    path = tmp_path / "shard-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert ShardWriter(tmp_path, META).keys == []


def test_a_dataset_names_a_damaged_shard_in_one_line(tmp_path):
    """Loading refuses a truncated shard before any row is read, naming the file; a shard whose
    header no longer parses (an older manifest without sizes) is named the same way."""
    writer = ShardWriter(tmp_path, META)
    writer.write("window-0", unit(3, 0))
    writer.write("window-1", unit(4, 1))
    path = tmp_path / "shard-1.safetensors"
    intact = path.read_bytes()
    path.write_bytes(intact[:100])
    with pytest.raises(InputError, match=f"^{path}: damaged shard .*rerun `atskv collect` into {tmp_path}") as caught:
        ShardDataset(tmp_path)
    assert "\n" not in str(caught.value)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for entry in manifest["shards"]:
        del entry["bytes"], entry["sha256"]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    path.write_bytes(intact[:4])
    with pytest.raises(InputError, match=f"^{path}: damaged shard"):
        ShardDataset(tmp_path)[5]


def test_shards_are_readable_as_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        ShardWriter(tmp_path, META).write("window-0", unit(3, 0))
    finally:
        os.umask(old)
    assert (tmp_path / "shard-0.safetensors").stat().st_mode & 0o777 == 0o644
