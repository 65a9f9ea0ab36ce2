"""The plugin inside a real vLLM engine (GPU and vLLM needed; skipped elsewhere): at budget 1.0 its
greedy tokens are vanilla vLLM's; with Quest at a small budget, requests aborted mid-decode give
their blocks back (the pool returns to its size) and the rest finish; StreamingLLM with
`free_blocks` beside dense layers gives the tokens and log-probabilities it gives without, while
its requests hold only the blocks it reads (and the dense layers' blocks); SnapKV, H2O and the
learned selector, which score prompts chunk by chunk, and SparQ read everything at a budget
above the context, and H2O's prompt mass is the same from FlashAttention's log-sum-exps as from
its own pass; requests preempted by a small pool are recomputed and finish. A small Llama
shape with dummy weights; each engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

from __future__ import annotations

import gc
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


def engine(shape, method: str, budget, max_num_batched_tokens: int | None = None, blocks: int | None = None,
           worker_cls: str | None = None, **settings):  # fmt: skip
    """A small engine; `blocks`: its KV pool's size in blocks (vLLM's `num_gpu_blocks_override`);
    `worker_cls`: another worker than the plugin's ("auto": vLLM's own)."""
    spec = EngineSpec(method, str(shape), [], budget=budget, gpu_memory_utilization=0.06, **settings)
    arguments = engine_arguments(spec, 4096, 8)
    arguments |= {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    arguments |= {} if blocks is None else {"num_gpu_blocks_override": blocks}
    arguments |= {} if worker_cls is None else {"worker_cls": worker_cls}
    return vllm.LLM(**arguments)


def tokens_and_logprobs(llm, batch, new_tokens: int):
    params = vllm.SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    tokens = [list(o.token_ids) for o in outputs]
    logprobs = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    return tokens, torch.tensor(logprobs)


def free_blocks(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_budget_one_gives_vanilla_vllms_tokens(shape):
    batch = prompts(1500, 4, 49152, seed=3)
    vanilla = engine(shape, "vllm", 1.0)
    want = greedy_tokens(vanilla, batch, 24)
    del vanilla
    gc.collect()
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


def held_while_decoding(llm, batch, new_tokens: int) -> int:
    """Blocks the requests hold once each has decoded 10 tokens; after them the pool is whole again."""
    idle = free_blocks(llm)
    for i, prompt in enumerate(batch):
        llm.llm_engine.add_request(f"r{i}", prompt, greedy(new_tokens))
    produced = {}
    while len(produced) < len(batch) or min(produced.values()) < 10:
        for out in llm.llm_engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    held = idle - free_blocks(llm)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert free_blocks(llm) == idle
    return held


def test_freed_blocks_beside_dense_layers_change_no_token_and_no_logprob(shape):
    batch = prompts(1500, 3, 49152, seed=11)
    kept = engine(shape, "vllm:streaming_llm", 64, dense_layers=2)
    want_tokens, want_logprobs = tokens_and_logprobs(kept, batch, 24)
    del kept
    gc.collect()
    torch.cuda.empty_cache()
    freeing = engine(shape, "vllm:streaming_llm", 64, free_blocks=True, dense_layers=2)
    tokens, logprobs = tokens_and_logprobs(freeing, batch, 24)
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-3)
    # 30 layers: the 2 dense ones a group (each request's 94 prompt blocks), 14 freeing groups of 2
    # holding the sink block and the recent window's (+ margin, + the block being written)
    held = held_while_decoding(freeing, batch, 30)
    assert 3 * 94 < held <= 3 * (94 + 14 * 8), held


@pytest.mark.parametrize("selector", ["h2o", "learned", "snapkv", "h2o+sparq"])
def test_compacted_lists_free_blocks_and_read_the_same_tokens(shape, selector, tmp_path):
    """H2O, the learned selector, SnapKV and a composition (its residents) with `free_blocks`:
    each layer's kept (best-ranked) tokens move into the request's first slots where its prompt
    ends and the blocks between them and the recent (observation) window go back to the pool. The
    greedy tokens are those without freeing, up to near-ties (the kernel sums the same tokens in
    another order), and 3 requests hold their dense group's blocks and, in each freeing group, at
    most the blocks the rule leaves them (at 64 tokens ~10-22 of 96) while they decode."""
    from atskv.eval.vllm_speed import random_engine_predictor
    from atskv.runtime.vllm.composition import freeing_rule

    options = {}
    if selector == "learned":
        options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor"))}
    batch = prompts(1500, 3, 49152, seed=11)
    kept = engine(shape, f"vllm:{selector}", 64, dense_layers=2, options=options)
    want = greedy_with_runner_up(kept, batch, 24)
    del kept
    gc.collect()
    torch.cuda.empty_cache()
    freeing = engine(shape, f"vllm:{selector}", 64, free_blocks=True, dense_layers=2, options=options)
    assert_same_up_to_near_ties(greedy_with_runner_up(freeing, batch, 24), want)
    held = held_while_decoding(freeing, batch, 30)
    kept_blocks = 96 - len(freeing_rule(selector, options)(1510, 1500, 64, 16))  # 10 decoded, 1 being written
    assert 3 * 94 < held <= 3 * (94 + 14 * kept_blocks), held


@pytest.mark.parametrize("selector, size", [("h2o", "regions"), ("snapkv", "regions"), ("h2o", "gib")])
def test_a_host_tier_reads_back_pages_of_what_compaction_frees(shape, selector, size):
    """With `free_blocks` and a host tier of 2 regions (given, or bought by `gib` over the 28
    sparse layers), 3 requests (one finds no region): each finishes its tokens, holds at most its
    dense group's blocks and, per freeing group, what the rule leaves it plus its cache blocks
    while decoding, the layers read pages back from the host, and the pool is whole again after them."""
    from atskv.runtime.vllm.composition import freeing_rule
    from atskv.runtime.vllm.host_tier import host_tier_bytes, region_nbytes

    one = 28 * region_nbytes(4096, 3, 64, 16, torch.bfloat16)  # max_model_len 4096, 3 KV heads of 64
    tier = {"pages": 4, "cache_pages": 8} | ({"regions": 2} if size == "regions" else {"gib": 2.5 * one / 2**30})
    llm = engine(shape, f"vllm:{selector}", 64, free_blocks=True, dense_layers=2, host_tier=tier)
    batch = prompts(1500, 3, 49152, seed=11)
    idle = free_blocks(llm)
    assert [len(t) for t in greedy_tokens(llm, batch, 24)] == [24] * 3 and free_blocks(llm) == idle
    counts = llm.apply_model(lambda model: [m.impl.parked.regions for m in model.modules()
                                            if getattr(getattr(m, "impl", None), "parked", None) is not None])[0]
    assert counts == [2] * 28, counts
    assert sum(llm.apply_model(host_tier_bytes)) > 0, "pages came back from the host"
    held = held_while_decoding(llm, batch, 30)
    kept_blocks = 96 - len(freeing_rule(selector, {})(1510, 1500, 64, 16)) + tier["cache_pages"]
    assert 3 * 94 < held <= 3 * (94 + 14 * kept_blocks), held


def test_freed_blocks_go_back_to_the_pool_while_requests_decode(shape):
    llm = engine(shape, "vllm:streaming_llm", 64, free_blocks=True, dense_layers=0)
    # each request holds its sink block and the blocks of its 60 recent tokens (+ the margin and
    # the block being written), not the 94 blocks of its 1500-token prompt
    held = held_while_decoding(llm, prompts(1500, 4, 49152, seed=5), 30)
    assert 0 < held <= 4 * 8, held


def greedy_with_runner_up(llm, batch, new_tokens: int) -> list[list[tuple[int, float, float]]]:
    """Each request's greedy steps: (token, its log-probability, the runner-up's)."""
    params = vllm.SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False, logprobs=2)
    steps = []
    for out in llm.generate(batch, params, use_tqdm=False):
        o = out.outputs[0]
        steps.append([(t, step[t].logprob, min(p.logprob for p in step.values())) for t, step in
                      zip(o.token_ids, o.logprobs)])  # fmt: skip
    return steps


def assert_same_up_to_near_ties(got, want, tie: float = 0.02):
    """Greedy runs that read the same tokens in another order (float sums in another order): equal
    log-probabilities while the tokens agree; where they part, the reference's best two were within
    `tie` (a near-tie that rounding may flip: dummy weights give flat logits)."""
    for request, (mine, theirs) in enumerate(zip(got, want)):
        for i, ((token, logprob, _), (want_token, want_logprob, runner_up)) in enumerate(zip(mine, theirs)):
            if token != want_token:
                assert want_logprob - runner_up < tie, (request, i, want_logprob, runner_up)
                break
            assert abs(logprob - want_logprob) < tie, (request, i, logprob, want_logprob)


@pytest.fixture(scope="module")
def read_in_full(shape):
    """StreamingLLM at a budget above every request's length: atskv's kernel reading every token in
    order, the reference of the selectors that keep lists (the same kernel, another order)."""
    llm = engine(shape, "vllm:streaming_llm", 4096, max_num_batched_tokens=512)
    want = greedy_with_runner_up(llm, prompts(1500, 4, 49152, seed=13), 24)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return want


@pytest.mark.parametrize("selector", ["snapkv", "h2o", "learned", "sparq", "h2o+sparq"])
def test_selectors_that_rank_tokens_read_in_full_at_a_budget_above_the_context(shape, read_in_full, selector,
                                                                               tmp_path):  # fmt: skip
    """SnapKV, H2O and the learned selector (a random predictor that reads no hidden state) score
    each prompt in 512-token chunks (some beside other requests' decodes) and keep their lists by
    physical slot; SparQ ranks every token from the cache's keys at each step, `h2o+sparq` the
    tokens H2O keeps at 4x the budget. With a budget above every request's length they read every
    token: the tokens and log-probabilities of reading everything, up to near-ties. At 64 tokens
    the same requests finish, and the pool is whole again."""
    from atskv.eval.vllm_speed import random_engine_predictor

    options = {}
    if selector == "learned":
        options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor"))}
    llm = engine(shape, f"vllm:{selector}", 4096, max_num_batched_tokens=512, options=options)
    assert_same_up_to_near_ties(greedy_with_runner_up(llm, prompts(1500, 4, 49152, seed=13), 24), read_in_full)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    small = engine(shape, f"vllm:{selector}", 64, max_num_batched_tokens=512, options=options)
    held = held_while_decoding(small, prompts(1500, 4, 49152, seed=13), 30)
    assert held >= 4 * 94, "reading less frees nothing: the blocks stay vLLM's"


def test_h2o_scores_prompts_with_flashattentions_log_sum_exps_as_with_its_own_pass(shape, monkeypatch):
    """H2O's prompt mass, layer by layer and slot by slot, from the log-sum-exps vLLM's
    FlashAttention returns beside each prefill chunk's output (512-token chunks, some beside other
    requests' decodes) equals the one from its own logits-only pass, to bf16 rounding."""
    from atskv.runtime.vllm.backend import AtskvAttentionImpl

    batch = prompts(1500, 3, 49152, seed=17)

    def prompt_masses(llm) -> list[torch.Tensor]:
        greedy_tokens(llm, batch, 4)
        return llm.apply_model(lambda model: [
            m.impl.state.prompt_mass.cpu() for m in model.modules()
            if isinstance(getattr(m, "impl", None), AtskvAttentionImpl) and m.impl.state is not None])[0]  # fmt: skip

    original, kept = AtskvAttentionImpl.prefill_with_lse, []
    monkeypatch.setattr(AtskvAttentionImpl, "prefill_with_lse",
                        lambda self, *args: kept.append(original(self, *args)) or kept[-1])  # fmt: skip
    # the same pool size in both engines: the same slots, so the per-slot masses line up
    from_flash = prompt_masses(engine(shape, "vllm:h2o", 64, max_num_batched_tokens=512, blocks=1024))
    assert kept and all(lse is not None for lse in kept), "every prefill took FlashAttention's log-sum-exps"
    gc.collect()
    torch.cuda.empty_cache()
    monkeypatch.setattr(AtskvAttentionImpl, "prefill_with_lse", lambda self, *args: None)
    own = prompt_masses(engine(shape, "vllm:h2o", 64, max_num_batched_tokens=512, blocks=1024))
    assert len(from_flash) == len(own) == 28  # 30 layers, 2 dense
    null = 16  # block 0 is vLLM's null block: padded tokens of captured batches write there, in no request
    for flash_mass, own_mass in zip(from_flash, own):
        assert own_mass[null:].sum() > 0
        torch.testing.assert_close(flash_mass[null:], own_mass[null:], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("selector", ["snapkv", "h2o", "learned"])
def test_with_atskvs_worker_each_prompt_is_ranked_once_into_the_same_lists(shape, selector, monkeypatch, tmp_path):
    """atskv's worker shows the builder each prompt's length, so the selectors that rank a whole
    prompt rank it once, at its last chunk (512-token chunks of 1500-token prompts, some beside other
    requests' decodes); without it (vLLM's own worker) they rank it at every chunk. Their states
    (rankings or kept lists, their values, the prompt's mass), slot by slot and layer by layer once
    the prompts are in (one new token each: no decode step, whose read-mass adds are atomics), are
    the same."""
    from atskv.eval.vllm_speed import random_engine_predictor
    from atskv.runtime.vllm.backend import AtskvAttentionImpl
    from atskv.runtime.vllm.heavy_hitters import KeptLists
    from atskv.runtime.vllm.prompt_ranks import PromptRanks

    options = {}
    if selector == "learned":
        options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor"))}
    batch = prompts(1500, 3, 49152, seed=23)
    ranking = (PromptRanks, "store") if selector == "snapkv" else (KeptLists, "keep_top")
    ranked, original = [], getattr(*ranking)
    monkeypatch.setattr(*ranking, lambda self, *args, **kwargs: ranked.append(1) or original(self, *args, **kwargs))

    def selector_states(model) -> list[list[torch.Tensor]]:
        """Each sparse layer's state as its tensors (a dataclass of them)."""
        impls = [m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), AtskvAttentionImpl)]
        return [[t for t in vars(i.state).values() if torch.is_tensor(t)] for i in impls if i.state is not None]

    def states(worker_cls: str | None) -> tuple[list[torch.Tensor], int]:
        llm = engine(shape, f"vllm:{selector}", 64, max_num_batched_tokens=512, blocks=1024, worker_cls=worker_cls,
                     options=options)  # fmt: skip
        ranked.clear()  # what vLLM's own warm-up runs ranked is not counted
        greedy_tokens(llm, batch, 1)
        tensors = llm.apply_model(lambda model: [t.cpu() for state in selector_states(model) for t in state])[0]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return tensors, len(ranked)

    once, ranks_once = states(None)  # engine_arguments gives atskv's worker
    every, ranks_every = states("auto")
    assert ranks_once == 3 * 28, "each of the 3 prompts ranked once in each of the 28 sparse layers"
    assert ranks_every > ranks_once
    null = 16  # vLLM's null block: padded tokens of captured batches write there, in no request
    assert len(once) == len(every) >= 2 * 28
    for a, b in zip(once, every, strict=True):  # every tensor of a state is by slot first
        torch.testing.assert_close(a[null:], b[null:], rtol=0, atol=0)


@pytest.mark.parametrize("selector", ["quest", "streaming_llm", "h2o", "learned"])
def test_preempted_requests_are_recomputed_and_give_the_pool_back(shape, selector, tmp_path):
    """A pool of 260 blocks (vLLM wants one request of max_model_len 4096 to fit: 256) for 4
    requests of 1000-token prompts (63 blocks each) and 64 new tokens: as they grow, vLLM preempts
    one (its blocks freed, its tokens recomputed later by a prefill). Every request finishes, the
    pool is whole again, and the tokens are those of a pool large enough for all, up to near-ties
    (the recompute's prefill computes the generated tokens' KV in one GEMM rather than one a step):
    with atskv's worker the recompute ranks the prompt at its own end and reads the outputs as
    their decode steps did (H2O's list moved on by each in order, the learned selector's queue read
    at each one's length; `prefill_rows`)."""
    from atskv.eval.vllm_speed import random_engine_predictor

    options = {}
    if selector == "learned":
        options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor"))}
    batch = prompts(1000, 4, 49152, seed=21)
    roomy = engine(shape, f"vllm:{selector}", 64, options=options)
    want = greedy_with_runner_up(roomy, batch, 64)
    del roomy
    gc.collect()
    torch.cuda.empty_cache()
    tight = engine(shape, f"vllm:{selector}", 64, blocks=260, options=options)
    scheduler = tight.llm_engine.engine_core.engine_core.scheduler
    preempted, preempt = [], scheduler._preempt_request
    scheduler._preempt_request = lambda request, timestamp: (preempted.append(request.request_id),
                                                              preempt(request, timestamp))[1]  # fmt: skip
    idle = free_blocks(tight)
    got = greedy_with_runner_up(tight, batch, 64)
    assert preempted, "the pool must be small enough to preempt a request"
    assert [len(r) for r in got] == [64] * 4 and free_blocks(tight) == idle
    assert_same_up_to_near_ties(got, want)


def test_the_learned_selector_reads_every_layers_queue_at_once_as_layer_by_layer(shape, monkeypatch, tmp_path):
    """Without a refresh the forward's first sparse layer reads all 28 sparse layers' queues in one
    kernel (the rest find theirs in the forward's `step`), in captured decode graphs and eager
    mixed batches: the tokens and log-probabilities of one read a layer, exactly."""
    from atskv.eval.vllm_speed import random_engine_predictor
    from atskv.runtime.vllm import learned

    options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor"))}
    batch, reads, original = prompts(1500, 4, 49152, seed=29), [], learned.queue_read
    monkeypatch.setattr(learned, "queue_read", lambda kept, *args: reads.append(len(kept) if isinstance(kept, list)
                                                                                else 1) or original(kept, *args))
    at_once = engine(shape, "vllm:learned", 64, max_num_batched_tokens=512, options=options)
    want = tokens_and_logprobs(at_once, batch, 24)
    assert 28 in reads  # (the forwards before every layer's lists exist read layer by layer)
    del at_once
    gc.collect()
    torch.cuda.empty_cache()
    reads.clear()
    monkeypatch.setattr(learned, "AT_ONCE_BYTES", 0)
    each = engine(shape, "vllm:learned", 64, max_num_batched_tokens=512, options=options)
    tokens, logprobs = tokens_and_logprobs(each, batch, 24)
    assert set(reads) == {1}
    assert tokens == want[0]
    torch.testing.assert_close(logprobs, want[1], rtol=0, atol=0)


def test_the_learned_selector_with_a_refresh_reads_in_full_at_a_budget_above_the_context(shape, read_in_full,
                                                                                        tmp_path):  # fmt: skip
    """`refresh_every: 4`: its rescoring kernel inside the CUDA-graph decode (rows due every fourth
    step, the rest exiting at once) and the read mass it accumulates change nothing when the list
    holds every token; at 64 tokens the requests finish and the pool is whole again."""
    from atskv.eval.vllm_speed import random_engine_predictor

    options = {"predictor": str(random_engine_predictor("smollm2-135m-shape", 2, tmp_path / "predictor")),
               "refresh_every": 4}  # fmt: skip
    llm = engine(shape, "vllm:learned", 4096, max_num_batched_tokens=512, options=options)
    assert_same_up_to_near_ties(greedy_with_runner_up(llm, prompts(1500, 4, 49152, seed=13), 24), read_in_full)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    small = engine(shape, "vllm:learned", 64, max_num_batched_tokens=512, options=options)
    assert held_while_decoding(small, prompts(1500, 4, 49152, seed=13), 30) >= 4 * 94
