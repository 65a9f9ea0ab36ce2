"""A trained predictor as one file a user can ship: `predictor.safetensors` holds the scorer's
weights and the base model's token-type table, and its metadata holds a JSON header naming the
base model (architecture, layer count, head counts, head dim, hidden size: its `ModelGeometry`),
the managed layers the predictor scores, the feature spec, the scorer's kind (`SCORERS`: the MLP,
or the ridge scorer; files without one are MLPs) and constructor arguments, and the hash of
the base model's config (`atskv.models.identity`). The same header is written beside it as
`predictor.json` for people; loading reads the one inside the weights file, so the two can never
disagree about what is loaded. Loading against another base model fails naming both models and
their config hashes (predictors exported before the hash was recorded: both geometries). A
missing, truncated or corrupt file is an `InputError` naming it, never a reader's traceback.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from atskv.errors import InputError
from atskv.models.geometry import ModelGeometry, model_geometry
from atskv.models.identity import config_hash, model_name
from atskv.paths import default_cache_dir, readable_as_umask_allows
from atskv.predictor.checkpoints import read_checkpoint
from atskv.predictor.model import FeatureSpec, RelevanceMLP, RelevanceScorer
from atskv.predictor.ridge import RidgeScorer

FORMAT = 1
SCORERS: dict[str, type[RelevanceScorer]] = {cls.kind: cls for cls in (RelevanceMLP, RidgeScorer)}
_HEADER_KEY = "atskv_predictor"
_TOKEN_TYPES = "token_types"


@dataclass(frozen=True)
class PredictorHeader:
    """What a predictor file says about itself."""

    base_model: str
    geometry: ModelGeometry
    managed_layers: tuple[int, ...]
    feature_spec: FeatureSpec
    widths: dict  # the scorer's constructor arguments besides the spec (`RelevanceScorer.arguments`)
    training: dict = field(default_factory=dict)  # free-form provenance (data, seed, metrics)
    config_hash: str | None = None  # `atskv.models.config_hash` of the base model; None in older exports
    kind: str = RelevanceMLP.kind  # which of `SCORERS`; older exports are MLPs

    def to_json(self) -> str:
        identity = {} if self.config_hash is None else {"config_hash": self.config_hash}
        return json.dumps(
            {
                "format": FORMAT,
                "kind": self.kind,
                "base_model": self.base_model,
                **identity,
                "geometry": self.geometry.to_dict(),
                "managed_layers": list(self.managed_layers),
                "feature_spec": self.feature_spec.to_dict(),
                "widths": self.widths,
                "training": self.training,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> PredictorHeader:
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not an atskv predictor header of format {FORMAT}")
        return cls(
            base_model=data["base_model"],
            geometry=ModelGeometry.from_dict(data["geometry"]),
            managed_layers=tuple(data["managed_layers"]),
            feature_spec=FeatureSpec.from_dict(data["feature_spec"]),
            widths=data["widths"],
            training=data.get("training", {}),
            config_hash=data.get("config_hash"),
            kind=data.get("kind", RelevanceMLP.kind),
        )

    def check_model(self, model) -> None:
        """Refuse a base model other than the one the predictor was trained for: by config hash,
        or for an export without one, by geometry (equal shapes pass)."""
        if self.config_hash is None:
            try:
                self.geometry.require_same(
                    model, f"this predictor was trained for {self.base_model!r}", "export one for this model"
                )
            except ValueError as error:
                raise InputError(str(error)) from None
            return
        theirs = config_hash(model)
        if theirs != self.config_hash:
            name = model_name(model) or "this model"
            raise InputError(
                f"predictor for {self.base_model!r} (config {self.config_hash}) cannot run on {name!r} "
                f"(config {theirs}); export one for this model"
            )


@dataclass
class LoadedPredictor:
    mlp: RelevanceScorer  # in eval mode: the MLP, or another kind of `SCORERS`
    header: PredictorHeader
    token_types: torch.Tensor  # [vocab] int8: type of every input id of the base model


SHIPPED = Path(__file__).resolve().parent / "shipped"  # predictors that come with atskv


def default_predictor_dir(model_name: str) -> Path:
    """Where `atskv export` puts a model's predictor by default."""
    return default_cache_dir() / "predictors" / model_name


def find_predictor(model_name: str) -> Path:
    """The predictor the CLI uses for a model: the user's own export if there is one, else the
    one shipped with atskv (for the named models SmolLM2-135M and Gemma 3 270M), else the export
    folder (whose absence `load_predictor` then reports with how to make one)."""
    own = default_predictor_dir(model_name)
    if (own / "predictor.safetensors").is_file():
        return own
    shipped = SHIPPED / model_name
    return shipped if (shipped / "predictor.safetensors").is_file() else own


def predictor_path(source: str | Path) -> Path:
    """A predictor file or folder as given, or for a source that is no path, a model name's
    predictor (`find_predictor`)."""
    path = Path(source).expanduser()
    return path if path.exists() else find_predictor(str(source))


def checkpoint_provenance(checkpoint: str | Path) -> dict:
    """What a training checkpoint says about how its predictor was made, for a header's `training`:
    the checkpoint, the stage (`fit`, or `finetune` when it holds a policy), the optimiser steps,
    the model's and the data's hyper-parameters as the run saved them (read from the file, not
    from the class that loads the weights, whose defaults would stand in for a fine-tuning run's
    alpha, policy and samples), and for fine-tuning the predictor it started from with that
    predictor's own provenance."""
    state = read_checkpoint(checkpoint)

    def own(hparams: dict) -> dict:  # without the CLI's bookkeeping (`_instantiator`)
        return {k: v for k, v in hparams.items() if not k.startswith("_")}

    saved = own(state["hyper_parameters"])
    saved.pop("collection", None)  # the header holds it in its own fields
    started_from = saved.pop("started_from", None)
    provenance = {
        "checkpoint": str(checkpoint), "stage": "finetune" if "policy" in saved else "fit",
        "steps": state.get("global_step"), "hyperparameters": saved,
        "data": own(state.get("datamodule_hyper_parameters", {})),
    }
    if started_from is not None:
        provenance["started_from"] = started_from
    return provenance


def export_predictor(
    scorer: RelevanceScorer,
    token_types: torch.Tensor,
    folder: str | Path,
    *,
    base_model: str,
    geometry: ModelGeometry,
    managed_layers: tuple[int, ...] | list[int],
    training: dict | None = None,
    config=None,
    overwrite: bool = False,
) -> Path:
    """Write `predictor.safetensors` and `predictor.json` under `folder`; returns the weights path.

    `config`: the base model (or its config), whose `config_hash` the header records so that only
    that model loads the predictor (without it, only shapes are checked). A folder of the
    predictors shipped with atskv is refused unless `overwrite`. The weights are written to a
    temporary file and renamed, so an interrupted export leaves no truncated predictor behind."""
    folder = Path(folder).expanduser()
    if _is_within(folder, SHIPPED) and not overwrite:
        raise InputError(
            f"{folder} holds the predictors shipped with atskv; export elsewhere (default "
            f"{default_predictor_dir(base_model)}) or pass overwrite=True to replace a shipped one"
        )
    if config is not None and model_geometry(getattr(config, "config", config)) != geometry:
        raise InputError(f"the config given for {base_model!r} is not the model the predictor was trained on")
    spec = scorer.spec
    if len(managed_layers) != spec.num_layers:
        raise ValueError(f"{len(managed_layers)} managed layers given, the predictor scores {spec.num_layers}")
    if geometry.num_kv_heads != spec.num_kv_heads:
        raise ValueError(f"the model has {geometry.num_kv_heads} KV heads, the predictor {spec.num_kv_heads}")
    header = PredictorHeader(
        base_model, geometry, tuple(managed_layers), spec, scorer.arguments(), dict(training or {}),
        config_hash(config) if config is not None else None, scorer.kind,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in scorer.state_dict().items()}
    tensors[_TOKEN_TYPES] = token_types.detach().cpu().to(torch.int8).contiguous()
    path = folder / "predictor.safetensors"
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={_HEADER_KEY: header.to_json()})
    readable_as_umask_allows(partial)
    os.replace(partial, path)
    (folder / "predictor.json").write_text(header.to_json() + "\n")
    return path


def export_checkpoint(checkpoint: str | Path, folder: str | Path | None = None, loaded=None, *,
                      overwrite: bool = False) -> Path:
    """Export the predictor of a training checkpoint (`atskv fit` or `atskv finetune`) into
    `folder` (default: `default_predictor_dir` of its base model); returns the weights path.

    `loaded`: the base model as `load_model` returns it (its tokenizer gives the token-type table,
    its config the hash the header records); default: the model the training data came from.
    Its geometry must match the collection's."""
    from atskv.predictor.checkpoints import load_module
    from atskv.predictor.training import RelevanceModule

    module = load_module(RelevanceModule, checkpoint)
    return export_trained(
        module.model.eval(), module.hparams.collection, folder, loaded, checkpoint_provenance(checkpoint),
        overwrite=overwrite,
    )


def export_trained(scorer: RelevanceScorer, collection: dict, folder: str | Path | None = None, loaded=None,
                   training: dict | None = None, *, overwrite: bool = False) -> Path:
    """Export a scorer trained on a collection (manifest meta `collection`) into `folder` (default:
    `default_predictor_dir` of its base model); returns the weights path. `loaded`: the base model
    as `load_model` returns it (tokenizer for the token-type table, config for the hash), default
    the collection's; its geometry must match the collection's. `training`: the provenance."""
    from atskv.models import load_model
    from atskv.predictor.token_types import token_type_table

    geometry = ModelGeometry.from_dict(collection["geometry"])
    loaded = loaded or load_model(collection["model"])
    if model_geometry(loaded.model.config) != geometry:
        raise InputError(f"{loaded.name} is not the model the training data came from ({collection['model']})")
    return export_predictor(
        scorer,
        token_type_table(loaded.tokenizer, loaded.model.config.vocab_size),
        folder or default_predictor_dir(collection["model"]),
        base_model=collection["model"],
        geometry=geometry,
        managed_layers=collection["managed_layers"],
        training=training,
        config=loaded.model.config,
        overwrite=overwrite,
    )


def _is_within(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def load_predictor(path: str | Path, model=None, device: str | torch.device = "cpu") -> LoadedPredictor:
    """Read a predictor file (or the folder holding `predictor.safetensors`); with `model`, also
    check that it was trained for that base model."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "predictor.safetensors"
    if not path.is_file():
        raise InputError(f"no predictor at {path}; export one with `atskv export` or give the folder that holds one")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            if _HEADER_KEY not in metadata:
                raise InputError(f"{path} is a safetensors file but not an atskv predictor (no header)")
            header = PredictorHeader.from_json(metadata[_HEADER_KEY])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        token_types = tensors.pop(_TOKEN_TYPES)
        if header.kind not in SCORERS:
            raise InputError(f"{path} holds a predictor of kind {header.kind!r}; this atskv reads {', '.join(SCORERS)}")
        mlp = SCORERS[header.kind](header.feature_spec, **header.widths)
        mlp.load_state_dict(tensors)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        if isinstance(error, InputError):
            raise
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise InputError(f"{path} is not a readable atskv predictor ({reason}); export it again") from None
    if model is not None:
        header.check_model(model)
    return LoadedPredictor(mlp.to(device).eval(), header, token_types.to(device))

