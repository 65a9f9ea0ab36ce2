"""Which implementation of a kernel runs: the Triton kernel on CUDA tensors when Triton imports,
the plain-torch reference everywhere else. `ATSKV_KERNELS=reference` forces the reference (to
compare, or to rule a kernel out when debugging); `ATSKV_KERNELS=triton` forces Triton, which on
CPU tensors needs Triton's interpreter (`TRITON_INTERPRET=1`, how the tests run kernels in CI).

Kernel modules import `triton`, `tl` and `jit` from here, so `import atskv` works without Triton."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without the `test` extra: use_triton() never picks a kernel
    triton = tl = None


# per-slot rows (`[..., S]` tensors) whose stride is a whole number of these slots start aligned,
# so Triton vectorises their loads: at an odd slot count SparQ's logits took 18.8 us, not 7.6
SLOT_ALIGN = 64


def aligned_slots(slots: int) -> int:
    """`slots` rounded up to a whole number of `SLOT_ALIGN`."""
    return -(-slots // SLOT_ALIGN) * SLOT_ALIGN


def jit(fn):
    """`triton.jit` where Triton imports; otherwise the plain function (never launched)."""
    return triton.jit(fn) if triton is not None else fn


def use_triton(tensor: torch.Tensor) -> bool:
    choice = os.environ.get("ATSKV_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"ATSKV_KERNELS must be auto, reference or triton, got {choice!r}")
    if choice == "reference" or triton is None:
        return False
    return choice == "triton" or tensor.is_cuda
