"""Decode attention on one GPU: our Triton sparse kernel against FlashInfer's decode kernels and dense
SDPA, Llama-3-8B attention (32 query heads, 8 KV heads, head dim 128, bf16), one query per row.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fisite .whl/flashinfer/*/*.whl
    PYTHONPATH=/tmp/fisite python3 benchmarks/flashinfer_decode.py --out $OUT \
        --batch 1 16 --context 32768 131072 --budget 0.05 --page_size 16

(.whl/flashinfer: flashinfer-python 0.7.2.post1, repacked with LZMA to travel, and apache-tvm-ffi, its one
import-time need the GPU image lacks. Our kernel loads from atskv/kernels/ with or without an install of atskv.)

Methods, for each (batch B, context S); the cache is ours, K/V [B, Hkv, S, D], read in place by all:
  sdpa_dense       torch SDPA (flash backend, enable_gqa) over the whole cache
  fi_dense         FlashInfer BatchDecodeWithPagedKVCacheWrapper (fa2) over the whole cache: the cache
                   seen through strides as HND pages of page_size tokens (page stride ps*D, head stride S*D)
  fi_single        B = 1 only: flashinfer.single_decode_with_kv_cache on K[0], V[0] (HND)
  ours_sparse      atskv sparse_decode_attention over round(budget * S / page_size) random pages per
                   (row, KV head), expanded to slot indices (lengths = the budget)
  fi_sparse        FlashInfer paged decode over the same pages given as its page table, last page full
                   (Quest's use of FlashInfer); the per-KV-head choices are served by folding the KV
                   heads into the batch: B*Hkv requests of 1 KV head and Hq/Hkv query heads each
  *_tc             with --tensor_cores: the same through FlashInfer's tensor-core decode path
max_err: largest |difference| to the method it must match (fi_dense, fi_single to sdpa_dense; fi_sparse to
ours_sparse). Timing: a CUDA graph of --inner calls replayed --reps times, CUDA events. us_hot: calls back
to back (at B = 1 the sparse rows' pages stay in the 60 MB L2). us_cold: a 256 MiB memset before each call,
its own time subtracted (a decode step's layers each read another cache). A method whose calls cannot be
captured is timed eagerly; column `mode` says which. first_s: first call, with FlashInfer's JIT build.

Environment (FlashInfer JIT-builds each kernel with nvcc and ninja on first use, a minute or two each):
  CUDA_HOME=/usr/local/cuda          the toolkit, when nvcc is not on PATH (FlashInfer also reads CUDA_PATH)
  FLASHINFER_WORKSPACE_BASE=DIR      JIT cache root DIR/.cache/flashinfer (default set here: build/flashinfer,
                                     git-ignored, so a warm machine's second run skips the build)
  FLASHINFER_CUDA_ARCH_LIST="9.0a"   targets (default: the visible GPUs'); MAX_JOBS=N ninja's parallel jobs
  FLASHINFER_JIT_VERBOSE=1           print the nvcc commands; FLASHINFER_LOGGING_LEVEL=debug for more
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import types
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
FLUSH_BYTES = 256 << 20  # 4x the H200's L2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for table.md and results.json")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072], help="cache slots S")
    p.add_argument("--budget", type=float, default=0.05, help="fraction of each row's pages the sparse rows read")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--inner", type=int, default=20, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=10, help="timed replays of each graph")
    p.add_argument("--tensor_cores", action="store_true", help="also FlashInfer's tensor-core path (more JIT)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: time eager calls")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_flashinfer():
    """(flashinfer, None), or (None, one line saying why not)."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(REPO / "build" / "flashinfer"))
    bindir = os.path.dirname(sys.executable)  # a pip-installed ninja sits beside python
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means: run without it
        return None, f"{type(e).__name__}: {e}".splitlines()[0]
    return flashinfer, None


def load_sparse_kernel():
    try:
        from atskv.kernels.sparse_decode import sparse_decode_attention
    except ImportError:  # atskv not installed: bare packages over the repo's folders, without atskv/__init__'s
        for name, folder in (("atskv", "atskv"), ("atskv.kernels", "kernels")):  # imports (the kernel needs
            sys.modules[name] = types.ModuleType(name)  # only torch, triton, atskv.attention)
            sys.modules[name].__path__ = [str(REPO / folder)]
        from atskv.kernels.sparse_decode import sparse_decode_attention
    return sparse_decode_attention


def dense_pages(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, Hkv, S, D] seen in place as HND pages [N, Hkv, page_size, D]: page b*Hkv*(S/ps) + j of head h
    is cache[b, h, j*ps:(j+1)*ps] (N stops where the last head's last page ends)."""
    b, hkv, s, d = cache.shape
    assert cache.is_contiguous() and s % page_size == 0
    n = (b * hkv - hkv + 1) * (s // page_size)
    return cache.as_strided((n, hkv, page_size, d), (page_size * d, s * d, d, 1))


def page_table(pages: torch.Tensor, stride: int, page_size: int):
    """FlashInfer's CSR page table for requests r with page ids r*stride + pages[r] ([R, n]), all full."""
    r, n = pages.shape
    dev = pages.device
    indices = (torch.arange(r, device=dev)[:, None] * stride + pages).flatten().int()
    indptr = (torch.arange(r + 1, device=dev) * n).int()
    return indptr, indices, torch.full((r,), page_size, dtype=torch.int32, device=dev)


def fi_paged(fi, q, k_pages, v_pages, table, num_kv_heads, page_size, tensor_cores):
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=tensor_cores, backend="fa2")
    wrapper.plan(*table, q.shape[1], num_kv_heads, q.shape[2], page_size,
                 q_data_type=q.dtype, kv_data_type=k_pages.dtype)
    return lambda: wrapper.run(q, (k_pages, v_pages))


def bench(fn, ref: torch.Tensor, inner: int, reps: int, graph: bool, flush_buf: torch.Tensor):
    """(us_hot, us_cold, mode): microseconds per call of fn, back to back and after an L2 flush each.
    A captured graph's output is zeroed and replayed once, and must come back equal to `ref` (fn's eager
    output): a kernel launched outside the capture would leave it zero."""
    def body(call: bool, flush: bool):
        out = None
        for _ in range(inner):
            if flush:
                flush_buf.zero_()
            if call:
                out = fn()
        return out

    variants = {"hot": (True, False), "cold": (True, True), "flush": (False, True)}
    runners, mode = {}, "graph" if graph else "eager"
    if graph:
        try:
            for name, flags in variants.items():
                runners[name] = g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = body(*flags)
                if name == "hot":
                    out.zero_()
                    g.replay()
                    if not torch.allclose(out.float(), ref, rtol=0, atol=1e-3):
                        mode = "graph (REPLAY DIFFERS from eager)"
            runners = {name: g.replay for name, g in runners.items()}
        except Exception as e:  # noqa: BLE001 - whatever breaks the capture, time eagerly
            torch.cuda.synchronize()
            why = f"{type(e).__name__}: {e}".splitlines()[0][:100].replace("|", "/")
            runners, mode = {}, f"eager (capture failed: {why})"
    if not runners:
        runners = {name: (lambda flags=flags: body(*flags)) for name, flags in variants.items()}
    us = {}
    for name, run in runners.items():
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        us[name] = start.elapsed_time(end) * 1e3 / (reps * inner)
    return us["hot"], us["cold"] - us["flush"], mode


def run_config(b, s, args, fi, sparse_attn, flush_buf) -> list[dict]:
    ps, g, dev = args.page_size, HQ // HKV, flush_buf.device
    pages = s // ps
    q = torch.randn(b, HQ, HEAD_DIM, dtype=DTYPE, device=dev)
    k, v = (torch.randn(b, HKV, s, HEAD_DIM, dtype=DTYPE, device=dev) for _ in range(2))
    n_sel = max(1, round(args.budget * pages))
    chosen = torch.rand(b, HKV, pages, device=dev).argsort(-1)[..., :n_sel].sort(-1).values  # [B, Hkv, n]
    slots = (chosen[..., None] * ps + torch.arange(ps, device=dev)).flatten(2).int()  # [B, Hkv, n*ps]
    lengths = torch.full((b, HKV), n_sel * ps, dtype=torch.int32, device=dev)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

    dense_table = page_table(torch.arange(pages, device=dev).expand(b, pages), HKV * pages, ps) if fi else None
    sparse_table = page_table(chosen.reshape(b * HKV, n_sel), pages, ps) if fi else None

    def fi_dense(tc):
        return fi_paged(fi, q, dense_pages(k, ps), dense_pages(v, ps), dense_table, HKV, ps, tc)

    def fi_single(tc):
        return lambda: fi.single_decode_with_kv_cache(q[0], k[0], v[0], kv_layout="HND", use_tensor_cores=tc)[None]

    def fi_sparse(tc):  # request r = b*Hkv + h owns pages r*(S/ps) + j: k.view is the cache itself
        run = fi_paged(fi, q.view(b * HKV, g, HEAD_DIM), k.view(-1, 1, ps, HEAD_DIM), v.view(-1, 1, ps, HEAD_DIM),
                       sparse_table, 1, ps, tc)
        return lambda: run().view(b, HQ, HEAD_DIM)

    methods = [("sdpa_dense", lambda: sdpa, s, None),
               ("ours_sparse", lambda: lambda: sparse_attn(q, k, v, slots, lengths), n_sel * ps, None)]
    for tc in ([False, True] if args.tensor_cores else [False]) if fi else []:
        sfx = "_tc" if tc else ""
        methods.append((f"fi_dense{sfx}", partial(fi_dense, tc), s, "sdpa_dense"))
        if b == 1:
            methods.append((f"fi_single{sfx}", partial(fi_single, tc), s, "sdpa_dense"))
        methods.append((f"fi_sparse{sfx}", partial(fi_sparse, tc), n_sel * ps, "ours_sparse"))

    rows, outs = [], {}
    for name, build, tokens, ref in methods:
        row = {"batch": b, "context": s, "method": name, "tokens_per_head": tokens}
        try:
            start = time.perf_counter()
            fn = build()
            outs[name] = fn().float()
            torch.cuda.synchronize()
            row["first_s"] = round(time.perf_counter() - start, 2)
            if ref in outs:
                row["max_err"] = (outs[name] - outs[ref]).abs().max().item()
            row["us_hot"], row["us_cold"], row["mode"] = bench(
                fn, outs[name], args.inner, args.reps, not args.eager, flush_buf)
            row["gbps_cold"] = 2 * b * HKV * tokens * HEAD_DIM * k.element_size() / row["us_cold"] / 1e3
        except Exception as e:  # noqa: BLE001 - one broken method must not cost the others
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    ours = next((r.get("us_cold") for r in rows if r["method"] == "ours_sparse"), None)
    for row in rows:
        if "us_cold" in row and ours:
            row["vs_ours"] = row["us_cold"] / ours
    return rows


def table(rows, meta) -> str:
    lines = [f"# Decode attention: {meta['gpu']}, Hq {HQ} / Hkv {HKV} / D {HEAD_DIM}, bf16, budget "
             f"{meta['args']['budget']:.0%}, page {meta['args']['page_size']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, flashinfer {meta['flashinfer']}", "",
             "| B | S | method | tokens/head | mode | us hot | us cold | GB/s cold | cold / ours | max err | first s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['tokens_per_head']} | error: "
                         f"{r['error'].replace('|', '/')} | | | | | | |")
            continue
        err = f"{r['max_err']:.1e}" if "max_err" in r else ""
        vs_ours = f"{r['vs_ours']:.2f}" if "vs_ours" in r else ""
        lines.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['tokens_per_head']} | {r['mode']} "
                     f"| {r['us_hot']:.1f} | {r['us_cold']:.1f} | {r['gbps_cold']:.0f} | {vs_ours} "
                     f"| {err} | {r['first_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark runs on a GPU only")
    fi, why = load_flashinfer()
    if fi is None:
        print(f"flashinfer unavailable ({why}): timing sdpa_dense and ours_sparse only", flush=True)
    sparse_attn = load_sparse_kernel()
    torch.manual_seed(args.seed)
    flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "flashinfer": fi.__version__ if fi else f"unavailable ({why})", "args": vars(args) | {"out": str(args.out)},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("FLASHINFER", "CUDA_HOME", "MAX_JOBS"))}}
    rows = []
    for b in args.batch:
        for s in args.context:
            rows += run_config(b, s, args, fi, sparse_attn, flush_buf)
            torch.cuda.empty_cache()
            text = table(rows, meta)
            if args.out:  # after each shape, so that a run cut short keeps what it measured
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "table.md").write_text(text)
                (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(text)

if __name__ == "__main__":
    main()
