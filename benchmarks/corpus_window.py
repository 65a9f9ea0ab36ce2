"""One window of a corpus through a real model, for the CPU proxies (`prompt_sample_proxy.py`,
`page_cache_proxy.py`): their shared arguments, the window's token ids and the attention weights
of the layers the vLLM plugin makes sparse."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from atskv.data.readers import load_corpus
from atskv.models.geometry import attention_modules, model_geometry
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


def sparse_layer_weights(model, ids: torch.Tensor, dense_layers: int, observe: Callable[[int, torch.Tensor], None]):
    """One eager forward of `ids` `[1, L]`: `observe(layer, weights [Hq, L, L])` for each layer the
    plugin makes sparse (global, past the first `dense_layers`; Gemma's sliding-window layers stay
    vLLM's). No layer's weights are kept in the outputs (8K tokens: GiBs a layer)."""
    managed = {i for i in model_geometry(model.config).global_layers if i >= dense_layers}

    def hook(module, _inputs, output):
        if module.layer_idx in managed:
            observe(module.layer_idx, output[1][0])
        return (output[0], None, *output[2:])

    hooks = [m.register_forward_hook(hook) for m in attention_modules(model)]
    try:
        with torch.no_grad():
            model(ids, output_attentions=True)
    finally:
        for handle in hooks:
            handle.remove()
