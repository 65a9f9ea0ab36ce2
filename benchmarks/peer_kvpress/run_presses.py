"""Run NVIDIA kvpress presses on task examples: the external half of `atskv eval peer`.

Standalone: executed by the python of the kvpress venv (see setup.sh), never imported by atskv,
because kvpress pins an older transformers than atskv's.

For each example and press, the whole prompt is prefilled under the press, so the compression
covers the question too (the prompt ends with the question, as atskv runs it); kvpress's own
pipeline would instead compress only a context and append the question uncompressed. Every
layer is compressed, after that layer's (dense) prefill attention, as kvpress does (Gemma 3: its
global layers only, kvpress's rule, see `press_on`); then greedy
decoding continues on the compressed cache at the original positions, as kvpress's pipeline
does, until EOS or `--max-new-tokens`. Press parameters are kvpress's defaults.

Input: a JSON list of examples with `id`, `prompt`, `answer`. Output: a JSON list of records
`{id, press, compression_ratio, prompt_tokens, kept_tokens, kv_bytes, new_tokens, text}`, where
`kept_tokens` is the mean over layers of the tokens left after prefill compression (a
sliding-window layer's cache, built from the config as `generate` builds it, holds its window) and
`kv_bytes` the bytes of the cache's tensors after generation. Press `none` runs with full KV
(a check that this environment reproduces atskv's dense answers).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
from pathlib import Path

import kvpress
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

PRESSES = {
    "none": None,
    "snapkv": kvpress.SnapKVPress,
    "streaming_llm": kvpress.StreamingLLMPress,
    "observed_attention": kvpress.ObservedAttentionPress,
    "expected_attention": kvpress.ExpectedAttentionPress,
    "tova": kvpress.TOVAPress,
    "kvzip": kvpress.KVzipPress,  # scores by replaying the prompt: 2-3x the prefill (not for Gemma 3)
}
# ObservedAttentionPress scores with the attention weights the layer returns: an eager prefill.
# Its decode runs on SDPA: eager attention adds the full-length mask to a compressed layer's
# keys (Gemma 3: "size of tensor a (3073) must match ... (4097)"), SDPA needs no mask there.
NEEDS_EAGER = {"observed_attention"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, required=True, help="JSON list of {id, prompt, answer}")
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    parser.add_argument("--presses", nargs="+", default=sorted(set(PRESSES) - {"none"}), choices=sorted(PRESSES))
    parser.add_argument("--compression-ratios", nargs="*", type=float, default=[], help="for every press but none")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if not args.compression_ratios and set(args.presses) - {"none"}:
        parser.error("--compression-ratios is needed for any press but none")
    return args


@contextlib.contextmanager
def press_on(press, model):
    """`press(model)`, with kvpress's Gemma 3 rule (compress only the layers without a sliding
    window) for the text-only `Gemma3ForCausalLM` too: kvpress 0.5.5 applies it only to
    `Gemma3ForConditionalGeneration` and otherwise prunes the 512-token sliding caches as well
    (every needle lost at any ratio, 0.5 included). The press hooks the layers it finds in
    `model.model.layers` when entered, so it is shown the global ones only, then the list is put
    back; their rotary embedding is the global layers' (`global_rotary`)."""
    inner = model.model
    layers = inner.layers
    with contextlib.ExitStack() as stack:
        inner.layers = torch.nn.ModuleList([x for x in layers if not getattr(x.self_attn, "is_sliding", False)])
        try:
            stack.enter_context(press(model))
        finally:
            inner.layers = layers
        stack.enter_context(global_rotary(inner))
        yield


@contextlib.contextmanager
def global_rotary(inner):
    """Gemma 3's rotary embedding takes the layer type it rotates for; kvpress's expected attention
    calls it without one (`'Gemma3RotaryEmbedding' object has no attribute 'None_inv_freq'`). Only
    global layers are pressed (`press_on`), so inside the block a call without a type gets theirs."""
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        yield
        return
    typed = rotary.forward
    rotary.forward = lambda x, position_ids, layer_type=None: typed(x, position_ids, layer_type or "full_attention")
    try:
        yield
    finally:
        del rotary.forward  # the class's own again


@contextlib.contextmanager
def attention(model, implementation: str):
    """`model` attends with `implementation` inside the block, with its own outside."""
    own = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def greedy_with_press(
    model, tokenizer, ids: torch.Tensor, press, max_new_tokens: int, eager_prefill: bool = False
) -> dict:
    """Prefill `ids` `[1, T]` under `press` (None: full KV; `eager_prefill`: through eager
    attention), then greedy decode without it."""
    cache = DynamicCache(config=model.config)  # sliding-window layers keep their window, as in generate
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    with torch.inference_mode():
        with press_on(press, model) if press is not None else contextlib.nullcontext():
            with attention(model, "eager") if eager_prefill else contextlib.nullcontext():
                out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        kept = [layer.keys.shape[-2] for layer in cache.layers]  # held (a window's seq length counts all seen)
        new = [int(out.logits[0, -1].argmax())]
        position = ids.shape[1]
        while len(new) < max_new_tokens and new[-1] not in stop:
            step = torch.tensor([[new[-1]]], device=ids.device)
            where = torch.tensor([[position]], device=ids.device)
            out = model(input_ids=step, past_key_values=cache, position_ids=where)
            new.append(int(out.logits[0, -1].argmax()))
            position += 1
    return {
        "prompt_tokens": ids.shape[1],
        "kept_tokens": sum(kept) / len(kept),
        "kv_bytes": sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
        "new_tokens": len(new),
        "text": tokenizer.decode(new, skip_special_tokens=True),
    }


def main(args: argparse.Namespace) -> None:
    hf_logging.disable_progress_bar()
    examples = json.loads(args.examples.read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).to(args.device).eval()
    records = []
    for name in args.presses:
        ratios = [0.0] if PRESSES[name] is None else args.compression_ratios
        for ratio in ratios:
            press = None if PRESSES[name] is None else PRESSES[name](compression_ratio=ratio)
            for example in examples:
                ids = tokenizer(example["prompt"], return_tensors="pt").input_ids.to(args.device)
                result = greedy_with_press(model, tokenizer, ids, press, args.max_new_tokens, name in NEEDS_EAGER)
                records.append({"id": example["id"], "press": name, "compression_ratio": ratio, **result})
                print(f"{name}@{ratio:g} {example['id']}: {result['text'].strip()[:40]!r}", flush=True)
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(parse_args())
