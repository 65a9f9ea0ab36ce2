"""How much H2O's heavy hitters change when the prompt's attention mass comes from every s-th query
(the vLLM plugin's `prompt_sample`), on the CPU: a real model's eager attention over one window
of a corpus, every layer's weights summed over all queries and over every s-th (the chunk's last
among them, times s), then each KV head's heavy hitters outside the recent half of the budget.
Prints, per s, the share of the exact heavy hitters kept and their exact mass over the exact
choice's (what a changed choice costs), averaged over the layers past `--dense_layers`.

    python benchmarks/prompt_sample_proxy.py [--model smollm2-135m] [--tokens 4096] [--samples 2 4 8 16]
"""

from __future__ import annotations

import argparse

import torch
from corpus_window import load_window, sparse_layer_weights, window_arguments

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
window_arguments(parser, tokens=4096)
parser.add_argument("--ratio", type=float, default=0.875, help="share of the prompt's KV not kept")
parser.add_argument("--samples", type=int, nargs="+", default=[2, 4, 8, 16, 32])
args = parser.parse_args()

loaded, ids = load_window(args)
model, length = loaded.model, args.tokens
heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
budget = round(length * (1 - args.ratio))
recent = budget // 2
stats: dict[int, list[tuple[int, float, float]]] = {s: [] for s in args.samples}


def mass_by_kv_head(weights: torch.Tensor) -> torch.Tensor:
    """`[Hq, n, L]` attention weights -> `[Hkv, L]` summed over the queries and each group."""
    return weights.sum(1).view(kv_heads, heads // kv_heads, -1).sum(1)


def heavy_hitters(mass: torch.Tensor) -> torch.Tensor:
    return mass[:, : length - recent].topk(budget - recent, dim=-1).indices


def observe(layer: int, weights: torch.Tensor) -> None:
    weights = weights.double()  # [Hq, L, L]
    exact = mass_by_kv_head(weights)
    chosen = heavy_hitters(exact)
    for s in args.samples:
        estimate = mass_by_kv_head(weights[:, s - 1 :: s]) * s  # every s-th query, the last among them
        picked = heavy_hitters(estimate)
        shared = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(chosen, picked)) / chosen.numel()
        kept_mass = (exact.gather(1, picked).sum() / exact.gather(1, chosen).sum()).item()
        stats[s].append((layer, shared, kept_mass))


sparse_layer_weights(model, ids, args.dense_layers, observe)
for s in args.samples:
    rows = stats[s]
    worst = min(rows, key=lambda r: r[1])
    print(f"prompt_sample {s:2d}: heavy hitters shared with the exact choice {sum(r[1] for r in rows) / len(rows):.3f} "
          f"(worst: layer {worst[0]}, {worst[1]:.3f}); their exact mass over the exact choice's "
          f"{sum(r[2] for r in rows) / len(rows):.4f}")
