"""vLLM's own scheduler replayed on the CPU, without a model or a GPU: the rows each step gives
the requests, so where chunked prefill cuts a prompt. That decides where a selector that ranks a
prompt sees its end (`atskv.runtime.vllm.batch.PROMPT_TAIL`): a batch of 4,096-token prompts at
16,384 tokens a step (an H100's default) cuts a prompt a step a few tokens short of its end, by
as many tokens as the requests already decoding take. vLLM is imported here, not at the top."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from atskv.eval.shapes import SHAPES
from atskv.runtime.vllm.batch import prompt_end


@dataclass(frozen=True)
class Row:
    """A request's share of a step: `request` (its index), `first` (its tokens computed before),
    `tokens` (scheduled now), `prompt` (its prompt's length)."""

    request: int
    first: int
    tokens: int
    prompt: int


def replay_steps(prompt_lengths: list[int], new_tokens: int, max_num_batched_tokens: int,
                 max_num_seqs: int | None = None, blocks: int = 1 << 20) -> list[list[Row]]:  # fmt: skip
    """Each step's rows, in the order vLLM's scheduler lists them, for requests of `prompt_lengths`
    added at once, each generating `new_tokens` (no end of sequence), with chunked prefill, prefix
    caching off and a pool of `blocks` 16-token blocks (a pool too small for them all preempts
    requests, which vLLM then recomputes, their outputs with their prompt); `max_num_seqs`
    defaults to vLLM's offline `LLM`'s on an H100 (1,024)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = 16
    max_len = max(prompt_lengths) + new_tokens + 1
    with tempfile.TemporaryDirectory() as shape:  # any decoder's config: the scheduler reads its lengths only
        config = {**SHAPES["smollm2-135m-shape"], "architectures": ["LlamaForCausalLM"],
                  "max_position_embeddings": max_len}  # fmt: skip
        (Path(shape) / "config.json").write_text(json.dumps(config))
        model = ModelConfig(model=shape, skip_tokenizer_init=True, max_model_len=max_len, dtype="bfloat16")
        scheduling = SchedulerConfig(
            max_num_seqs=max_num_seqs or 1024, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        )  # fmt: skip
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        cache.num_gpu_blocks = blocks
        vllm_config = VllmConfig(model_config=model, scheduler_config=scheduling, cache_config=cache,
                                 device_config=DeviceConfig("cpu"))  # fmt: skip
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=model.dtype)
    kv_cache = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache, block_size=block_size,
                          structured_output_manager=StructuredOutputManager(vllm_config))  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, n in enumerate(prompt_lengths):
        scheduler.add_request(Request(str(i), list(range(1, n + 1)), params, None))
    steps = []
    while scheduler.has_requests():
        out = scheduler.schedule()
        requests = [scheduler.requests[r] for r in out.num_scheduled_tokens]
        scheduled = list(out.num_scheduled_tokens.values())
        # schedule() has moved each request's computed tokens on by what it scheduled
        steps.append([Row(int(r.request_id), r.num_computed_tokens - n, n, r.num_prompt_tokens)
                      for r, n in zip(requests, scheduled)])  # fmt: skip
        ids = [r.request_id for r in requests]
        sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in requests]  # past the prompt
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled)  # fmt: skip
        scheduler.update_from_output(out, output)
    return steps


def prompt_chunks(steps: list[list[Row]]) -> dict[int, list[tuple[int, int]]]:
    """Each request's prompt chunks, (first, end) positions, in order."""
    chunks: dict[int, list[tuple[int, int]]] = {}
    for step in steps:
        for row in step:
            if row.first < row.prompt:
                chunks.setdefault(row.request, []).append((row.first, min(row.first + row.tokens, row.prompt)))
    return chunks


def ranked_short(chunks: dict[int, list[tuple[int, int]]], prompts: list[int], tail: int) -> dict[int, int]:
    """Requests whose prompt the plugin's rule with `tail` for `PROMPT_TAIL` (`prompt_end`) ranks
    before its end, and by how many tokens short."""
    short = {}
    for request, spans in chunks.items():
        end = next(end for _, end in spans if end >= prompt_end(prompts[request], tail))
        if end < prompts[request]:
            short[request] = prompts[request] - end
    return short
