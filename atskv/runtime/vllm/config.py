"""The plugin's settings, read the vLLM way: `LLM(..., attention_backend="CUSTOM",
additional_config={"atskv": {...}})`, or `vllm serve ... --attention-backend CUSTOM
--additional-config '{"atskv": {...}}'`. Pure Python: tested without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from atskv.errors import InputError, check_options, is_int
from atskv.runtime.vllm.protocol import check_plugin_budget

WORKER = "atskv.runtime.vllm.worker.AtskvWorker"  # vLLM's `worker_cls`: prompt lengths shown, blocks freed


@dataclass(frozen=True)
class PluginConfig:
    """`selector`: a name of `atskv.runtime.vllm.selection.PAGED_SELECTORS`, a composition of two
    (`atskv.runtime.vllm.composition`: `learned+sparq`), or "dense" (vLLM's own attention
    everywhere). `budget`: what a decode query reads (`BUDGET_RULE`). `dense_layers`: the first
    layers attend in full, as in `atskv.sparse` (sliding-window layers always do). `options`: the
    selector's own (e.g. `{"sinks": 4}` for streaming_llm; a composition's by part name, and
    `residency_budget`). `free_blocks`: the blocks a selector that `frees_blocks` will not read go
    back to vLLM's pool, so more requests fit: StreamingLLM's outside its sinks and window,
    SnapKV's, H2O's and the learned selector's once their kept tokens are compacted at the
    prompt's end (needs
    `worker_cls=WORKER` and prefix caching off: `atskv.runtime.vllm.freeing`). `host_tier`: with
    `free_blocks` and SnapKV, H2O or the learned selector, what they free is parked in pinned host
    memory first and each decode query reads back the pages it rates highest
    (`atskv.runtime.vllm.host_tier.HostTier`'s settings, e.g. `{"regions": 4, "pages": 16}`)."""

    selector: str = "quest"
    budget: int | float = 0.05
    dense_layers: int = 2
    options: dict | None = None
    free_blocks: bool = False
    host_tier: dict | None = None

    def __post_init__(self):
        from atskv.runtime.vllm.composition import build_paged_selector
        from atskv.runtime.vllm.selection import PAGED_SELECTORS

        if not isinstance(self.selector, str):
            raise InputError(f"atskv: selector must be a name, got {self.selector!r}")
        check_plugin_budget(self.budget, "budget")
        if not is_int(self.dense_layers) or self.dense_layers < 0:
            raise InputError(f"atskv: dense_layers must be an int >= 0, got {self.dense_layers!r}")
        if self.options is not None and not isinstance(self.options, dict):
            raise InputError(f"atskv: options must be a dict of the selector's own, got {self.options!r}")
        # built before any engine starts (a worker's traceback is long): its options, its own checks
        selector = None if self.selector == "dense" else build_paged_selector(self.selector, self.options)
        if self.host_tier is not None:
            if not isinstance(self.host_tier, dict):
                raise InputError(f"atskv: host_tier must be a dict of HostTier's settings, got {self.host_tier!r}")
            self.tier  # its own checks
            if not self.free_blocks or selector is None or not (selector.scores_prompt and selector.frees_blocks):
                parking = [name for name, cls in PAGED_SELECTORS.items() if cls.scores_prompt and cls.frees_blocks]
                raise InputError(f"atskv: host_tier parks what a compacting selector frees: it needs free_blocks "
                                 f"and one of {', '.join(parking)}")  # fmt: skip
        if not isinstance(self.free_blocks, bool):
            raise InputError(f"atskv: free_blocks must be true or false, got {self.free_blocks!r}")
        if self.free_blocks and (self.dense or not selector.frees_blocks):
            freeing = [name for name, cls in PAGED_SELECTORS.items() if cls.frees_blocks]
            raise InputError(f"atskv: free_blocks needs a budget below 1.0 and a selector that frees blocks: "
                             f"{', '.join(freeing)} (learned without refresh_every)")  # fmt: skip

    @property
    def dense(self) -> bool:
        """No layer reads sparsely: every forward is vLLM's own."""
        return self.selector == "dense" or self.budget == 1.0

    @property
    def tier(self):
        """The host tier's settings (`HostTier`), or None without one."""
        from atskv.runtime.vllm.host_tier import HostTier

        if self.host_tier is None:
            return None
        check_options("atskv's host_tier", self.host_tier, [f.name for f in fields(HostTier)])
        return HostTier(**self.host_tier)

    @classmethod
    def from_additional_config(cls, additional: Any) -> PluginConfig:
        """From vLLM's `additional_config` (its "atskv" entry; absent: the defaults)."""
        settings = (additional or {}).get("atskv", {}) if isinstance(additional, dict) else {}
        if not isinstance(settings, dict):
            raise InputError(f"additional_config['atskv'] must be a dict, got {type(settings).__name__}")
        check_options("additional_config['atskv']", settings, [f.name for f in fields(cls)])
        return cls(**settings)
