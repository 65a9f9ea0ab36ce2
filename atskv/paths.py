"""Where atskv keeps what it downloads or converts (models, corpora)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$ATSKV_CACHE` if set, else `~/.cache/atskv`: one place for every downloaded artifact."""
    return Path(os.environ.get("ATSKV_CACHE") or "~/.cache/atskv").expanduser()


def readable_as_umask_allows(path: str | os.PathLike) -> None:
    """Give `path` the mode a file created by `open` has (0666 less the umask): safetensors' writer
    makes its files 0600, which others cannot read (an exported predictor, a collection)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
