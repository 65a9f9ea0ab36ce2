"""How often the vLLM plugin's host-tier page cache misses under a real model's attention, on the
CPU: a real model's eager attention over one window of a corpus; its last `--steps` queries stand
in for decode steps. Each step every layer and KV head reads its `--pages` best pages of the
prompt (16-token pages before the recent window, ranked by the attention mass they get: an oracle
where the plugin ranks by Quest's bounds), through the plugin's own cache bookkeeping
(`atskv.kernels.page_cache.assign_slots`: least recently used slots, `--cache_pages` of them).
Prints the share of wanted pages that miss (what crosses PCIe) a step, per cache size, beside the
same for a random model of the shape (what vLLM's dummy weights give the speed benchmarks).

    python benchmarks/page_cache_proxy.py [--model smollm2-135m] [--tokens 8192] [--cache_pages 16 32 64 128]
"""

from __future__ import annotations

import argparse

import torch
from corpus_window import load_window, sparse_layer_weights, window_arguments

from atskv.kernels.page_cache import assign_slots

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
window_arguments(parser, tokens=8192)
parser.add_argument("--steps", type=int, default=64, help="the window's last queries, read as decode steps")
parser.add_argument("--pages", type=int, default=16, help="pages read back a step, layer and KV head")
parser.add_argument("--cache_pages", type=int, nargs="+", default=[16, 32, 64, 128])
parser.add_argument("--page_size", type=int, default=16)
parser.add_argument("--recent", type=int, default=512, help="the last tokens, kept on the GPU: never parked")
args = parser.parse_args()


def page_masses(model) -> list[torch.Tensor]:
    """Per layer the plugin makes sparse, `[steps, Hkv, P]`: each step's attention mass on each
    parked page."""
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    parked_pages = (args.tokens - args.steps - args.recent) // args.page_size
    masses: list[torch.Tensor] = []

    def observe(layer: int, weights: torch.Tensor) -> None:
        steps = weights[:, -args.steps :, : parked_pages * args.page_size].float()  # [Hq, steps, T]
        grouped = steps.view(kv_heads, heads // kv_heads, args.steps, parked_pages, args.page_size)
        masses.append(grouped.sum((1, 4)).transpose(0, 1))

    sparse_layer_weights(model, ids, args.dense_layers, observe)
    return masses


def miss_share(masses: list[torch.Tensor], cache_pages: int) -> float:
    """The share of the wanted pages that miss, over the steps after the first (a cold cache)."""
    wanted = torch.stack([m.topk(args.pages, dim=-1).indices for m in masses], 1)  # [steps, layers, Hkv, R]
    n, kv_heads, pages = wanted.shape[1], wanted.shape[2], masses[0].shape[-1]
    slot_of = torch.full((n, kv_heads, pages + 1), -1, dtype=torch.long)
    page_in = torch.full((n, kv_heads, cache_pages + 1), pages, dtype=torch.long)
    used = torch.zeros(n, kv_heads, cache_pages, dtype=torch.long)
    misses = 0
    for step, best in enumerate(wanted):
        _, hit = assign_slots(slot_of, page_in, used, torch.tensor([step + 1]), best)
        misses += int((~hit).sum()) if step else 0
    return misses / ((len(wanted) - 1) * wanted[0].numel())


loaded, ids = load_window(args)
real = loaded.model
torch.manual_seed(0)
dummy = type(real)(real.config).eval()
dummy.set_attn_implementation("eager")
for label, model in (("real weights", real), ("random weights", dummy)):
    masses = page_masses(model)
    shares = ", ".join(f"{c} cached {miss_share(masses, c):.3f}" for c in args.cache_pages)
    print(f"{args.model} {label}, {args.tokens} tokens, {args.pages} of {masses[0].shape[-1]} pages a step: "
          f"pages missed a step: {shares}", flush=True)  # fmt: skip
