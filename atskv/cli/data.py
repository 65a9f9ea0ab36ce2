"""`atskv data fetch|list`: the offline corpora."""

from __future__ import annotations

from pathlib import Path


def fetch(name: str, cache_dir: Path | None = None, force: bool = False) -> None:
    """Fetch an offline corpus (austen, sotu, moby-dick) into the cache as plain-text files.

    Args:
        name: corpus name.
        cache_dir: cache folder (default $ATSKV_CACHE or ~/.cache/atskv).
        force: fetch again even if present.
    """
    from atskv.data import fetch_corpus

    path = fetch_corpus(name, cache_dir=cache_dir, force=force)
    files = sorted(path.glob("*.txt"))
    print(f"{name}: {len(files)} documents, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB in {path}")


def corpora() -> None:
    """List the corpora `atskv data fetch` knows."""
    from atskv.data import CORPORA

    for name in CORPORA:
        print(name)


COMMANDS = {"fetch": fetch, "list": corpora, "_help": "Offline corpora for training and evaluation."}
