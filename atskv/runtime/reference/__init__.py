"""The reference runtime: `atskv.sparse` (`sparse`: the attention registration and `SparseSession`)
and `atskv.tiered` (`tiered`: `TieredSession`), with the tiered store's parts (`tiered_cache`,
`host_tier`, `retrieval`, `sparsity`)."""
