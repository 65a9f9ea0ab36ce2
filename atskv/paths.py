"""Where atskv keeps what it downloads or converts (models, corpora)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$ATSKV_CACHE` if set, else `~/.cache/atskv`: one place for every downloaded artifact."""
    return Path(os.environ.get("ATSKV_CACHE") or "~/.cache/atskv").expanduser()
