"""Dense: keeps every token. The reference every other selector is measured against."""

from dataclasses import dataclass

from atskv.selectors.base import Selector


@dataclass
class DenseSelector(Selector):
    name = "dense"
    fast_path = True
    keeps_all = True
