"""atskv: learned KV-cache relevance prediction and tiered KV memory for long-context LLMs.

The public names load on first use (PEP 562), so that a process which only needs the kernels or
the vLLM plugin (`atskv.runtime.vllm`, loaded in every vLLM worker) does not import transformers.
"""

from importlib import import_module

__version__ = "0.1.0"

_HOMES = {
    "generate": "atskv.runtime.fast.loop",
    "SparseSession": "atskv.runtime.reference.sparse",
    "SparsityConfig": "atskv.runtime.reference.sparse",
    "sparse": "atskv.runtime.reference.sparse",
    "TieredSession": "atskv.runtime.reference.tiered",
    "TieringConfig": "atskv.runtime.reference.tiered",
    "tiered": "atskv.runtime.reference.tiered",
    "HostRetrieval": "atskv.runtime.fast.host_pages",
    "SparseKVCache": "atskv.slot_cache",
    "kv_bytes": "atskv.slot_cache",
    "SELECTORS": "atskv.selectors",
    "make_selector": "atskv.selectors",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'atskv' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
