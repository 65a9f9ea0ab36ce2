"""`slot_cache`: the cache layer a selector reads (`SlotLayer`: slots, positions, per-slot state),
and the reference runtime's growing cache of them (`SparseKVCache`, `kv_bytes`). The fast path's
static layer (`atskv.runtime.fast.static_cache`) is a `SlotLayer` too."""
