"""Where Quest's page pick (`atskv.kernels.quest_decode.quest_pick`) spends its time, on a GPU.

Random page scores at the Llama-3-8B shape (8 KV heads), 2,048 and 8,192 pages of 16 tokens (32K
and 128K contexts), a 5% budget (the selector's page count: ceil(k / 16) + 2), B = 1 and 16. Each
line is one call's time from a CUDA graph of 16 calls (median of 5 replays), as the decode step
runs it. Lines:

- `single`: the pick before this benchmark (one program per row does everything); with
  `--stages`, `single<=N` is that program cut after stage N (0 loads the row, 1 finds the n-th
  best key, 2 gathers the chosen pages, 3 ranks them; 4 is the whole): time-only copies that say
  which stage costs.
- `pick`: the package's pick (one program per row searches for the chosen pages, a few bits per
  pass; then many programs per row rank them and lay out their slots), beside the earlier
  picks' figures from the table below (same shape): the two kernels with a bit-by-bit search
  and af1aaf1's one kernel; its kernels alone (`search`, `layout`) and, with `--sweep`, its
  tuning knobs (`num_warps` and `radix`, bits per pass, for the search; `chunk`, chosen pages
  per program, and `block_j` for the layout).

Every full variant is checked against the torch reference first, and the pick on tie-heavy rows.
One H200, torch 2.11, Triton 3.6, 2026-11-24 (us; a graph node alone: 0.75 us); `pick` and its
kernels here are the two-kernel pick with one bit per pass (~26 passes), `pick, one kernel` is
af1aaf1's (each program repeated the search, a few bits per pass, then laid out its chunk):

| | P=2048 B=1 | B=16 | P=8192 B=1 | B=16 |
|---|---|---|---|---|
| single | 15.4 | 17.3 | 60.9 | 66.8 |
| its stages: load, search, gather, rank, layout | 1.4, 5.1, 1.8, 4.3, 3.0 | | 1.7, 10.0, 4.5, 26, 19 | |
| pick | 10.6 | 13.7 | 22.7 | 43.8 |
| pick: best alone | 7.4 | 8.6 | 16.4 | 16.7 |
| pick, one kernel | 8.6 | 15.5 | 22.7 | 125.8 |

    PYTHONPATH=. python3 benchmarks/quest_pick_timing.py [--sweep] [--stages] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import triton
import triton.language as tl

from atskv.kernels.budget import budget_limit
from atskv.kernels.quest_decode import pick_best, pick_layout, quest_pick_reference, quest_pick_triton

EARLIER_PICKS_US = {  # the table's `pick` and `pick, one kernel`, by (pages, batch)
    "two kernels, 1 bit/pass": {(2048, 1): 10.6, (2048, 16): 13.7, (8192, 1): 22.7, (8192, 16): 43.8},
    "one kernel": {(2048, 1): 8.6, (2048, 16): 15.5, (8192, 1): 22.7, (8192, 16): 125.8},
}


@triton.jit
def _single_kernel(
    score_ptr, valid_ptr, ctx_ptr, scratch_ptr, idx_ptr, len_ptr,
    n_rows, n_kv_heads, n_pages, n_slots, n_best, budget,
    sv_b, sv_h, sv_s,
    FRACTION: tl.constexpr, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_BEST: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The pick before this benchmark (one program per row: a 32-pass bit-by-bit search, a
    pairwise ranking in chunks, the layout), run up to stage STAGES; earlier stages store what
    they found so that nothing is compiled away."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_kv_heads
    h = bh % n_kv_heads
    keys_at = scratch_ptr + bh * n_best
    ids_at = keys_at + n_rows * n_best
    ranked_at = ids_at + n_rows * n_best
    p = tl.arange(0, BLOCK_P)
    score = tl.load(score_ptr + bh * n_pages + p, mask=p < n_pages, other=float("-inf")) + 0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(p < n_pages, key, -2147483648)
    unsigned = (key ^ -2147483648).to(tl.uint32, bitcast=True)
    if STAGES == 0:
        tl.store(len_ptr + bh, tl.max(key, 0))
    else:
        threshold = tl.full([], 0, tl.uint32)
        one = tl.full([], 1, tl.uint32)
        for bit in tl.static_range(32):
            trial = threshold | (one << (31 - bit))
            threshold = tl.where(tl.sum((unsigned >= trial).to(tl.int32), 0) >= n_best, trial, threshold)
        if STAGES == 1:
            tl.store(len_ptr + bh, threshold.to(tl.int32, bitcast=True))
        else:
            above = unsigned > threshold
            tie = unsigned == threshold
            need = n_best - tl.sum(above.to(tl.int32), 0)
            chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
            at = tl.cumsum(chosen.to(tl.int32), 0) - 1
            tl.store(keys_at + at, key, mask=chosen)
            tl.store(ids_at + at, p, mask=chosen)
            if STAGES >= 3:
                tl.debug_barrier()
                m = tl.arange(0, BLOCK_BEST)
                m_ok = m < n_best
                km = tl.load(keys_at + m, mask=m_ok, other=0)[None, :]
                im = tl.load(ids_at + m, mask=m_ok, other=0)[None, :]
                c = tl.arange(0, CHUNK)
                for js in range(0, n_best, CHUNK):
                    j_ok = js + c < n_best
                    kj = tl.load(keys_at + js + c, mask=j_ok, other=0)[:, None]
                    ij = tl.load(ids_at + js + c, mask=j_ok, other=0)[:, None]
                    ahead = m_ok[None, :] & ((km > kj) | ((km == kj) & (im < ij)))
                    tl.store(ranked_at + tl.sum(ahead.to(tl.int32), 1), tl.reshape(ij, [CHUNK]), mask=j_ok)
            if STAGES >= 4:
                tl.debug_barrier()
                j = tl.arange(0, BLOCK_BEST)
                page = tl.load(ranked_at + j, mask=j < n_best, other=0)
                o = tl.arange(0, BLOCK_SIZE)
                raw = page[:, None] * SIZE + (SIZE - 1 - o)[None, :]
                present = (j < n_best)[:, None] & (o < SIZE)[None, :]
                in_range = present & (raw < n_slots)
                slot = tl.minimum(raw, n_slots - 1)
                valid = tl.load(valid_ptr + b * sv_b + h * sv_h + slot * sv_s, mask=in_range, other=0)
                usable = in_range & (valid != 0)
                spare = present & ~usable
                u, x = usable.to(tl.int32), spare.to(tl.int32)
                u_page, x_page = tl.sum(u, 1), tl.sum(x, 1)
                total = tl.sum(u_page, 0)
                at_usable = (tl.cumsum(u_page, 0) - u_page)[:, None] + tl.cumsum(u, 1) - u
                at_spare = total + (tl.cumsum(x_page, 0) - x_page)[:, None] + tl.cumsum(x, 1) - x
                row = idx_ptr + bh * n_best * SIZE
                tl.store(row + tl.where(usable, at_usable, at_spare), slot, mask=present)
                limit = budget_limit(tl.load(ctx_ptr + b), budget, FRACTION)
                tl.store(len_ptr + bh, tl.minimum(limit, total).to(tl.int32))


def single_pick(scores, valid, budget, context, n_pages, page_size, stages=4):
    """`_single_kernel`'s launch as the package made it."""
    b, hkv, pages = scores.shape
    scratch = torch.empty(3, b * hkv, n_pages, dtype=torch.int32, device=scores.device)
    indices = torch.empty(b, hkv, n_pages * page_size, dtype=torch.int32, device=scores.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=scores.device)
    block_p = triton.next_power_of_2(pages)
    _single_kernel[(b * hkv,)](
        scores, valid.view(torch.uint8), context, scratch, indices, lengths,
        b * hkv, hkv, pages, valid.shape[-1], n_pages, budget, *valid.stride(),
        FRACTION=isinstance(budget, float), SIZE=page_size, BLOCK_SIZE=triton.next_power_of_2(page_size),
        BLOCK_P=block_p, BLOCK_BEST=triton.next_power_of_2(n_pages), CHUNK=64, STAGES=stages,
        num_warps=4 if block_p <= 2048 else 8,
    )  # fmt: skip
    return indices, lengths


@triton.jit
def _one_store_kernel(out_ptr):
    """The floor: a graph node that stores one value."""
    tl.store(out_ptr + tl.program_id(0), 1)


def check_ties():
    """The pick against the reference where ties decide (integer scores, empty pages), on uneven
    row lengths and page sizes, with the knobs at their defaults and at other values."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for pages, size, n_pages in ((300, 8, 120), (5000, 5, 700)):
        scores = torch.randint(-4, 4, (3, 8, pages), device="cuda", generator=g).float()
        scores[scores == -4] = -math.inf
        slots = pages * size - size // 2
        valid = torch.rand(3, 8, slots, device="cuda", generator=g) > 0.2
        case = (scores, valid, 0.05, torch.tensor([slots, 100, 7], device="cuda"), n_pages, size)
        want = quest_pick_reference(*case)
        for knobs in ({}, dict(chunk=32, block_j=128), dict(radix=1), dict(radix=3, chunk=16)):
            got = quest_pick_triton(*case, **knobs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (pages, knobs)
    print("ties: the pick matches the reference", flush=True)


def graph_us(fn, calls=16, replays=20, repeats=5) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `calls` calls."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * calls))
    return statistics.median(times)


def inputs(batch, pages, size=16, hkv=8, budget=0.05, seed=0):
    """Page scores as the step kernel leaves them (a few empty pages at -inf), every slot usable
    but a few, the selector's page count."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = pages * size
    scores = torch.randn(batch, hkv, pages, device="cuda", generator=g) * 8 + 40
    scores[..., -3:] = -math.inf
    valid = torch.rand(batch, hkv, slots, device="cuda", generator=g) > 0.01
    context = torch.full((batch,), slots - 3 * size, device="cuda")
    n_pages = min(math.ceil(math.ceil(budget * int(context[0])) / size) + 2, pages)
    return scores, valid, budget, context, n_pages, size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the table's rows")
    parser.add_argument("--pages", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sweep", action="store_true", help="also sweep the pick's tuning knobs")
    parser.add_argument("--stages", action="store_true", help="also the single program cut after each stage")
    parser.add_argument("--skip-check", action="store_true", help="skip the tie-heavy check (compiles 8 kernels)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    rows = []
    if not args.skip_check:
        check_ties()
    one = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"floor: one tiny kernel {graph_us(lambda: _one_store_kernel[(1,)](one)):.2f} us", flush=True)

    def line(name, batch, pages, fn, check=None, earlier=False):
        if check is not None:
            want = quest_pick_reference(*case)
            got = check()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        us = graph_us(fn)
        rows.append(dict(variant=name, batch=batch, pages=pages, us=round(us, 2)))
        was = [(label, figures.get((pages, batch))) for label, figures in EARLIER_PICKS_US.items()] if earlier else []
        then = "; ".join(f"{label} {t} us: {t / us:.2f}x" for label, t in was if t)
        print(f"{name:<36} B={batch:<3} P={pages:<5} {us:8.2f} us" + (f"  (was: {then})" if then else ""), flush=True)
        if args.out:  # after every line: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    for pages in args.pages:
        for batch in args.batch:
            case = inputs(batch, pages)
            line("single", batch, pages, lambda: single_pick(*case), check=lambda: single_pick(*case))
            if args.stages:
                line("torch reference", batch, pages, lambda: quest_pick_reference(*case))
                for stages in range(4):
                    line(f"single<={stages}", batch, pages, lambda s=stages: single_pick(*case, stages=s))
            fn = lambda: quest_pick_triton(*case)  # noqa: E731
            line("pick", batch, pages, fn, check=fn, earlier=True)
            scores, valid, budget, context, n_pages, size = case
            default = quest_pick_triton.__kwdefaults__
            search = lambda: pick_best(scores, n_pages, default["num_warps"], default["radix"])  # noqa: E731
            chosen = search()
            line("pick: search alone", batch, pages, search)
            layout_knobs = default["chunk"], default["block_j"]
            layout = lambda: pick_layout(chosen, valid, budget, context, size, *layout_knobs)  # noqa: E731
            line("pick: layout alone", batch, pages, layout)
            if not args.sweep:
                continue
            sweep = [dict(num_warps=w) for w in (4, 8, 16)] + [dict(radix=r) for r in (1, 2, 3, 4)]
            sweep += [dict(chunk=c) for c in (8, 16, 32, 64)] + [dict(block_j=j) for j in (32, 64, 128, 256)]
            for knobs in sweep:
                fn = lambda k=knobs: quest_pick_triton(*case, **k)  # noqa: E731
                line("pick " + " ".join(f"{k}={v}" for k, v in knobs.items()), batch, pages, fn, check=fn)


if __name__ == "__main__":
    main()
