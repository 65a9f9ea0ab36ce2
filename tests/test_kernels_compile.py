"""Triton kernels compiled for a Hopper GPU (sm_90) on the CPU, through Triton's own compiler and
the ptxas it ships: what the interpreter, which runs the kernel tests here, cannot check (a
construct the interpreter runs as Python but the compiler refuses). The kernels whose layouts
changed last, until a GPU session runs their tests. The compiler needs the kernels built without
the interpreter (`TRITON_INTERPRET`, which the tests set), so each check runs in a process of its
own: `python tests/test_kernels_compile.py CHECK`."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

POINTERS = {
    "kept_ptr": "*i32", "val_ptr": "*fp32", "table_ptr": "*i32", "len_ptr": "*i32", "pos_ptr": "*i32",
    "low_ptr": "*fp32", "low_pos_ptr": "*i64", "low_j_ptr": "*i64", "moved_ptr": "*i32", "count_ptr": "*i32",
    "mass_ptr": "*fp32", "rec_ptr": "*fp32", "norm_ptr": "*fp32", "prev_ptr": "*fp32", "w_ptr": "*fp32",
    "bias_ptr": "*fp32", "w2_ptr": "*fp32", "pin_ptr": "*i1", "prompt_ptr": "*i32", "src_ptr": "*bf16",
    "dst_ptr": "*bf16", "key_src_ptr": "*bf16", "value_src_ptr": "*bf16", "key_dst_ptr": "*bf16",
    "value_dst_ptr": "*bf16", "row_ptr": "*i64", "page_ptr": "*i64", "block_ptr": "*i64", "need_ptr": "*i8",
    "out_ptr": "*fp32", "key_ptr": "*bf16", "att_ptr": "*fp32", "best_ptr": "*i64", "q_ptr": "*bf16",
    "rows_ptr": "*i64", "slot_of_ptr": "*i64", "page_in_ptr": "*i64", "used_ptr": "*i64", "clock_ptr": "*i64",
    "fetched_ptr": "*i64", "cache_start_ptr": "*i32", "parked_ptr": "*i8", "positions_ptr": "*i32",
    "lengths_ptr": "*i32", "listed_ptr": "*i32", "counts_ptr": "*i32", "blocks_ptr": "*i64", "missing_ptr": "*i8",
    "lo_ptr": "*bf16", "hi_ptr": "*bf16",
}  # fmt: skip
SCALARS = {"budget": "fp32", "recent_fraction": "fp32", "new_value": "fp32", "b2": "fp32", "stride_n": "i64",
           "stride_t": "i64", "stride_h": "i64", "stride_d": "i64", "newest": "fp32"}  # fmt: skip  (the rest: i32)


def compiled(kernel, **constexprs) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, SCALARS.get(n, "i32")) for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def kept_lists(moved: bool) -> None:
    from atskv.kernels import kept_lists

    common = dict(PAGE=16, FRACTION=True, INT_MAX=2**31 - 1, MOVED=moved)
    assert compiled(kept_lists._step_tile_kernel, BLOCK=1024, **common)
    assert compiled(kept_lists._step_entry_kernel, BLOCK_T=8, **common)
    assert compiled(kept_lists._add_kernel, PAGE=16, BLOCK=1024, MOVED=moved, INT_MAX=2**31 - 1)


def refresh_and_page_copy() -> None:
    from atskv.kernels import listed_refresh, page_copy

    assert compiled(listed_refresh._refresh_kernel, PAGE=16, FRACTION=True, PREVIOUS=True, FEATURES=8, BLOCK_J=64,
                    BLOCK_H=16)  # fmt: skip
    assert compiled(page_copy._paged_page_copy_kernel, BLOCK_T=16, BLOCK_D=128)


def prompt_scores() -> None:
    from atskv.kernels import prompt_scores

    for with_inputs in (True, False):
        assert compiled(prompt_scores._prompt_scores_kernel, ATTENTION=with_inputs, PREVIOUS=with_inputs, D=256,
                        BLOCK_D=256, BLOCK_J=32, BLOCK_H=32)  # fmt: skip


def parked_read() -> None:
    from atskv.kernels import page_cache

    assert compiled(page_cache._parked_read_kernel, SIZE=16, BLOCK_R=16, BLOCK_C=32, BLOCK_K=1024)


def page_scores() -> None:
    from atskv.kernels import paged

    for regions in (True, False):  # the host tier's (a region a row) and Quest's (a block table)
        assert compiled(paged._paged_scores_kernel, GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_P=64, REGIONS=regions,
                        DOT_PRECISION=None, UPCAST_DOT=False, PDL=0)  # fmt: skip


CHECKS = {"kept_lists_moved": lambda: kept_lists(True), "kept_lists": lambda: kept_lists(False),
          "refresh_and_page_copy": refresh_and_page_copy, "prompt_scores": prompt_scores,
          "parked_read": parked_read, "page_scores": page_scores}  # fmt: skip


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_kernels_compile_for_the_gpu(check):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, __file__, check], env={**env, "PYTHONPATH": str(root)}, cwd=root,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
