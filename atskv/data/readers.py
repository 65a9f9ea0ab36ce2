"""Reading text corpora into documents, splitting them, and cutting them into token windows.

Everything downstream (feature collection, perplexity, haystack filler) consumes a plain list
of ``Document``; where the text came from (a fetched corpus, a folder, a Hugging Face dataset)
is decided here, by ``load_corpus``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpora import CORPORA, fetch_corpus

__all__ = [
    "Document",
    "load_corpus",
    "read_hf_dataset",
    "read_text_folder",
    "split_documents",
    "token_windows",
]

# File suffixes that ``datasets`` reads with a packaged builder, by builder name.
_HF_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


@dataclass(frozen=True)
class Document:
    """One unit of text that is never split between training and evaluation.

    ``id`` is unique within its source (a file's relative path, a dataset row); ``source``
    names the corpus, so that results can say which text they were measured on.
    """

    id: str
    text: str
    source: str


def read_text_folder(path: str | Path, source: str | None = None) -> list[Document]:
    """All ``*.txt`` files under ``path`` (recursively, sorted by path), one document each.

    Ids are the paths relative to ``path`` without the suffix; ``source`` defaults to the path.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"text folder {str(root)!r} does not exist or is not a folder")
    files = sorted(root.rglob("*.txt"))
    if not files:
        raise ValueError(f"text folder {str(root)!r} contains no .txt files")
    return [
        Document(
            f.relative_to(root).with_suffix("").as_posix(),
            f.read_text(encoding="utf-8"),
            source or str(root),
        )
        for f in files
    ]


def _load_from_hub(datasets, name: str, split: str):
    """`datasets.load_dataset(name)`; the hub's retry warnings silenced, and a hub it cannot reach
    (offline, no local copy) an `InputError` in one line instead of a page of retries."""
    import logging

    from atskv.errors import InputError

    hub = logging.getLogger("huggingface_hub")
    level, hub.level = hub.level, logging.ERROR
    try:
        return datasets.load_dataset(name, split=split)
    except (ConnectionError, OSError) as error:
        raise InputError(
            f"hf:{name}: the Hugging Face hub is out of reach and no local copy exists ({type(error).__name__}); "
            "use a corpus name (see `atskv data list`) or a folder of .txt files"
        ) from None
    finally:
        hub.setLevel(level)


def read_hf_dataset(
    path_or_name: str | Path,
    split: str = "train",
    text_field: str = "text",
    limit: int | None = None,
) -> list[Document]:
    """Rows of a Hugging Face dataset as documents (the first ``limit`` rows if given).

    Accepts a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, a
    local data file (json, jsonl, parquet, csv, txt, arrow), a local folder of data files, or a
    hub name (which needs the hub or a local ``datasets`` cache).
    """
    import datasets  # heavy import, only needed on this path

    name = str(path_or_name)
    local = Path(name).expanduser()
    if local.is_dir() and (
        (local / "state.json").exists() or (local / "dataset_dict.json").exists()
    ):
        ds = datasets.load_from_disk(str(local))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(
                    f"dataset {name!r} has no split {split!r}; splits: {', '.join(ds)}"
                )
            ds = ds[split]
    elif local.is_file():
        builder = _HF_FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise ValueError(
                f"cannot read {name!r}: suffix not one of {', '.join(_HF_FILE_BUILDERS)}"
            )
        ds = datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
    else:
        ds = _load_from_hub(datasets, name, split)
    if text_field not in ds.column_names:
        raise ValueError(
            f"dataset {name!r} (split {split!r}) has no column {text_field!r}; "
            f"columns: {', '.join(ds.column_names)}"
        )
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [Document(f"{split}/{i}", text, name) for i, text in enumerate(ds[text_field])]


def load_corpus(spec: str | Path, cache_dir: str | Path | None = None) -> list[Document]:
    """Documents named by ``spec``: a known corpus name (fetched on first use), a folder of
    ``.txt`` files, or ``hf:<name-or-path>[:split]`` for a Hugging Face dataset (text column
    ``text``; call ``read_hf_dataset`` directly for another column)."""
    spec = str(spec)
    if spec in CORPORA:
        return read_text_folder(fetch_corpus(spec, cache_dir), source=spec)
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        return read_hf_dataset(name, split=split or "train")
    if Path(spec).expanduser().is_dir():
        return read_text_folder(spec)
    raise ValueError(
        f"corpus {spec!r} is neither a known corpus ({', '.join(sorted(CORPORA))}), "
        "an existing folder of .txt files, nor hf:<dataset name or path>[:split]"
    )


def split_documents(
    docs: Sequence[Document], held_out_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Split into (train, held_out) by whole documents, so the two never share text.

    A seeded shuffle picks ``round(held_out_fraction * len(docs))`` documents to hold out (at
    least one on each side when the fraction is strictly between 0 and 1); both parts keep the
    input order.
    """
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
    n = len(docs)
    n_held = round(held_out_fraction * n)
    if 0.0 < held_out_fraction < 1.0:
        if n < 2:
            raise ValueError(f"cannot split {n} document(s) into two non-empty parts")
        n_held = min(max(n_held, 1), n - 1)
    held = set(random.Random(seed).sample(range(n), n_held))
    return [d for i, d in enumerate(docs) if i not in held], [
        d for i, d in enumerate(docs) if i in held
    ]


def token_windows(
    docs: Sequence[Document], tokenizer, window: int, stride: int | None = None
) -> Iterator[torch.Tensor]:
    """Token-id windows (1-D ``long`` tensors of exactly ``window`` ids) over the documents.

    The documents are tokenized without special tokens and joined into one stream, separated by
    the tokenizer's EOS token when it has one; windows start every ``stride`` tokens (default:
    ``window``, no overlap) and an incomplete tail is dropped. Joining documents lets corpora of
    short documents (speeches) fill long windows. Tokenization happens before the first window
    is returned, so a corpus that is too short fails at the call, not later.
    """
    stride = window if stride is None else stride
    if window < 1 or stride < 1:
        raise ValueError(
            f"window and stride must be positive, got window={window}, stride={stride}"
        )
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids += separator
        ids += tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < window:
        raise ValueError(f"corpus too short: {len(ids)} tokens < window {window}")
    stream = torch.tensor(ids, dtype=torch.long)
    return (stream[start : start + window] for start in range(0, len(ids) - window + 1, stride))


def corpus_windows(tokenizer, corpus: str | Path, window_tokens: int, n_windows: int) -> torch.Tensor:
    """`n_windows` token windows `[N, window_tokens]` spread evenly over a corpus (see `load_corpus`
    and `token_windows`); a corpus with fewer windows is refused with the count it has."""
    every = list(token_windows(load_corpus(corpus), tokenizer, window_tokens))
    if len(every) < n_windows:
        raise ValueError(
            f"corpus {corpus!r} has only {len(every)} windows of {window_tokens} tokens; asked for {n_windows}"
        )
    step = len(every) / n_windows
    return torch.stack([every[int(i * step)] for i in range(n_windows)])
