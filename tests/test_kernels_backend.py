"""Which kernel runs and how it launches: programmatic dependent launch only where the GPU has it."""

from __future__ import annotations

import pytest
import torch

from atskv.kernels.backend import dependent_launch
from atskv.kernels.sparse_decode import sparse_decode_attention


def test_no_dependent_launch_off_the_gpu():
    assert dependent_launch(torch.zeros(1), (4,)) == {"PDL": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_of_dependent_launches_gives_what_plain_launches_give(monkeypatch):
    """Two kernels back to back (the split attention and its merge), captured in a CUDA graph with
    and without programmatic dependent launch: the same output, replay after replay."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    monkeypatch.setenv("ATSKV_PDL", "0")
    assert dependent_launch(torch.zeros(1, device="cuda"), (4,)) == {"PDL": 0}
    monkeypatch.delenv("ATSKV_PDL")
    assert dependent_launch(torch.zeros(1, device="cuda"), (4,))["PDL"] == 2
    assert dependent_launch(torch.zeros(1, device="cuda"), (100_000,))["PDL"] == 1  # no early start: many waves
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    keys = torch.randn(2, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn_like(keys)
    indices = torch.randint(0, 8192, (2, 8, 1024), device="cuda", generator=g, dtype=torch.int32)
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("ATSKV_PDL", pdl)
        out = sparse_decode_attention(query, keys, values, indices)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sparse_decode_attention(query, keys, values, indices)
        for _ in range(3):
            graph.replay()
        outs[pdl] = out.clone()
    torch.testing.assert_close(outs["1"], outs["0"], rtol=0, atol=0)


def test_no_kernel_reads_a_plain_module_global():
    """Compiled Triton refuses a module global that is not a `tl.constexpr` (Triton's interpreter,
    what CI runs, reads it): every `@jit` function of the kernels names only functions, modules and
    constexprs among its globals."""
    import importlib
    import pkgutil

    import atskv.kernels

    triton = pytest.importorskip("triton")
    offenders = []
    for info in pkgutil.iter_modules(atskv.kernels.__path__):
        module = importlib.import_module(f"atskv.kernels.{info.name}")
        for name, kernel in vars(module).items():
            fn = getattr(kernel, "fn", None)
            if not callable(fn) or not hasattr(fn, "__code__") or fn.__module__ != module.__name__:
                continue
            for used in fn.__code__.co_names:
                value = fn.__globals__.get(used)
                if isinstance(value, (bool, int, float)) and not isinstance(value, triton.language.constexpr):
                    offenders.append(f"{info.name}.{name} reads {used}")
    assert not offenders, offenders
