"""Reading training checkpoints (`atskv fit`, `atskv finetune`) as a user hands them over: a wrong
path or a truncated or corrupt file is an `InputError` naming the file, not an unpickler's
traceback (a truncated zip, a `KeyError` deep in `torch.load`)."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from atskv.errors import InputError

# what torch.load and Lightning raise on a file that is not a whole checkpoint
_UNREADABLE = (RuntimeError, KeyError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError,
               AttributeError, IndexError, TypeError)


def checked_path(checkpoint: str | Path) -> Path:
    """`checkpoint` as a path to an existing file, else an `InputError` naming it."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        found = sorted(path.rglob("*.ckpt"))
        hint = f" (it holds {found[0]}" + (f" and {len(found) - 1} more)" if len(found) > 1 else ")") if found else ""
        raise InputError(f"{path} is a folder, not a checkpoint; give a .ckpt file{hint}")
    if not path.is_file():
        raise InputError(f"{path}: no such checkpoint; `atskv fit` and `atskv finetune` write them under runs/")
    return path


def read_checkpoint(checkpoint: str | Path) -> dict:
    """The raw checkpoint dictionary (hyper-parameters, state dicts, step), on the CPU."""
    path = checked_path(checkpoint)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except _UNREADABLE as error:
        raise _unreadable(path, error) from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise InputError(f"{path} is not a training checkpoint (no state_dict); give a .ckpt written by `atskv fit`")
    return state


def load_module(cls, checkpoint: str | Path):
    """`cls.load_from_checkpoint(checkpoint)` on the CPU (a LightningModule class), with the errors
    of a missing or corrupt file as `InputError`s."""
    path = checked_path(checkpoint)
    try:
        return cls.load_from_checkpoint(path, map_location="cpu")
    except _UNREADABLE as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> InputError:
    reason = (str(error).splitlines() or [""])[0] or type(error).__name__
    if "weights_only" in reason:  # torch's advice to unpickle anything: the file is not a checkpoint
        reason = "not a checkpoint torch can read"
    return InputError(f"{path} is not a readable checkpoint ({type(error).__name__}: {reason}); it may be truncated")
