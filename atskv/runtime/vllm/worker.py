"""vLLM's GPU worker for the plugin: pass `worker_cls="atskv.runtime.vllm.worker.AtskvWorker"`
beside `attention_backend="CUSTOM"`. Two things change from vLLM's worker:

- With `free_blocks`, vLLM asks its worker for each layer's KV spec; this one answers
  `UnreadBlocksSpec` for the layers that read sparsely with a selector that frees blocks, so the
  scheduler manages their blocks with `UnreadBlocksManager` (`atskv.runtime.vllm.freeing`), and
  `KeptBlocksSpec` for the other full-attention layers (the dense ones), which vLLM then lays out
  in groups of their own.
- The backend's metadata builders get each batch row's prompt length from the model runner (an
  attention backend is not shown them), so the selectors that rank a whole prompt (SnapKV, H2O,
  the learned selector) rank it once, at the chunk that reaches its end, instead of at every
  chunk (their ranking costs O(L) a chunk, O(L^2 / chunk) a prompt without it), a recompute
  after preemption reads its outputs as their decode steps did, and `free_blocks` can compact
  the evicting selectors' lists where the prompt ends (`atskv.runtime.vllm.batch.prefill_rows`)."""

from __future__ import annotations

from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.worker.gpu_worker import Worker

from atskv.errors import InputError
from atskv.runtime.vllm.backend import AtskvAttentionImpl, AtskvMetadataBuilder
from atskv.runtime.vllm.batch import RunnerBatch
from atskv.runtime.vllm.config import PluginConfig
from atskv.runtime.vllm.freeing import KeptBlocksSpec, UnreadBlocksSpec

logger = init_logger(__name__)


class AtskvWorker(Worker):
    """vLLM's worker, declaring the sparse layers' KV as `UnreadBlocksSpec` when blocks are freed
    and showing the backend's builders the batch's prompt lengths."""

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        runner = self.model_runner
        builders = [builder for groups in getattr(runner, "attn_groups", []) for group in groups
                    for builder in group.metadata_builders if isinstance(builder, AtskvMetadataBuilder)]  # fmt: skip
        batch = RunnerBatch(runner)
        for builder in builders:
            builder.batch = batch
        logger.info("atskv: the batch's prompt lengths and requests shown to %d metadata builders", len(builders))

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        specs = super().get_kv_cache_spec()
        config = PluginConfig.from_additional_config(self.vllm_config.additional_config)
        if not config.free_blocks:
            return specs
        if self.vllm_config.cache_config.enable_prefix_caching:
            raise InputError("atskv: free_blocks needs enable_prefix_caching=False (a freed block could be matched)")
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)

        def frees(name: str) -> bool:
            layer = layers.get(name)
            return (type(specs[name]) is FullAttentionSpec and layer is not None
                    and isinstance(layer.impl, AtskvAttentionImpl) and layer.impl.sparse_layer(layer))  # fmt: skip

        freeing = {name for name in specs if frees(name)}
        logger.info("atskv: %d of %d layers hand their unread blocks back to vLLM's pool", len(freeing), len(specs))
        return {name: self._declared(spec, name in freeing, config) for name, spec in specs.items()}

    @staticmethod
    def _declared(spec: KVCacheSpec, frees: bool, config: PluginConfig) -> KVCacheSpec:
        if frees:
            tier = config.tier
            return UnreadBlocksSpec.of(spec, config.selector, config.budget, config.options,
                                       0 if tier is None else tier.cache_pages)  # fmt: skip
        if type(spec) is FullAttentionSpec:  # a dense layer: kept apart from the freeing ones' group
            return KeptBlocksSpec.of(spec)
        return spec  # vLLM's own kinds (sliding window, ...) group by themselves
