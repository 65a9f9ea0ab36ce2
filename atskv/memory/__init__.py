"""The cache layers a selector reads: `slot_cache` (the reference runtime's growing `SlotLayer`,
`SparseKVCache`) and `static_cache` (the fast path's `StaticSlotLayer`, `StaticKVCache`)."""
