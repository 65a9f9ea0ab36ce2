"""Which implementation of a kernel runs: the Triton kernel on CUDA tensors when Triton imports,
the plain-torch reference everywhere else. `ATSKV_KERNELS=reference` forces the reference (to
compare, or to rule a kernel out when debugging); `ATSKV_KERNELS=triton` forces Triton, which on
CPU tensors needs Triton's interpreter (`TRITON_INTERPRET=1`, how the tests run kernels in CI).

Kernel modules import `triton`, `tl` and `jit` from here, so `import atskv` works without Triton."""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without the `test` extra: use_triton() never picks a kernel
    triton = tl = None


# per-slot rows (`[..., S]` tensors) whose stride is a whole number of these slots start aligned,
# so Triton vectorises their loads (at an odd slot count SparQ's logits ran over twice as long)
SLOT_ALIGN = 64


def aligned_slots(slots: int) -> int:
    """`slots` rounded up to a whole number of `SLOT_ALIGN`."""
    return -(-slots // SLOT_ALIGN) * SLOT_ALIGN


def jit(fn=None, **options):
    """`triton.jit` where Triton imports (`options` its own, e.g. `do_not_specialize`); otherwise
    the plain function (never launched)."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def use_triton(tensor: torch.Tensor) -> bool:
    choice = os.environ.get("ATSKV_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"ATSKV_KERNELS must be auto, reference or triton, got {choice!r}")
    if choice == "reference" or triton is None:
        return False
    return choice == "triton" or tensor.is_cuda


try:  # Hopper's grid dependency control (Triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels launch as usual
    gdc_launch_dependents = gdc_wait = None


@jit
def wait_for_inputs(PDL: tl.constexpr):
    """First statement of every decode-step kernel. Under programmatic dependent launch (`PDL` > 0)
    a kernel is launched while the one before it still runs, so its launch and scheduling overlap
    that kernel's tail (otherwise, even in a CUDA graph, a gap between two small kernels
    comparable to their own time); it waits here until the previous kernel has finished and its
    writes are visible. `PDL` == 2 then lets the next kernel launch at once: only for a grid that
    fits on the GPU at once, since the next kernel's waiting programs would otherwise take the
    places of this one's later ones (SnapKV's step at B=16 was slower so). Nothing before this line
    may read or write memory."""
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()


def dependent_launch(tensor: torch.Tensor, grid: tuple[int, ...]) -> dict:
    """Launch options of a decode-step kernel on `grid`: programmatic dependent launch
    where the GPU has it (sm_90+, a Triton with grid dependency control; `ATSKV_PDL=0` turns it
    off), with an early start of the next kernel when the grid fits in one program per SM."""
    on = tensor.is_cuda and gdc_wait is not None and os.environ.get("ATSKV_PDL", "1") != "0"
    if not (on and _capability(tensor.device) >= 9):
        return {"PDL": 0}
    return {"PDL": 2 if math.prod(grid) <= sm_count(tensor.device) else 1, "launch_pdl": True}


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
