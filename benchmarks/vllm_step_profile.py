"""Where a decode step of the vLLM plugin goes, per layer, outside vLLM: the plugin's stages on a
synthetic paged cache of the 8B shape (32/8 heads, dim 128, blocks of 16), each graph-captured and
timed alone (`triton.testing.do_bench_cudagraph`, median), beside SDPA over the whole context:
Quest, StreamingLLM, H2O's kept lists and the learned selector's queues (random lists, the
queues ranked 32 tokens ago: what a step costs does not depend on what they hold; also the 32
layers' queues read in one kernel, as the engine does, its time a layer), SparQ on
random keys, `h2o+sparq`, and the learned selector's refresh with every row due (its worst step;
rows not due exit at once). Where vLLM imports, also vLLM's own paged FlashAttention decode over
the whole context (what vanilla vLLM's layer reads), with the 32 splits vLLM allows under CUDA
graphs.
`--capacity` is the engine's max_model_len: the block table's width, which sizes a fractional
budget's index lists. `--tune` adds the sparse decode kernel of StreamingLLM's pick at other
pipeline depths and split counts (its defaults: 1 stage, `choose_split_size`), and SparQ's pick at
other slots a step and warps of its logits kernel (whole key rows a tile: `--kernels "sparq pick"`).

    python benchmarks/vllm_step_profile.py [--budget 0.05] [--capacity 131072] [--tune] [--stages "whole step"]
        [--kernels sparq]   (and each kernel of the stages named so)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from atskv.eval.kernel_times import print_kernel_times
from atskv.features import SCALAR_FEATURES
from atskv.kernels.budget import kept_count
from atskv.kernels.list_queue import queue_read
from atskv.kernels.listed_refresh import fold_mlp, refresh_listed_scores
from atskv.kernels.paged import paged_page_scores
from atskv.kernels.quest_decode import quest_pick
from atskv.kernels.sparq_decode import sparq_decode_paged
from atskv.kernels.sparse_decode import choose_split_size, sparse_decode_attention_triton
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.runtime.vllm.composition import build_paged_selector
from atskv.runtime.vllm.heavy_hitters import KeptLists
from atskv.runtime.vllm.learned import QueuedLists
from atskv.runtime.vllm.selection import (
    PagedQuest,
    PagedSparQ,
    PagedStreamingLLM,
    paged_sparse_decode,
    slot_view,
    usable_positions,
)

try:
    from vllm.vllm_flash_attn import flash_attn_varlen_func
except ImportError:  # the profile's first run goes before vLLM is unpacked
    flash_attn_varlen_func = None
SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph


parser = argparse.ArgumentParser()
parser.add_argument("--budget", type=float, default=0.05)
parser.add_argument("--capacity", type=int, default=131072)
parser.add_argument("--runs", nargs="+", default=["32768x1", "32768x8", "131072x1"])
parser.add_argument("--tune", action="store_true")
parser.add_argument("--stages", default="", help="only the stages whose name contains this")
parser.add_argument("--kernels", default=None,
                    help="also the CUDA time of each kernel of the stages whose name contains this (torch profiler)")
args = parser.parse_args()
HQ, HKV, D, BS, LAYERS = 32, 8, 128, 16, 32
dev, dt = "cuda", torch.bfloat16
print(f"{'context x batch':>16} {'stage':>28} {'us':>8}")
for run in args.runs:
    context, batch = (int(x) for x in run.split("x"))
    width = args.capacity // BS
    blocks = batch * width + 64
    kv = torch.randn(blocks, BS, HKV, 2 * D, device=dev, dtype=dt).permute(0, 2, 1, 3)  # HND view of NHD memory
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    low = torch.randn(blocks + 1, HKV, D, device=dev, dtype=dt)
    high = low + torch.rand_like(low)
    table = torch.randperm(blocks, device=dev)[: batch * width].view(batch, width).int()
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    query = torch.randn(batch, HQ, D, device=dev, dtype=dt)
    dense_k = torch.randn(batch, HKV, context, D, device=dev, dtype=dt)
    dense_v = torch.randn_like(dense_k)
    quest, streaming = PagedQuest(), PagedStreamingLLM()
    scores = paged_page_scores(query, low, high, table, seq_lens, BS)
    n_pages = min(width, -(-int(args.budget * width * BS) // BS) + 2)
    at = torch.arange(width * BS, device=dev, dtype=torch.int32)
    positions = torch.where(at < seq_lens.view(-1, 1), at, -1).unsqueeze(1).expand(batch, HKV, -1)
    picked, lengths = quest_pick(scores, positions, args.budget, seq_lens, n_pages, BS)

    def quest_step():
        chosen = quest.pick(query, HKV, (low, high), table, seq_lens, BS, args.budget)
        return paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5)

    def streaming_step():
        chosen = streaming.pick(query, HKV, None, table, seq_lens, BS, args.budget)
        return paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5)

    lists = KeptLists.empty(blocks * BS, HKV, dev)
    lists.kept.random_(0, context - 1)
    lists.kept_value.uniform_()
    sparq, key_slots = PagedSparQ(), slot_view(key_cache, 1)[0]

    def h2o_step():
        chosen = lists.step(table, seq_lens, BS, args.budget, 0.5, 0.0)
        out = paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5, want_mass=True)
        lists.add_read_mass(out[1], table, seq_lens, BS)
        return out

    queues = QueuedLists.empty(blocks * BS, HKV, dev)
    queues.kept.random_(0, context - 33)
    ranked_at = context - 32
    first = table[:, 0].long() * BS
    queues.ranked[first] = torch.tensor([ranked_at, kept_count(args.budget, ranked_at)], dtype=torch.int32, device=dev)

    layer_lists = [queues.kept] + [queues.kept.clone() for _ in range(LAYERS - 1)]
    list_width = kept_count(args.budget, width * BS)

    def learned_step():
        chosen = queues.read(table, seq_lens, BS, args.budget)
        return paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5)

    composed = build_paged_selector("h2o+sparq", {})
    spec = FeatureSpec(4096, SCALAR_FEATURES, 30, HKV)
    folded = fold_mlp(RelevanceMLP(spec, reduced_width=0, without=["hidden_norm", "token_type"]).eval().to(dev))
    slots_all = blocks * BS + 1
    key_norm, pinned = torch.rand(slots_all, HKV, device=dev), torch.zeros(slots_all, HKV, dtype=torch.bool, device=dev)
    prompt_len = torch.zeros(slots_all, dtype=torch.int32, device=dev)  # every row due (context % 16 == 0)
    refresh_width = min(width * BS, int(args.budget * width * BS) + 2)

    def refresh():
        refresh_listed_scores(lists.kept, lists.kept_value, lists.prompt_mass, key_norm, lists.prompt_mass, pinned,
                              prompt_len, table, seq_lens, BS, args.budget, 16, HQ // HKV, folded, 1,
                              refresh_width)  # fmt: skip

    def composed_step():
        chosen = composed.pick(query, HKV, lists, table, seq_lens, BS, args.budget, {}, keys=key_slots,
                               scaling=D**-0.5)  # fmt: skip
        out = paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5, want_mass=True)
        composed.observe_read(lists, out[1], table, seq_lens, BS)
        return out

    def sparq_step():
        chosen = sparq.pick(query, HKV, None, table, seq_lens, BS, args.budget, {}, keys=key_slots, scaling=D**-0.5)
        return paged_sparse_decode(query, key_cache, value_cache, *chosen, table, D**-0.5)

    stages = {
        "SDPA, whole context": lambda: F.scaled_dot_product_attention(
            query.unsqueeze(2), dense_k, dense_v, enable_gqa=True),
        "quest: page scores": lambda: paged_page_scores(query, low, high, table, seq_lens, BS),
        "quest: positions": lambda: torch.where(at < seq_lens.view(-1, 1), at, -1),
        "quest: pick": lambda: quest_pick(scores, positions, args.budget, seq_lens, n_pages, BS),
        "sparse decode of the pick": lambda: paged_sparse_decode(
            query, key_cache, value_cache, picked, lengths, table, D**-0.5),
        "quest: whole step": quest_step,
        "streaming: pick": lambda: streaming.pick(query, HKV, None, table, seq_lens, BS, args.budget),
        "streaming: whole step": streaming_step,
        "kept lists: step": lambda: lists.step(table, seq_lens, BS, args.budget, 0.5, 0.0),
        "h2o: whole step": h2o_step,
        "learned: queue read": lambda: queues.read(table, seq_lens, BS, args.budget),
        "learned: whole step": learned_step,
        "learned: queue read, 32 layers at once": lambda: queue_read(
            layer_lists, queues.ranked, table, seq_lens, BS, args.budget, list_width),
        "sparq: pick": lambda: sparq.pick(query, HKV, None, table, seq_lens, BS, args.budget, {}, keys=key_slots,
                                          scaling=D**-0.5),
        "sparq: whole step": sparq_step,
        "h2o+sparq: whole step": composed_step,
        "learned refresh, every row due": refresh,
    }  # fmt: skip
    if args.tune:
        recent, recent_lengths = streaming.pick(query, HKV, None, table, seq_lens, BS, args.budget)
        keys, values = slot_view(key_cache, batch), slot_view(value_cache, batch)
        split = choose_split_size(recent.shape[-1], batch * HKV, D, query.device)
        for depth in (1, 2, 3):
            for more in (1, 2, 4):
                stages[f"streaming decode: {depth} st, {more}x splits"] = (
                    lambda depth=depth, more=more: sparse_decode_attention_triton(
                        query, keys, values, recent, recent_lengths, D**-0.5, block_table=table, block_size=BS,
                        split_size=max(1, split // more), num_stages=depth))  # fmt: skip
        sparq_positions, sparq_rank = usable_positions(seq_lens, width * BS), sparq.rank(D)
        for block_s in (32, 64, 128, 256):  # the paged logits kernel's slots a step (PAGED_BLOCK_S: the default)
            for warps in (4, 8):
                stages[f"sparq pick: {block_s} slots, {warps} warps"] = (
                    lambda block_s=block_s, warps=warps: sparq_decode_paged(
                        query, key_slots, table, BS, sparq_positions, seq_lens, D**-0.5, sparq_rank, args.budget,
                        kept_count(args.budget, width * BS), block_s=block_s, warps=(8, warps, 8, 8)))  # fmt: skip
    if flash_attn_varlen_func is not None:
        starts = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        stages |= {
            "vLLM flash, whole context": lambda: flash_attn_varlen_func(
                q=query, k=key_cache, v=value_cache, cu_seqlens_q=starts, max_seqlen_q=1, seqused_k=seq_lens,
                max_seqlen_k=context, softmax_scale=D**-0.5, causal=True, block_table=table, num_splits=SPLITS,
                fa_version=3),
        }  # fmt: skip
    for name, fn in ((n, f) for n, f in stages.items() if args.stages in n):
        fn()
        torch.cuda.synchronize()
        share = LAYERS if "layers at once" in name else 1  # printed a layer
        print(f"{run:>16} {name:>28} {do_bench_cudagraph(fn, rep=50) * 1e3 / share:8.1f}", flush=True)
        if args.kernels is not None and args.kernels in name:
            print_kernel_times(fn)

