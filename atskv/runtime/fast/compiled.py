"""`generate(compile=True)`: the decoder layers under `torch.compile`, atskv's attention left eager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from atskv.models.geometry import decoder_layers


@contextlib.contextmanager
def compiled_layers(model, enabled: bool = True) -> Iterator[None]:
    """Inside the block, each decoder layer runs `torch.compile`d, with atskv's cache write and
    attention left out of the compiled graphs (they are `torch.compiler.disable`d: the selectors
    keep Python state). What is compiled is the model's own per-layer work, which eager runs as
    ~35 small kernels per layer (norms, rotary, residuals, the MLP's activation) between the
    projections. No CUDA graphs of its own: `GraphedStep` captures the compiled step. Every
    layer is its own compiled entry (its index is a constant), so the recompile limit is raised
    to the layer count for the block."""
    if not enabled:
        yield
        return
    layers = decoder_layers(model)
    own = [layer.__dict__.get("forward") for layer in layers]
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers))
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, 8 * limit)):
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)
        try:
            yield
        finally:
            for layer, forward in zip(layers, own):
                del layer.forward
                if forward is not None:
                    layer.forward = forward
