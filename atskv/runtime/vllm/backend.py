"""atskv as a vLLM attention backend: vLLM's FlashAttention backend with its decode reads cut down.

Everything but a decode query's attention stays vLLM's: the KV cache and its layout, prefill and
chunked prefill (FlashAttention), the batching, prefix caching, torch.compile and CUDA graphs. The
builder puts decode requests first in each batch (`reorder_batch_threshold = 1`) and counts them;
the implementation then attends the prefill part with FlashAttention and each decode query over the
slots its selector picks (`atskv.runtime.vllm.selection`), reading vLLM's paged cache in place.
Selectors that keep state beside the cache (Quest's per-block key bounds, SnapKV's prompt ranking and
H2O's kept tokens by physical slot) keep it current from the KV write (`do_kv_cache_update`), from
each prefill chunk's queries after its FlashAttention (those that score the prompt) or from the mass
each decode read returns (H2O). With `free_blocks`, the blocks a
selector no longer reads go back to vLLM's pool (`atskv.runtime.vllm.freeing`); the selector
never picks them. With a host tier, what a compacting selector frees is parked on the host first
and each decode query reads back its best pages beside its kept tokens
(`atskv.runtime.vllm.host_tier`). Full CUDA graphs are captured for pure decode batches only
(`UNIFORM_SINGLE_TOKEN_DECODE`); mixed batches run piecewise, their attention eager.

Layers that stay vLLM's own: the first `dense_layers`, sliding-window layers, non-decoder attention,
fp8 caches, ALiBi, attention sinks and soft-capped logits."""

from __future__ import annotations

import functools

import torch
from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    model_parallel_is_initialized,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import FullAttentionSpec

from atskv.errors import InputError
from atskv.runtime.vllm.batch import PromptChunk, RunnerBatch, past_reads, prefill_rows, prefill_share, unranked_prompts
from atskv.runtime.vllm.composition import build_paged_selector, freeing_rule
from atskv.runtime.vllm.config import WORKER, PluginConfig
from atskv.runtime.vllm.host_tier import ParkedPrompts, Parking, Regions, region_nbytes, split_unread
from atskv.runtime.vllm.protocol import shard_kv_heads
from atskv.runtime.vllm.selection import paged_sparse_decode, slot_view

logger = init_logger(__name__)
PAST_WAVE = 256  # a recompute's past-prompt tokens read at once (each a block table row's copy)


class AtskvMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention's metadata, with the decode requests at the front and counted."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold = 1
    # the batch's prompt lengths and request ids, where `AtskvWorker` hands over its runner's
    batch: RunnerBatch | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = PluginConfig.from_additional_config(vllm_config.additional_config)
        self.config, self.sparse = config, not config.dense
        self.tier, self.regions = (config.tier if self.sparse else None), None
        # what the scheduler frees by (`freeing`): the tier parks up to its end and keeps its first blocks
        self.unread = None if self.tier is None else freeing_rule(config.selector, config.options or {})
        self.scores_prompt = self.sparse and build_paged_selector(config.selector, config.options).scores_prompt
        if self.scores_prompt and vllm_config.cache_config.enable_prefix_caching:  # a shared first block
            raise InputError(f"atskv: {config.selector} ranks each prompt in its own blocks; it needs "
                             "enable_prefix_caching=False")  # fmt: skip
        if config.free_blocks and type(kv_cache_spec) is FullAttentionSpec:  # every layer frees (PluginConfig)
            raise InputError(f"atskv: free_blocks needs vLLM's worker_cls={WORKER!r} (it declares the layers "
                             f"whose blocks are freed); this group's is {type(kv_cache_spec).__name__}")  # fmt: skip

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> FlashAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        decodes, prefills, decode_tokens, prefill_tokens = split_decodes_and_prefills(common_attn_metadata)
        metadata.num_decode_reqs, metadata.num_prefill_reqs = decodes, prefills
        metadata.num_decode_tokens, metadata.num_prefill_tokens = decode_tokens, prefill_tokens
        if self.sparse and prefills:  # eager batches only (prefill is never a full graph)
            prompts = None if self.batch is None else self.batch.prompt_lengths()
            prompts = None if prompts is None else prompts[: common_attn_metadata.num_reqs]
            prompt, past = prefill_rows(common_attn_metadata.query_start_loc_cpu, common_attn_metadata.seq_lens_cpu,
                                        decodes, prefills, prompts)  # fmt: skip
            if self.scores_prompt:
                metadata.atskv_prompt_rows = prompt
            if prompts is not None:
                metadata.atskv_past_rows = past
                if self.scores_prompt and unranked_prompts(common_attn_metadata.seq_lens_cpu, prompts, decodes):
                    logger.warning_once("atskv: vLLM ran a prompt's last two tokens as one-token rows, so %s "
                                        "never ranked that prompt and its decode reads miss its tokens",
                                        self.config.selector)  # fmt: skip
                if self.tier is not None:
                    metadata.atskv_parking = self.parking(prompt, prompts, metadata.block_table)
        if self.tier is not None:
            metadata.atskv_regions = self.host_regions()
        return metadata

    def host_regions(self) -> Regions:
        if self.regions is None:  # the pool's size is known once the cache exists
            spec = self.kv_cache_spec
            count = tier_regions(self.tier, self.vllm_config, spec.num_kv_heads, spec.head_size, spec.block_size,
                                 spec.dtype)  # fmt: skip
            self.regions = Regions(count, self.vllm_config.cache_config.num_gpu_blocks, self.device)
        return self.regions

    def parking(self, rows, prompts, block_table) -> dict[int, Parking]:
        """The host tier's parking of each prompt ranked in this batch (the chunk known to end it):
        a region if one is free and the prompt frees enough blocks to hold a cache. Every such
        request's first block is told its region or none (a block's earlier tenant may have had one)."""
        requests = self.batch.requests()
        if requests is None:
            return {}
        ids, live = requests
        size, parking = self.kv_cache_spec.block_size, {}
        for row, _, _, _, last in rows:
            if not last:
                continue
            prompt = int(prompts[row])
            cache, freed = split_unread(self.unread(prompt, prompt, self.config.budget, size), self.tier.cache_pages)
            region = self.host_regions().claim(ids[row], live) if len(cache) else None
            self.host_regions().assign(block_table[row, :1], region)
            if region is not None:
                parking[row] = Parking(region, freed.stop * size, cache.start * size)
        return parking


def tier_regions(tier, vllm_config, kv_heads: int, head_size: int, block_size: int, dtype) -> int:
    """The host tier's region count, the same for the metadata builder and every layer: its
    `regions`, or as many as its `gib` holds over this GPU's sparse layers."""
    if tier.gib is None:
        return tier.region_count()
    from vllm.model_executor.layers.attention import Attention  # the layer module imports backends: not at the top

    layers = get_layers_from_vllm_config(vllm_config, Attention)
    sparse = sum(isinstance(layer.impl, AtskvAttentionImpl) and layer.impl.sparse_layer(layer)
                 for layer in layers.values())  # fmt: skip
    tokens = vllm_config.model_config.max_model_len
    return tier.region_count(sparse * region_nbytes(tokens, kv_heads, head_size, block_size, dtype))


def tensor_shard(vllm_config) -> tuple[int, int] | None:
    """This GPU's share of the model's KV heads under tensor parallelism (`shard_kv_heads`), None on one GPU."""
    if vllm_config is None or not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() == 1:
        return None
    total = vllm_config.model_config.get_total_num_kv_heads()
    return shard_kv_heads(total, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())


class AtskvAttentionImpl(FlashAttentionImpl):
    """FlashAttention for prefill tokens; atskv's selection and sparse decode kernel for decodes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        self.config = PluginConfig.from_additional_config(vllm_config.additional_config if vllm_config else None)
        self.selector = None if self.config.dense else build_paged_selector(self.config.selector, self.config.options)
        self.state = None  # the selector's, beside the cache (`keeps_state`): made once the cache exists
        self._state_blocks = 0
        self.tier = None if self.config.dense else self.config.tier
        self.parked: ParkedPrompts | None = None  # this layer's host tier, made with the state
        self.vllm_config = vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len if vllm_config else 0
        self.kv_shard = tensor_shard(vllm_config)
        self._sparse: bool | None = None  # decided at the first call, which names the layer
        self._later: list[AtskvAttentionImpl] | None = None  # this engine's sparse layers from this one on

    def sparse_layer(self, layer) -> bool:
        if self._sparse is None:
            own_rule = (
                self.selector is None
                or self.attn_type != AttentionType.DECODER
                or self.sliding_window != (-1, -1)
                or self.kv_cache_dtype.startswith("fp8")
                or self.alibi_slopes is not None
                or self.sinks is not None
                or self.logits_soft_cap
                or self.dcp_world_size > 1
            )
            index = extract_layer_index(layer.layer_name)
            self._sparse = not own_rule and index >= self.config.dense_layers
            if self._sparse:
                self.selector.layer, self.selector.kv_shard = index, self.kv_shard
                self.selector.later_states = self.later_states
        return self._sparse

    def later_states(self) -> list | None:
        """The selector states of this engine's sparse layers from this one on, in layer order (a
        selector may read them all at a forward's first sparse layer), or None outside an engine
        and while any is not made yet (the forwards before vLLM captures its graphs)."""
        if self.vllm_config is None:
            return None
        if self._later is None:
            from vllm.model_executor.layers.attention import Attention  # imports backends: not at the top

            layers = get_layers_from_vllm_config(self.vllm_config, Attention)
            sparse = sorted(((extract_layer_index(name), layer.impl) for name, layer in layers.items()
                             if isinstance(layer.impl, AtskvAttentionImpl) and layer.impl.sparse_layer(layer)),
                            key=lambda pair: pair[0])  # fmt: skip
            self._later = [impl for index, impl in sparse if index >= self.selector.layer]
        states = [impl.state for impl in self._later]
        return None if any(state is None for state in states) else states

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if kv_cache.numel() and self.sparse_layer(layer) and self.selector.keeps_state:
            blocks, heads, block_size, _ = kv_cache.shape
            if self.state is None or self._state_blocks != blocks:
                if torch.cuda.is_current_stream_capturing():  # a fill captured here would replay every step
                    raise RuntimeError("atskv: the selector's state must be allocated before CUDA graph capture")
                self.state = self.selector.new_state(blocks, block_size, heads, self.head_size, key.dtype, key.device)
                self._state_blocks = blocks
                size = sum(t.numel() * t.element_size() for t in _tensors(self.state))
                logger.info_once("atskv: %s's state beside %d blocks, %.2f GiB per layer", self.selector.name,
                                 blocks, size / 2**30)  # fmt: skip
                if self.tier is not None:
                    regions = tier_regions(self.tier, self.vllm_config, heads, self.head_size, block_size, key.dtype)
                    self.parked = ParkedPrompts(self.tier, regions, self.max_model_len, heads, self.head_size,
                                                block_size, key.dtype, key.device)  # fmt: skip
                    logger.info_once("atskv: host tier of %d regions, %.2f GiB pinned and %.2f GiB on the GPU per "
                                     "layer", regions, self.parked.host_nbytes / 2**30,
                                     self.parked.gpu_nbytes / 2**30)  # fmt: skip
            self.selector.after_write(self.state, key, slot_mapping, block_size)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        decodes = 0 if attn_metadata is None else attn_metadata.num_decode_reqs
        if not decodes or attn_metadata.use_cascade or output_scale is not None or not self.sparse_layer(layer):
            wanted = output_scale is None and self.prompt_lse_wanted(layer, attn_metadata)
            lse = self.attend(layer, query, key, value, kv_cache, attn_metadata, output, wanted, output_scale,
                              output_block_scale)  # fmt: skip
            if attn_metadata is not None and self.sparse_layer(layer):
                self.observe_prompts(query, kv_cache, attn_metadata, lse)
                if output_scale is None:
                    self.read_past_prompts(query, kv_cache, attn_metadata, output)
            return output
        tokens = attn_metadata.num_actual_tokens
        if tokens > decodes:  # the prefill requests behind the decodes: FlashAttention over their share
            rest = prefill_share(attn_metadata, decodes)  # (which drops the builder's prompt rows: asked here)
            lse = self.attend(layer, query[decodes:], key[decodes:], value[decodes:], kv_cache, rest,
                              output[decodes:], self.prompt_lse_wanted(layer, attn_metadata))  # fmt: skip
            self.observe_prompts(query, kv_cache, attn_metadata, lse, decodes)
            self.read_past_prompts(query, kv_cache, attn_metadata, output)
        step = attn_metadata.__dict__.setdefault("atskv_step", {})  # one forward's metadata: shared by its layers
        q = query[:decodes]
        self.read_sparsely(q, kv_cache, attn_metadata.block_table[:decodes], attn_metadata.seq_lens[:decodes], step,
                           output[:decodes].view(q.shape), attn_metadata.__dict__.get("atskv_regions"))  # fmt: skip
        return output

    def read_sparsely(self, q, kv_cache, table, seq_lens, step: dict, out, regions: Regions | None = None) -> None:
        """Decode queries `q` `[B, Hq, D]` (request `b` at position `seq_lens[b] - 1`, its block
        table row `table[b]`) over what the selector picks (and, with a host tier's `regions`, the
        parked tokens of their best pages), into `out` `[B, Hq, D]`; the selector then sees the
        mass the read gave its own picks (`reads_mass`)."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        block_size = kv_cache.shape[2]
        keys = {"keys": slot_view(key_cache, 1)[0], "scaling": self.scale} if self.selector.reads_keys else {}
        positions, lengths = self.selector.pick(q, self.num_kv_heads, self.state, table, seq_lens, block_size,
                                                self.config.budget, step, **keys)  # fmt: skip
        picked = positions.shape[-1]
        if self.parked is not None and regions is not None:
            positions, lengths = self.parked.extend(q, positions, lengths, *regions.plan(table, step, self), table,
                                                    key_cache, value_cache)  # fmt: skip
        read = paged_sparse_decode(q, key_cache, value_cache, positions, lengths, table, self.scale, out=out,
                                   want_mass=self.selector.reads_mass)  # fmt: skip
        if self.selector.reads_mass:  # its own entries' (a tier's come after them)
            self.selector.observe_read(self.state, read[1][..., :picked], table, seq_lens, block_size)

    def read_past_prompts(self, query, kv_cache, metadata, output) -> None:
        """A recompute's tokens past their request's prompt (`prefill_rows`), FlashAttention's
        dense output for them replaced by the sparse read each had as a decode (their KV is in the
        cache: the forward wrote the chunk first), in the reads `past_prompt_waves` makes. Only
        after a preemption."""
        rows = metadata.__dict__.get("atskv_past_rows")
        if not rows or (self.selector.keeps_state and self.state is None):
            return
        out = output.view(query.shape[0], -1, self.head_size)
        steps = metadata.__dict__.setdefault("atskv_past_steps", {})  # a read's, shared by the forward's layers
        reads = metadata.__dict__.get("atskv_past_reads")
        if reads is None:  # the forward's first sparse layer makes them for the rest
            reads = past_reads(rows, self.selector.picks_in_order, PAST_WAVE, query.device, metadata.seq_lens.dtype)
            metadata.__dict__["atskv_past_reads"] = reads
        for i, (requests, tokens, seq_lens) in enumerate(reads):
            read = out.new_empty(tokens.shape[0], *out.shape[1:])
            self.read_sparsely(query[tokens], kv_cache, metadata.block_table[requests], seq_lens,
                               steps.setdefault(i, {}), read, metadata.__dict__.get("atskv_regions"))  # fmt: skip
            out[tokens] = read

    def attend(self, layer, query, key, value, kv_cache, metadata, output, lse_wanted: bool, *scales):
        """vLLM's FlashAttention over `metadata`'s requests into `output`; with `lse_wanted`, through
        `prefill_with_lse`, whose log-sum-exps it returns (None where it keeps none: vLLM's forward)."""
        lse = self.prefill_with_lse(query, kv_cache, metadata, output) if lse_wanted else None
        if lse is None:
            super().forward(layer, query, key, value, kv_cache, metadata, output, *scales)
        return lse

    def prompt_lse_wanted(self, layer, metadata) -> bool:
        """Whether this forward's prefill chunks go to a selector that takes their log-sum-exps."""
        return (
            metadata is not None
            and self.sparse_layer(layer)
            and self.selector.takes_prompt_lse
            and self.state is not None
            and bool(metadata.__dict__.get("atskv_prompt_rows"))
        )

    def prefill_with_lse(self, query, kv_cache, metadata, output) -> torch.Tensor | None:
        """FlashAttention over `metadata`'s requests into `output`, as vLLM's forward runs it for a
        plain causal decoder layer (what a sparse layer is), keeping the queries' log-sum-exps
        `[Hq, tokens]`: a selector's prompt mass then needs no pass of its own for them. None, with
        nothing done, where vLLM's forward does more (cascade attention, per-request causality,
        multimodal prefixes, restricted sliding windows): the selector computes them itself."""
        if (
            metadata.use_cascade
            or metadata.causal is not True
            or getattr(metadata, "mm_prefix_range_tensor", None) is not None
            or getattr(metadata, "rswa_prefix_lens", None) is not None
        ):
            return None
        tokens = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        _, lse = flash_attn_varlen_func(
            q=query[:tokens], k=key_cache, v=value_cache, out=output[:tokens],
            cu_seqlens_q=metadata.query_start_loc, max_seqlen_q=metadata.max_query_len,
            seqused_k=metadata.seq_lens, max_seqlen_k=metadata.max_seq_len, softmax_scale=self.scale, causal=True,
            block_table=metadata.block_table, scheduler_metadata=metadata.scheduler_metadata,
            fa_version=self.vllm_flash_attn_version, num_splits=metadata.max_num_splits, return_softmax_lse=True,
        )  # fmt: skip
        return lse

    def observe_prompts(self, query, kv_cache, metadata, lse=None, lse_offset: int = 0) -> None:
        """Each prefill request's chunk, to a selector that scores the prompt (`scores_prompt`):
        its queries, its keys so far through its block table (eager: prefill runs outside full
        graphs) and, where the backend kept them, its queries' log-sum-exps (`lse` `[Hq, tokens]`,
        its columns the batch's tokens from `lse_offset` on)."""
        rows = metadata.__dict__.get("atskv_prompt_rows")
        if not rows or self.state is None:  # none, or vLLM's profiling run before the cache exists
            return
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)  # [blocks, size, Hkv, D]
        key_slots, value_slots = slot_view(key_cache, 1)[0], slot_view(value_cache, 1)[0]
        known = metadata.__dict__.get("atskv_past_rows") is not None  # the prompts' lengths, from the worker
        queries = query.view(query.shape[0], -1, self.head_size)
        step = metadata.__dict__.setdefault("atskv_step", {})
        parking = metadata.__dict__.get("atskv_parking", {}) if self.parked is not None else {}
        for row, start, stop, length, last in rows:  # a sparse layer's: `sparse_layer` named the selector's layer
            rows_lse = None if lse is None else lse[:, start - lse_offset : stop - lse_offset].float()
            parked = parking.get(row)
            kept = None if parked is None else functools.partial(self.parked.mark_kept, parked.region)
            chunk = PromptChunk(queries[start:stop], key_slots, metadata.block_table[row], length, key_cache.shape[1],
                                self.scale, self.config.budget, self.selector.layer, row, step, rows_lse, last,
                                value_slots, self.config.free_blocks and known and last, kept)  # fmt: skip
            if parked is not None:  # before the selector moves its kept tokens over the prompt's first slots
                self.parked.park(parked, chunk)
            self.selector.observe_prompt(self.state, chunk)


def _tensors(state) -> list[torch.Tensor]:
    """The tensors a selector's state holds (a tuple of them, or a dataclass of them)."""
    values = state if isinstance(state, tuple) else vars(state).values()
    return [t for t in values if isinstance(t, torch.Tensor)]


class AtskvAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend (same cache, same prefill) with atskv's sparse decode."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[AtskvAttentionImpl]:
        return AtskvAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AtskvMetadataBuilder]:
        return AtskvMetadataBuilder
