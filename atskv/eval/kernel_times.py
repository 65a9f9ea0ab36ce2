"""The CUDA kernels a callable launches and their time, from PyTorch's profiler: the step
profiles' `--kernels` (`benchmarks/vllm_step_profile.py`, `benchmarks/vllm_prompt_profile.py`).
torch only, so the GPU image's older transformers can run it."""

from __future__ import annotations

import torch


def print_kernel_times(fn, calls: int = 10, top: int = 8, indent: int = 16) -> None:
    """The `top` CUDA kernels of `calls` eager runs of `fn` by total time: each one's mean time a
    call (µs) and launches a call, printed."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{'':>{indent}}   {e.key[:60]:<60} {e.self_device_time_total / calls:10.1f}  ({e.count // calls}/call)")
