"""Text for training and evaluation: offline corpora, readers, and synthetic long-context tasks."""

from .corpora import CORPORA, CorpusFetchError, MissingToolError, fetch_corpus
from .readers import (
    Document,
    corpus_windows,
    load_corpus,
    read_hf_dataset,
    read_text_folder,
    split_documents,
    token_windows,
)
from .tasks import CLASSIC_FILLER, TASKS, TaskExample, filler_text, passkey_example, synthetic_filler

__all__ = [
    "CLASSIC_FILLER",
    "CORPORA",
    "TASKS",
    "CorpusFetchError",
    "Document",
    "corpus_windows",
    "MissingToolError",
    "TaskExample",
    "fetch_corpus",
    "filler_text",
    "load_corpus",
    "passkey_example",
    "read_hf_dataset",
    "read_text_folder",
    "split_documents",
    "synthetic_filler",
    "token_windows",
]
