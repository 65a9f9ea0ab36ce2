"""The fast path, `atskv.generate` (`loop`): `session` (`StaticSession`, the selection over a
static cache), `static_cache` (that cache, sized once), `graph` (CUDA-graph capture of a decode
step), `compiled` (`torch.compile`d decoder layers), `host_pages` and `key_summary` (its host
tier, `HostRetrieval`)."""
