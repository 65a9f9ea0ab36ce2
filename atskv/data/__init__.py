"""Text for training and evaluation: offline corpora, readers, and synthetic long-context tasks."""

from .corpora import CORPORA, CorpusFetchError, MissingToolError, fetch_corpus
from .haystack import CLASSIC_FILLER, TASKS, TaskExample, passkey_example, synthetic_filler
from .readers import (
    Document,
    load_corpus,
    read_hf_dataset,
    read_text_folder,
    split_documents,
    token_windows,
)

__all__ = [
    "CLASSIC_FILLER",
    "CORPORA",
    "TASKS",
    "CorpusFetchError",
    "Document",
    "MissingToolError",
    "TaskExample",
    "fetch_corpus",
    "load_corpus",
    "passkey_example",
    "read_hf_dataset",
    "read_text_folder",
    "split_documents",
    "synthetic_filler",
    "token_windows",
]
