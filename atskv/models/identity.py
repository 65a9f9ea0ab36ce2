"""Which base model something was made for: its name and a hash of the config that decides what it
computes.

Equal shapes do not make equal models (two models with SmolLM2's geometry can differ in vocabulary
or RoPE base), so files made for one model (an exported predictor) record `config_hash` and are
refused by another. The hash covers the architecture, layer and head counts, head dim, hidden
size, vocabulary, layer types, sliding window and RoPE settings; never dtype, paths or other
bookkeeping, so the same model loaded from a GGUF or a directory, in float32 or bfloat16, hashes
the same. Numbers are hashed as floats, so an int written as a float by another transformers
version does not change it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from atskv.models.geometry import model_geometry

NAME_ATTR = "atskv_name"  # set on a model by `load_model`: the name predictors and profiles are filed under


def config_hash(model_or_config) -> str:
    """12 hex digits identifying what the decoder of `model_or_config` computes (see module docstring)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True)
    geometry = model_geometry(config)
    rope = getattr(text, "rope_parameters", None)
    if rope is None:  # configs that predate `rope_parameters`
        rope = {"rope_theta": getattr(text, "rope_theta", None), "rope_scaling": getattr(text, "rope_scaling", None)}
    fields = {**geometry.to_dict(), "vocab_size": text.vocab_size, "rope": rope}
    canonical = json.dumps(_as_floats(fields), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def model_name(model) -> str | None:
    """The name a model was loaded under (`LoadedModel.name`), else the folder it was read from,
    else None (a model built in code)."""
    name = getattr(model, NAME_ATTR, None)
    if name:
        return name
    path = getattr(getattr(model, "config", None), "_name_or_path", "")
    return Path(path).name or None


def _as_floats(value):
    if isinstance(value, dict):
        return {str(k): _as_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_floats(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value
