"""One window of a corpus through a real model, for the CPU proxies (`prompt_sample_proxy.py`,
`page_cache_proxy.py`): their shared arguments and the window's token ids."""

from __future__ import annotations

import argparse

import torch

from atskv.data.readers import load_corpus
from atskv.models.loading import load_model


def window_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="austen")
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--start", type=int, default=20000, help="the window's first token in the corpus")
    parser.add_argument("--dense_layers", type=int, default=2)


def load_window(args: argparse.Namespace):
    """The loaded model (eager attention: the weights themselves) and the window `[1, tokens]`."""
    loaded = load_model(args.model)
    loaded.model.set_attn_implementation("eager")
    text = " ".join(d.text for d in load_corpus(args.corpus)[:2])
    ids: torch.Tensor = loaded.tokenizer(text, return_tensors="pt").input_ids[:, args.start : args.start + args.tokens]
    return loaded, ids
