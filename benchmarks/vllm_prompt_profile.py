"""Where a prefill chunk's prompt scoring goes, per layer, outside vLLM: what the plugin's H2O and
learned selectors run after each chunk's FlashAttention (`observe_prompt`), on a synthetic paged
cache of the 8B shape (32/8 heads, dim 128, blocks of 16), for one chunk of `--chunk` queries
ending at each `--lengths` token (the request's length so far), with the chunk's log-sum-exps
given as FlashAttention returns them. Beside the whole call, its parts: the keys gathered through
the block table (what the kernels, reading them in place, no longer copy; a chunk without its
log-sum-exps still does), the received-mass kernel (every query, or every `prompt_sample`-th), and what
the learned selector adds (features, the predictor over every token so far, the list rebuilt),
the predictor's kernel alone, the list's tokens picked (a sort of all, a top-k), and the ranking
of a predictor that reads no attention received.
The time to first token of these selectors is vLLM's prefill plus this, summed over a prompt's
chunks and the sparse layers: a chunk at length L costs O(L), so a prompt of n chunks pays about
(n + 1) / 2 times its last chunk's cost. Median of `triton.testing.do_bench` (eager, synchronised).

    python benchmarks/vllm_prompt_profile.py [--lengths 16384 65536 131072] [--chunk 16384] [--samples 1 8]
        [--kernels "learned"]   (and each CUDA kernel of the stages named so)
        [--sweep]               (also the predictor's kernel and the mass kernel at each setting of
                                 SCORES_SWEEP and MASS_SWEEP)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

from atskv.attention import sampled_queries
from atskv.eval.kernel_times import print_kernel_times
from atskv.eval.vllm_speed import random_engine_predictor
from atskv.kernels.budget import kept_count
from atskv.kernels.prompt_scores import paged_prompt_scores, prompt_scores_triton
from atskv.kernels.received_mass import prefix_lse, prefix_received_mass_triton
from atskv.runtime.vllm.batch import PromptChunk
from atskv.runtime.vllm.composition import build_paged_selector
from atskv.runtime.vllm.heavy_hitters import chunk_mass
from atskv.runtime.vllm.prompt_ranks import top_newest_first
from atskv.runtime.vllm.selection import slot_view

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 131072])
parser.add_argument("--chunk", type=int, default=16384, help="queries of the chunk (vLLM's max_num_batched_tokens)")
parser.add_argument("--samples", type=int, nargs="+", default=[1, 8], help="prompt_sample values")
parser.add_argument("--budget", type=float, default=0.05)
parser.add_argument("--kernels", default=None, help="also each CUDA kernel of the stages whose name contains this")
parser.add_argument("--sweep", action="store_true", help="also the kernels at each setting of the sweeps")
args = parser.parse_args()
SCORES_SWEEP = [(j, h, w, mma) for j in (32, 64, 128) for h in (16, 32, 64) for w in (4, 8)
                for mma in (False, True)]  # block_j, block_h, warps, tensor cores  # fmt: skip
MASS_SWEEP = [(n, m, h, w) for n in (64, 128) for m in (16, 32, 64) for h in (1, 2, 4) for w in (4, 8)
              if m * h <= 128]  # block_n, block_m, heads_per_step, warps  # fmt: skip
HQ, HKV, D, BS, LAYER = 32, 8, 128, 16, 5
dev, dt = "cuda", torch.bfloat16
predictor = random_engine_predictor("llama3.1-8b", 0, Path(tempfile.mkdtemp()) / "predictor")
massless = random_engine_predictor("llama3.1-8b", 0, Path(tempfile.mkdtemp()) / "massless", received=False)


print(f"{'length':>8} {'stage (one layer, one chunk)':>62} {'us':>10}")
for length in args.lengths:
    n = min(args.chunk, length)
    blocks = -(-length // BS) + 64
    key_cache = torch.randn(blocks, BS, HKV, D, device=dev, dtype=dt)
    key_slots = slot_view(key_cache, 1)[0]
    table_row = torch.randperm(blocks, device=dev)[: -(-length // BS)].int()
    queries = torch.randn(n, HQ, D, device=dev, dtype=dt)

    def chunk(lse):
        return PromptChunk(queries, key_slots, table_row, length, BS, D**-0.5, args.budget, LAYER, 0, {}, lse)

    keys = chunk(None).keys()
    lse = prefix_lse(queries.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), length - n, D**-0.5)[0]
    stages = {"keys gathered through the block table": lambda: chunk(lse).keys()}
    unread = build_paged_selector("learned", {"predictor": str(massless)})  # no mass: the ranking alone
    unread_state = unread.new_state(blocks, BS, HKV, D, dt, dev)
    attention = torch.rand(HKV, length, device=dev)
    stages |= {
        "learned: the predictor over the prompt (paged_prompt_scores)": (
            lambda: paged_prompt_scores(attention, attention[0], key_slots, table_row, BS, length, unread.folded, 1)),
        "the list's tokens: every token sorted (as before the top-k)": (
            lambda: length - 1 - attention.flip(-1).sort(dim=-1, descending=True, stable=True).indices[
                :, : kept_count(args.budget, length)]),
        "the list's tokens: a top-k (top_newest_first)": (
            lambda: top_newest_first(attention, kept_count(args.budget, length))),
        "learned without the attention received: observe_prompt": (
            lambda: unread.observe_prompt(unread_state, chunk(None))),
    }  # fmt: skip
    for j, h, w, mma in SCORES_SWEEP if args.sweep else ():
        stages[f"predictor's kernel, block_j {j}, block_h {h}, {w} warps{', tensor cores' if mma else ''}"] = (
            lambda j=j, h=h, w=w, mma=mma: prompt_scores_triton(attention, attention[0], key_slots, unread.folded, 1,
                                                                j, h, (table_row, BS, length), w, mma))  # fmt: skip
    for s in args.samples:
        h2o = build_paged_selector("h2o", {"prompt_sample": s})
        learned = build_paged_selector("learned", {"predictor": str(predictor), "prompt_sample": s})
        h2o_state = h2o.new_state(blocks, BS, HKV, D, dt, dev)
        learned_state = learned.new_state(blocks, BS, HKV, D, dt, dev)
        picked = sampled_queries(n, s)
        q = queries.transpose(0, 1).unsqueeze(0)[:, :, picked]
        for bn, bm, h, w in MASS_SWEEP if args.sweep else ():
            stages[f"mass kernel, prompt_sample {s}, block_n {bn}, block_m {bm}, {h} heads a step, {w} warps"] = (
                lambda q=q, s=s, picked=picked, bn=bn, bm=bm, h=h, w=w: prefix_received_mass_triton(
                    q, key_slots.unsqueeze(0), lse[None, :, picked], length - n + picked.start, D**-0.5,
                    query_stride=s, table=(table_row, BS, length), block_n=bn, block_m=bm, heads_per_step=h,
                    num_warps=w))  # fmt: skip
        stages |= {
            f"received mass, prompt_sample {s}": lambda s=s: chunk_mass(chunk(lse), s),
            f"h2o: observe_prompt, prompt_sample {s}": lambda h2o=h2o, st=h2o_state: h2o.observe_prompt(st, chunk(lse)),
            f"learned: observe_prompt, prompt_sample {s}": (
                lambda learned=learned, st=learned_state: learned.observe_prompt(st, chunk(lse))),
        }  # fmt: skip
    for name, fn in stages.items():
        fn()
        torch.cuda.synchronize()
        print(f"{length:>8} {name:>62} {do_bench(fn, rep=200) * 1e3:10.1f}", flush=True)
        if args.kernels is not None and args.kernels in name:
            print_kernel_times(fn, calls=3, top=10, indent=8)
