"""One job on N processes: `spawn(fn, devices, accelerator, *args)` runs `fn(device, *args)` in
`devices` processes joined in one torch.distributed group (gloo on the CPU, NCCL on GPUs, process
r on cuda:r), or in this process when `devices` is 1. This is how `atskv collect --devices N`
splits its windows; `atskv fit` and `atskv finetune` get the same from Lightning's DDP.

CPU processes share the cores (each gets cores / N threads, so N processes do not oversubscribe
them). NCCL's NVLink multicast is left at NCCL's default (off unless the environment turns it on).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atskv.errors import InputError


def resolve_accelerator(accelerator: str) -> str:
    """`auto`: cuda when a GPU is present, else cpu."""
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda"):
        raise InputError(f"accelerator must be cpu, cuda or auto, got {accelerator!r}")
    return accelerator


def spawn(fn: Callable, devices: int, accelerator: str = "auto", *args):
    """`fn(device, *args)` on `devices` processes (device "cpu" or "cuda:<rank>"; "cuda" when
    `devices` is 1, run here); returns what rank 0's call returned. `fn` and `args` must pickle
    (a module-level function). An exception in one process ends the others."""
    accelerator = resolve_accelerator(accelerator)
    if devices < 1:
        raise InputError(f"devices must be >= 1, got {devices}")
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise InputError(f"devices {devices} > the {torch.cuda.device_count()} GPUs here")
    if devices == 1:
        return fn(accelerator, *args)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_process, args=(fn, devices, accelerator, _free_port(), results, args), nprocs=devices)
    return results.get()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(rank: int, fn: Callable, world: int, accelerator: str, port: int, results, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if accelerator == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(str(device), *args)
        if rank == 0:
            results.put(result)
    finally:
        dist.destroy_process_group()
