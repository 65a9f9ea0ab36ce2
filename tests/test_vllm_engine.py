"""The plugin inside a real vLLM engine (GPU and vLLM needed; skipped elsewhere): at budget 1.0 its
greedy tokens are vanilla vLLM's; with Quest at a small budget, requests aborted mid-decode give
their blocks back (the pool returns to its size) and the rest finish. A small Llama shape with
dummy weights; each engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]  # fmt: skip

from atskv.eval.vllm_speed import (  # noqa: E402
    EngineSpec,
    engine_arguments,
    greedy,
    greedy_tokens,
    prompts,
    write_shape,
)


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return write_shape("smollm2-135m-shape", tmp_path_factory.mktemp("shape") / "smollm2")


def engine(shape, method: str, budget):
    arguments = engine_arguments(EngineSpec(method, str(shape), [], budget=budget, gpu_memory_utilization=0.3), 4096, 8)
    return vllm.LLM(**arguments)


def free_blocks(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_budget_one_gives_vanilla_vllms_tokens(shape):
    batch = prompts(1500, 4, 49152, seed=3)
    vanilla = engine(shape, "vllm", 1.0)
    want = greedy_tokens(vanilla, batch, 24)
    del vanilla
    torch.cuda.empty_cache()
    plugin = engine(shape, "vllm:quest", 1.0)
    assert greedy_tokens(plugin, batch, 24) == want


def test_aborted_requests_give_their_blocks_back(shape):
    llm = engine(shape, "vllm:quest", 64)
    idle = free_blocks(llm)
    params = greedy(40)
    for i, prompt in enumerate(prompts(900, 6, 49152, seed=5)):
        llm.llm_engine.add_request(f"r{i}", prompt, params)
    for _ in range(8):
        llm.llm_engine.step()
    assert free_blocks(llm) < idle
    llm.llm_engine.abort_request(["r1", "r4"])
    finished = {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {f"r{i}": 40 for i in (0, 2, 3, 5)}
    assert free_blocks(llm) == idle
