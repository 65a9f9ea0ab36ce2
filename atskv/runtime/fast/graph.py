"""Graph capture of the fast path's decode step: a step with fixed shapes that reads nothing back
to the host is captured once per variant in a CUDA graph and replayed for every token."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphedStep:
    """`step()` per variant (`__call__(variant)`): run eagerly the first time (a real decode step
    that also warms up kernels and allocators), captured in a CUDA graph the second time, replayed
    from then on; the variants' graphs share one memory pool. Off CUDA, or with `enabled=False`,
    every call runs eagerly."""

    def __init__(self, step: Callable[[], torch.Tensor], device: torch.device, enabled: bool = True):
        self.step, self.device = step, device
        self.enabled = enabled and device.type == "cuda"
        self.calls: dict[object, int] = {}
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, variant: object = None) -> torch.Tensor:
        self.calls[variant] = self.calls.get(variant, 0) + 1
        if not self.enabled:
            return self.step()
        if variant in self.graphs:
            graph, output = self.graphs[variant]
            graph.replay()
            return output
        if self.calls[variant] == 1:  # warm-up: a side stream, as CUDA graph capture wants
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                out = self.step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.step()
        self.pool = graph.pool()
        self.graphs[variant] = (graph, output)
        graph.replay()
        return output
