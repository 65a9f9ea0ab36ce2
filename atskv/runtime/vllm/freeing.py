"""Memory turned into concurrency: the blocks a selector never reads again go back to vLLM's pool.

A layer whose selector leaves blocks unread by a rule of the request's lengths alone
(`frees_blocks`: StreamingLLM's sinks and recent window; SnapKV's, H2O's and the learned
selector's kept tokens, compacted into the request's first slots at the prompt's end) declares
itself to vLLM with `UnreadBlocksSpec`, a full-attention KV spec that names the selector and its
budget. vLLM's scheduler then manages that layer's blocks with `UnreadBlocksManager`: each step,
before it allocates, the blocks the selector will not read (`unread_blocks`) leave the request's
block table (vLLM's null block takes their place, so logical positions stay) and return to the
pool, and the scheduler admits more requests.
The same hook frees sliding-window layers' blocks in vLLM itself (`remove_skipped_blocks`).

Dense layers beside freeing ones declare `KeptBlocksSpec`: vLLM's full attention under a type of
its own, so that vLLM's grouping (which merges every subclass of `FullAttentionSpec` into one
group) lays the model out as a hybrid one, as it does Gemma's sliding-window and global layers:
one block table per group of layers, one pool, each group's blocks managed by its own rule.

The spec is registered with vLLM's KV-spec registry when this module is imported: in the worker,
which creates the specs (`atskv.runtime.vllm.worker`), and in the scheduler's process, which
unpickles them. Prefix caching is refused with freeing (a freed block's hash could be matched).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from atskv.runtime.vllm.composition import freeing_rule
from atskv.runtime.vllm.host_tier import split_unread


def full_attention_fields(spec: FullAttentionSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec)}


def check_one_type(cls: type, specs: list) -> None:
    """vLLM's merge contract: an AssertionError tells its uniformity check the layers differ."""
    assert all(type(spec) is cls for spec in specs), f"layers of other kinds than {cls.__name__} in one group"


@dataclass(frozen=True, kw_only=True)
class KeptBlocksSpec(FullAttentionSpec):
    """A full-attention layer that keeps all its blocks, beside layers that free theirs."""

    @classmethod
    def merge(cls, specs: list[KeptBlocksSpec]) -> KeptBlocksSpec:
        check_one_type(cls, specs)
        return super().merge(specs)

    @classmethod
    def of(cls, spec: FullAttentionSpec) -> KeptBlocksSpec:
        return cls(**full_attention_fields(spec))


@dataclass(frozen=True, kw_only=True)
class UnreadBlocksSpec(FullAttentionSpec):
    """A full-attention layer whose blocks past its selector's reach are freed: which selector
    (a plugin selector's name, one or a composition, that `frees_blocks`), its options and its
    budget."""

    selector: str
    budget: int | float
    options: str = "{}"  # the selector's options as canonical JSON (a composition's nest dicts: hashable so)
    cache_blocks: int = 0  # of those freed, the first kept to hold a host tier's pages (`split_unread`)

    @classmethod
    def merge(cls, specs: list[UnreadBlocksSpec]) -> UnreadBlocksSpec:
        """One group's spec: FullAttentionSpec's merge, with the selector all its layers share."""
        check_one_type(cls, specs)
        rules = {(s.selector, s.budget, s.options, s.cache_blocks) for s in specs}
        if len(rules) != 1:
            raise ValueError(f"the layers of one KV cache group read by different rules: {rules}")
        selector, budget, options, cache_blocks = rules.pop()
        return cls.of(FullAttentionSpec.merge(specs), selector, budget, json.loads(options), cache_blocks)

    @classmethod
    def of(cls, spec: FullAttentionSpec, selector: str, budget: int | float, options: dict | None,
           cache_blocks: int = 0) -> UnreadBlocksSpec:  # fmt: skip
        return cls(**full_attention_fields(spec), selector=selector, budget=budget,
                   options=json.dumps(options or {}, sort_keys=True), cache_blocks=cache_blocks)  # fmt: skip


class UnreadBlocksManager(FullAttentionManager):
    """vLLM's full-attention block manager, freeing each request's blocks its selector will not read."""

    def __init__(self, kv_cache_spec: UnreadBlocksSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.unread_blocks = freeing_rule(kv_cache_spec.selector, json.loads(kv_cache_spec.options))
        self.budget, self.cache_blocks = kv_cache_spec.budget, kv_cache_spec.cache_blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:  # fmt: skip
        if num_prompt_tokens is None:  # a caller that does not say where the prompt ends: keep all
            return
        unread = self.unread_blocks(processed_computed_tokens, num_prompt_tokens, self.budget, self.block_size)
        freed = split_unread(unread, self.cache_blocks)[1]
        self._remove_blocks_in_range(request_id, freed.start, freed.stop)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """No cascade attention over a shared prefix: part of it may be null blocks."""
        return 0


KVCacheSpecRegistry.check_kv_cache_spec_registry({})  # vLLM's own specs first: it registers them lazily, once
KVCacheSpecRegistry.register(UnreadBlocksSpec, UnreadBlocksManager, uniform_type_base_spec=UnreadBlocksSpec)
KVCacheSpecRegistry.register(KeptBlocksSpec, FullAttentionManager, uniform_type_base_spec=KeptBlocksSpec)
