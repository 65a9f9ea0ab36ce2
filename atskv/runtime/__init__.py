"""atskv's runtimes over one selector protocol: the vLLM plugin (`atskv.runtime.vllm`)."""
