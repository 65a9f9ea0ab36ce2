"""Which implementation of a kernel runs: the Triton kernel on CUDA tensors when Triton imports,
the plain-torch reference everywhere else. `ATSKV_KERNELS=reference` forces the reference (to
compare, or to rule a kernel out when debugging); `ATSKV_KERNELS=triton` forces Triton, which on
CPU tensors needs Triton's interpreter (`TRITON_INTERPRET=1`, how the tests run kernels in CI)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    choice = os.environ.get("ATSKV_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"ATSKV_KERNELS must be auto, reference or triton, got {choice!r}")
    if choice == "reference" or not triton_importable():
        return False
    return choice == "triton" or tensor.is_cuda
