"""The attention geometry of a base model: the shapes every atskv component is sized by.

Selectors, caches and predictors depend only on these numbers, not on the model class, and an
exported predictor records them so that loading it against a different base model fails early.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelGeometry:
    """Layer and head shapes of a decoder; `layer_types[i]` is how layer i attends."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend over the whole context: the ones atskv manages."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    def describe(self) -> str:
        return (
            f"{self.model_type}, {self.num_layers} layers, {self.num_heads} query / {self.num_kv_heads} KV heads, "
            f"head dim {self.head_dim}, hidden size {self.hidden_size}"
        )

    def require_same(self, model_or_config, made_for: str, remedy: str) -> None:
        """Refuse a model (or config) whose geometry is not this one, which something (a profile,
        a predictor) `made_for` a model was measured on; `remedy` says what to do instead."""
        config = getattr(model_or_config, "config", model_or_config)
        geometry = model_geometry(config)
        if geometry != self:
            raise ValueError(f"{made_for} ({self.describe()}), but the model is {geometry.describe()}; {remedy}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (layer_types as a list), for checkpoint headers."""
        return {**asdict(self), "layer_types": list(self.layer_types)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelGeometry:
        """Inverse of `to_dict`; unknown or missing keys raise, so a bad header is not half-read."""
        return cls(**{**data, "layer_types": tuple(data["layer_types"])})


def model_geometry(config: PretrainedConfig) -> ModelGeometry:
    """Geometry of the decoder described by `config`.

    Composite configs (Gemma 3 with vision) contribute their text decoder. Configs without
    `layer_types` attend the same way in every layer: sliding if they set a `sliding_window`
    (Mistral v0.1 does), else full. `sliding_window` is None when no layer slides, so two
    geometries compare equal exactly when the models attend alike.
    """
    text = config.get_text_config(decoder=True)
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers
    layer_types = tuple(layer_types)
    return ModelGeometry(
        model_type=text.model_type,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        hidden_size=text.hidden_size,
        layer_types=layer_types,
        sliding_window=window if SLIDING_ATTENTION in layer_types else None,
    )


def attention_modules(model) -> list:
    """The attention modules of `model` (each with its `layer_idx`), in module order: where the
    hook routes attention and where forward hooks observe a layer's attention input and output."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
    if not modules:
        raise ValueError(f"{type(model).__name__}: found no attention modules with a layer_idx to manage")
    return modules


def decoder_layers(model) -> list:
    """The modules that hold an attention module as a direct child (a model's decoder layers), in
    module order: the units `atskv.generate(compile=True)` compiles around atskv's attention."""
    attention = {id(m) for m in attention_modules(model)}
    return [m for m in model.modules() if any(id(child) in attention for child in m.children())]
