"""Triton GPU kernels, each beside a plain-torch reference of the same function; they import nothing of
atskv but `atskv.attention` and `atskv.features` (and no transformers), so a vLLM worker can load them."""
