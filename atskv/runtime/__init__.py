"""atskv's runtimes, side by side over one selector protocol (`atskv.selectors.base.Selector`):

- `reference` (`atskv.sparse`, `atskv.tiered`): the Hugging Face hook, an attention function
  registered in transformers that asks the selector at every call; caches that grow and compact,
  and the tiered store (host tier, retrieval, sparsity manager). Clear and general: every
  selector runs here, and the other runtimes are tested against it.
- `fast` (`atskv.generate`): the same selection over a static cache sized once, a chunked
  prefill, and decode steps with fixed shapes captured in CUDA graphs (session, graph capture,
  compile, the generate loop, the host pages of its host tier: one module each).
- `vllm`: the vLLM plugin, the selection inside vLLM's paged attention.
"""
