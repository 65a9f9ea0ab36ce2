"""Base models: loading (named GGUF models, GGUF files, Hugging Face directories), geometry and identity."""

from atskv.models.geometry import ModelGeometry, attention_modules, model_geometry
from atskv.models.identity import config_hash, model_name
from atskv.models.loading import (
    DEFAULT_MODEL,
    MODELS,
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    NamedModel,
    load_model,
    resolve_device,
)

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "ModelGeometry",
    "NamedModel",
    "attention_modules",
    "config_hash",
    "load_model",
    "model_geometry",
    "model_name",
    "resolve_device",
]
