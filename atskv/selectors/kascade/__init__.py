"""Kascade: the selector (selector.py) and the per-model profile it reads (profile.py).

The profile is measured by running the model, which needs the hook; the hook imports the
selector registry, so `compute_kascade_profile` takes the hook's `sparse` as an argument
(`atskv profile kascade` passes `atskv.sparse`) instead of importing it.
"""

from atskv.selectors.kascade.profile import (
    HOW_TO_COMPUTE,
    KascadeProfile,
    choose_anchors,
    compute_kascade_profile,
    default_profile_path,
    head_similarity,
)
from atskv.selectors.kascade.selector import KascadeSelector

__all__ = [
    "HOW_TO_COMPUTE",
    "KascadeProfile",
    "KascadeSelector",
    "choose_anchors",
    "compute_kascade_profile",
    "default_profile_path",
    "head_similarity",
]
