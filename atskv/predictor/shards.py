"""Resumable shard store for the predictor's collected features and labels.

A collection is split into units of work (e.g. one corpus window) named by a key. Each finished
unit is one `shard-<n>.safetensors` file whose tensors share their first dimension (rows), and
`manifest.json` lists the finished shards. The shard is written to a temporary name, synced and
renamed before the manifest is replaced (also temp + rename), so a kill at any point leaves a
manifest that lists only complete shards; a reopened writer removes what a killed run left
behind and skips the keys the manifest lists. The manifest's `meta` (base model geometry,
feature spec) guards against mixing collections made for different models or features.

Each entry records its file's size and SHA-256. A reopened writer checks both and drops a shard
that no longer matches (truncated, overwritten, missing), so a rerun of the collection makes it
again; a dataset checks the sizes when it opens the folder and refuses a damaged shard in one
line naming its file (`InputError`).

Several processes may write one folder (`atskv collect --devices N`): one opens it (clean-up,
meta check), the others `join` it; each names its shards by the work item's index, which no two
share, and adds its entries to the manifest under an exclusive lock on the folder (read, append,
replace), so no process's entry is lost; `order` finally puts the entries in work order.
"""

import bisect
import contextlib
import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Collection, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from atskv.errors import InputError
from atskv.paths import readable_as_umask_allows

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".tmp"
_SHARD_NAME = re.compile(r"shard-\d+\.safetensors")
log = logging.getLogger(__name__)


def _canonical(meta: dict) -> dict:
    """`meta` as it reads back from JSON (tuples become lists), so comparisons are exact."""
    return json.loads(json.dumps(meta, sort_keys=True))


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (POSIX: the directory entry needs its own sync)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive lock on `folder` itself (no lock file to leave behind), for read-modify-write
    of the manifest by processes sharing the folder; the OS releases it if the holder is killed."""
    if os.name != "posix":  # no flock: one writer per folder
        yield
        return
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _schema(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in tensors.items()
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def _damage(folder: Path, entry: dict, *, by_hash: bool) -> str | None:
    """What is wrong with a listed shard's file (missing, another size, with `by_hash` another
    SHA-256 than the manifest records), or None; entries of older collections record neither."""
    path = folder / entry["file"]
    if not path.is_file():
        return "missing"
    if "bytes" in entry and path.stat().st_size != entry["bytes"]:
        return f"{path.stat().st_size} bytes, the manifest lists {entry['bytes']}"
    if by_hash and "sha256" in entry and _sha256(path) != entry["sha256"]:
        return "its SHA-256 differs from the manifest's"
    return None


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not folder.is_dir():
        raise FileNotFoundError(f"shard folder {folder} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: not a shard folder, or nothing was collected")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has shard format {manifest.get('format')!r}; this atskv reads format {FORMAT_VERSION}"
        )
    return manifest


class ShardWriter:
    """Appends finished units of work to `folder`; reopening the folder resumes a collection.

    Processes sharing a folder: the first opens it, the others pass `join` once it has; every
    process passes `write(..., index=)` (distinct work item indices) and one calls `order` last.
    """

    def __init__(self, folder: str | os.PathLike, meta: dict, start_over: bool = False, *, join: bool = False):
        """`start_over`: drop what `folder` holds; without it, a folder holding shards of another
        collection (other meta) is refused. `join`: share a folder another process has just
        opened with the same meta (nothing is cleaned up or replaced)."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = _canonical(meta)
        self._shards = []
        if join and (start_over or not (self.folder / MANIFEST).exists()):
            raise ValueError(f"join needs {self.folder} already opened by another writer, and no start_over")
        if (self.folder / MANIFEST).exists() and not start_over:
            manifest = _read_manifest(self.folder)
            old = manifest["meta"]
            if (manifest["shards"] or join) and old != meta:
                differ = ", ".join(
                    k if isinstance(old.get(k), (dict, list)) else f"{k} {old.get(k)!r}, not {meta.get(k)!r}"
                    for k in sorted(set(old) | set(meta))
                    if old.get(k) != meta.get(k)
                )
                raise InputError(
                    f"{self.folder} holds another collection ({differ}); "
                    "pass start_over to replace it, or use another folder"
                )
            self._shards = self._intact(manifest["shards"]) if not join else manifest["shards"]
        self._meta = meta
        if not join:
            with _locked(self.folder):
                self._remove_leftovers()
                self._write_manifest()

    @property
    def meta(self) -> dict:
        return self._meta

    @property
    def keys(self) -> list[str]:
        """Keys of the finished shards, in the order they were written."""
        return [s["key"] for s in self._shards]

    def has(self, key: str) -> bool:
        return any(s["key"] == key for s in self._shards)

    def write(self, key: str, tensors: dict[str, torch.Tensor], index: int | None = None) -> None:
        """Store one finished unit of work; it is listed (and `has(key)`) once this returns.
        `index`: the unit's place in the work, which names its file (`shard-<index>`); default
        the number of shards listed (one writer per folder)."""
        if self.has(key):
            raise ValueError(f"shard {key!r} is already finished in {self.folder}")
        if not tensors:
            raise ValueError(f"shard {key!r} has no tensors")
        rows = {name: t.shape[0] if t.dim() else None for name, t in tensors.items()}
        if None in rows.values() or len(set(rows.values())) != 1:
            raise ValueError(f"shard {key!r}: all tensors must share their first dimension (rows), got {rows}")
        tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        self._check_columns(key, tensors)

        name = f"shard-{len(self._shards) if index is None else index}.safetensors"
        if any(s["file"] == name for s in self._shards):
            raise ValueError(f"{self.folder / name} already holds shard {key!r}'s place; pass another index")
        tmp = self.folder / (name + _TMP_SUFFIX)
        save_file(tensors, tmp, metadata={"key": key})
        _fsync_file(tmp)
        readable_as_umask_allows(tmp)
        size, digest = tmp.stat().st_size, _sha256(tmp)
        os.replace(tmp, self.folder / name)
        _fsync_dir(self.folder)
        entry = {"key": key, "file": name, "rows": next(iter(rows.values())), "tensors": _schema(tensors),
                 "bytes": size, "sha256": digest}  # fmt: skip
        with _locked(self.folder):  # other processes may have listed shards since we last read
            shards = _read_manifest(self.folder)["shards"] + [entry]
            self._write_manifest(shards)
        self._shards = shards

    def order(self, keys: list[str]) -> None:
        """List the finished shards in the order of `keys` (the work order; keys not in it last)."""
        place = {key: i for i, key in enumerate(keys)}
        with _locked(self.folder):
            shards = _read_manifest(self.folder)["shards"]
            shards.sort(key=lambda s: place.get(s["key"], len(place)))
            self._write_manifest(shards)
        self._shards = shards

    def _intact(self, shards: list[dict]) -> list[dict]:
        """The listed shards whose files match the manifest; each other one is logged and left
        unlisted (its file removed with the leftovers), so the collection makes it again."""
        kept = []
        for entry in shards:
            damage = _damage(self.folder, entry, by_hash=True)
            if damage:
                log.warning("%s: damaged shard of %r (%s); it is collected again", self.folder / entry["file"],
                            entry["key"], damage)  # fmt: skip
            else:
                kept.append(entry)
        return kept

    def _check_columns(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Every shard has the same columns with the same dtype and per-row shape."""
        if not self._shards:
            return
        expected = {n: (s["shape"][1:], s["dtype"]) for n, s in self._shards[0]["tensors"].items()}
        got = {n: (s["shape"][1:], s["dtype"]) for n, s in _schema(tensors).items()}
        if got != expected:
            raise ValueError(
                f"shard {key!r} has columns {got} (per-row shape, dtype); earlier shards have {expected}"
            )

    def _remove_leftovers(self) -> None:
        """Delete temporary files and shards a killed run wrote but never listed (temporary: ours,
        `*.tmp`, and safetensors' own, `.tmpXXXXXX`, which `save_file` writes through)."""
        listed = {s["file"] for s in self._shards}
        for path in self.folder.iterdir():
            stray = (
                path.name.endswith(_TMP_SUFFIX)
                or path.name.startswith(_TMP_SUFFIX)
                or (_SHARD_NAME.fullmatch(path.name) and path.name not in listed)
            )
            if stray and path.is_file():
                path.unlink()

    def _write_manifest(self, shards: list[dict] | None = None) -> None:
        manifest = {"format": FORMAT_VERSION, "meta": self._meta, "shards": self._shards if shards is None else shards}
        tmp = self.folder / (MANIFEST + _TMP_SUFFIX)
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / MANIFEST)
        _fsync_dir(self.folder)


class ShardDataset(Dataset):
    """All rows of the finished shards in `folder`, in the order the shards were written.

    Shards are memory-mapped lazily through `safe_open` (a few kept open at a time), so a
    dataset far larger than memory reads only the rows asked for. `columns` picks tensors
    (default: all); `keys` restricts the dataset to those shards.
    """

    open_files = 8

    def __init__(
        self,
        folder: str | os.PathLike,
        columns: list[str] | None = None,
        keys: Iterable[str] | None = None,
    ):
        self.folder = Path(folder)
        manifest = _read_manifest(self.folder)
        self._meta = manifest["meta"]
        shards = manifest["shards"]
        if keys is not None:
            wanted = set(keys)
            unknown = wanted - {s["key"] for s in shards}
            if unknown:
                raise KeyError(f"no finished shards for keys {sorted(unknown)} in {self.folder}")
            shards = [s for s in shards if s["key"] in wanted]
        available = list(shards[0]["tensors"]) if shards else []
        self.columns = available if columns is None else list(columns)
        missing = [c for c in self.columns if shards and c not in available]
        if missing:
            raise KeyError(f"columns {missing} not in {self.folder}; it has {available}")
        for entry in shards:
            damage = _damage(self.folder, entry, by_hash=False)
            if damage:
                raise InputError(_damaged(self.folder / entry["file"], damage, self.folder))
        self._shards = shards
        self._ends = [0]
        for s in shards:
            self._ends.append(self._ends[-1] + s["rows"])
        self._handles: OrderedDict[str, object] = OrderedDict()

    @property
    def meta(self) -> dict:
        return self._meta

    @property
    def keys(self) -> list[str]:
        return [s["key"] for s in self._shards]

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        shard = bisect.bisect_right(self._ends, i) - 1
        handle = self._handle(self._shards[shard]["file"])
        row = i - self._ends[shard]
        return {c: handle.get_slice(c)[row] for c in self.columns}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A batch of rows as one dict of stacked tensors, in the order asked: each shard's rows
        are read as one slice. DataLoader calls this instead of `__getitem__` per row (pass
        `collate_fn=stacked`); it is what makes training read fast."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"rows out of range for {len(self)} rows")
        if not index.numel():  # one process's share of a batch may be empty (atskv.predictor.batches)
            handle = self._handle(self._shards[0]["file"])
            return {c: handle.get_slice(c)[0:0] for c in self.columns}
        shard_of = torch.bucketize(index, torch.tensor(self._ends[1:]), right=True)
        parts, order = {c: [] for c in self.columns}, []
        for shard in shard_of.unique().tolist():
            where = (shard_of == shard).nonzero().flatten()
            local = index[where] - self._ends[shard]
            lo, hi = int(local.min()), int(local.max()) + 1
            handle = self._handle(self._shards[shard]["file"])
            for c in self.columns:
                parts[c].append(handle.get_slice(c)[lo:hi][local - lo])
            order.append(where)
        inverse = torch.empty_like(index)
        inverse[torch.cat(order)] = torch.arange(index.numel())
        return {c: torch.cat(parts[c])[inverse] for c in self.columns}

    def column(self, name: str) -> torch.Tensor:
        """One column of every row, read shard by shard (e.g. the group ids a sampler needs)."""
        return torch.cat([self._handle(s["file"]).get_tensor(name) for s in self._shards])

    def has_full_groups(self) -> bool:
        """Whether some of these rows belong to a window kept whole (`atskv collect --full_windows`),
        which the window recall is measured on."""
        return "full" in self.columns and bool(self.column("full").any())

    def split_by_key(self, fraction: float, seed: int = 0,
                     first: Collection[str] = ()) -> tuple["ShardDataset", "ShardDataset"]:  # fmt: skip
        """(train, held-out) over disjoint shard keys, `fraction` of the keys held out, drawn from
        the keys in `first` before any other (a collection's full windows, which the window recall
        is measured on: drawn at random with the others, a small held-out share often held none).

        Splitting keys, not rows, keeps all rows of one window on one side; the split depends
        only on the set of keys, `first` and the seed.
        """
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        keys = sorted(self.keys)
        if len(keys) < 2:
            raise ValueError(f"cannot split {len(keys)} shard(s) into two non-empty parts")
        held = min(max(round(fraction * len(keys)), 1), len(keys) - 1)
        order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
        order.sort(key=lambda j: keys[j] not in first)  # stable: random order within each side
        held_keys = {keys[j] for j in order[:held]}
        train = [k for k in keys if k not in held_keys]
        return (
            ShardDataset(self.folder, self.columns, train),
            ShardDataset(self.folder, self.columns, held_keys),
        )

    def _handle(self, file: str):
        if file in self._handles:
            self._handles.move_to_end(file)
        else:
            try:
                self._handles[file] = safe_open(self.folder / file, framework="pt")
            except SafetensorError as error:
                raise InputError(_damaged(self.folder / file, str(error), self.folder)) from None
            if len(self._handles) > self.open_files:
                self._handles.popitem(last=False)
        return self._handles[file]

    def __getstate__(self):
        """Open files do not pickle (DataLoader workers); each process reopens its own."""
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state


def _damaged(path: Path, damage: str, folder: Path) -> str:
    return f"{path}: damaged shard ({damage}); rerun `atskv collect` into {folder} to collect it again"


def stacked(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataLoader `collate_fn` for `ShardDataset.__getitems__`: the batch is already stacked."""
    return batch


def label_column(meta: dict) -> str:
    """The shard column that ranks a collection's tokens (its manifest's `label`); collections made
    before the choice existed are `mass`."""
    return meta.get("label", "mass")


def full_windows(meta: dict) -> int:
    """How many windows of a collection keep every token (manifest `full_windows`; their shards and
    all others then carry `full` and `sampled` columns, `atskv.predictor.collect`); collections
    made before the choice existed have none."""
    return int(meta.get("full_windows", 0))
