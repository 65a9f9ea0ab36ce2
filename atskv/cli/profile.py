"""`atskv profile kascade`: the per-model profiles that selectors need."""

from __future__ import annotations

from pathlib import Path

from atskv.cli.common import load
from atskv.models import DEFAULT_MODEL


def kascade(
    model: str = DEFAULT_MODEL,
    corpus: str = "austen",
    windows: int = 16,
    window_tokens: int = 2048,
    n_anchors: int | None = None,
    topk: int = 64,
    queries: int = 64,
    dense_layers: int = 2,
    out: Path | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> Path:
    """Compute the Kascade profile of MODEL (anchor layers, head map) on development text and save it.

    Use a corpus that is not used for evaluation, so the profile is not fitted to the test text.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        corpus: development text: a corpus name, a folder of .txt files or hf:<dataset>.
        windows: token windows to measure on, spread evenly over the corpus.
        window_tokens: tokens per window.
        n_anchors: anchor layers to choose, the first managed layer included; default the paper's 5,
            or every managed layer where there are fewer.
        topk: tokens per top-k set when measuring similarity (the paper: 64).
        queries: the last queries of each window whose attention is measured.
        dense_layers: the first layers the hook keeps dense; use the same value at run time.
        out: output JSON (default: <cache>/profiles/<model name>/kascade.json).
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU).
    """
    from atskv.data import corpus_windows
    from atskv.runtime.reference.sparse import sparse
    from atskv.selectors.kascade import compute_kascade_profile, default_profile_path

    loaded = load(model, device, dtype, announce=False)
    profile = compute_kascade_profile(
        loaded.model,
        list(corpus_windows(loaded.tokenizer, corpus, window_tokens, windows)),
        n_anchors,
        topk,
        sparse=sparse,
        queries=queries,
        dense_layers=dense_layers,
        model_name=loaded.name,
        dev_set=f"{corpus}: {windows} windows of {window_tokens} tokens spread over the corpus",
    )
    path = profile.save(out or default_profile_path(loaded.name))
    print(f"anchors {profile.anchors} of managed layers {profile.managed_layers[0]}..{profile.managed_layers[-1]}")
    print(f"saved to {path}")
    return path


COMMANDS = {
    "kascade": kascade,
    "_help": "Per-model profiles that selectors need (Kascade's anchor layers and head map).",
}
