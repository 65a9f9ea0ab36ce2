"""The Hugging Face hook: what runs inside a model's attention under `atskv.sparse` / `atskv.tiered`.

`sparse` (the attention-interface registration and the sparse session), `tiered` (the two-tier
session), `gqa` (grouped-query attention on un-expanded KV), `decode` (the static, graph-captured
decode step). Kept free of imports so that low layers (kernels, selectors) can use `gqa`.
"""
