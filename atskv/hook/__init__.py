"""The Hugging Face hook: what runs inside a model's attention under `atskv.sparse` / `atskv.tiered`.

`sparse` (the attention-interface registration and the sparse session), `tiered` (the two-tier
session), `decode` (the static, graph-captured decode step).
"""
