"""atskv: learned KV-cache relevance prediction and tiered KV memory for long-context LLMs."""

__version__ = "0.1.0"
