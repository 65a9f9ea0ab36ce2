"""atskv: learned KV-cache relevance prediction and tiered KV memory for long-context LLMs."""

from atskv.hook.decode import generate
from atskv.hook.sparse import SparseSession, SparsityConfig, sparse
from atskv.hook.tiered import TieredSession, TieringConfig, tiered
from atskv.memory.host_pages import HostRetrieval
from atskv.memory.slot_cache import SparseKVCache, kv_bytes
from atskv.selectors import SELECTORS, make_selector

__version__ = "0.1.0"
__all__ = [
    "SELECTORS", "HostRetrieval", "SparseKVCache", "generate", "SparseSession", "SparsityConfig", "TieredSession",
    "TieringConfig", "kv_bytes", "make_selector", "sparse", "tiered",
]
