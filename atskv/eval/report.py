"""The one report writer of the evaluations: a markdown table (with notes under it), the JSON of
the records and the settings, and a figure, side by side in one folder.

Every evaluation (`recall`, `tasks`, `perplexity`, `peer`, the RL held-out comparison) builds its
own table, payload and figure and hands them here; the files come out the same way for all.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path


def as_json(data) -> str:
    """`data` as indented JSON; dataclasses (also inside lists and dicts) become dicts."""

    def plain(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        raise TypeError(f"{type(value).__name__} is not JSON serialisable")

    return json.dumps(data, indent=1, default=plain)


def write_report(
    out: str | Path,
    table: str,
    data,
    *,
    json_name: str,
    markdown_name: str = "table.md",
    notes: str = "",
    plot: Callable[[Path], object] | None = None,
    png_name: str | None = None,
) -> dict[str, Path]:
    """Write under `out` (created): `markdown_name` (the table, then `notes` after a blank line),
    `json_name` (`data`, see `as_json`) and, given `plot` (a function drawing into the path it is
    given), `png_name`. Returns the paths by kind: "markdown", "json", "png"."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / markdown_name, "json": out / json_name}
    paths["markdown"].write_text(table + (f"\n\n{notes}" if notes else "") + "\n")
    paths["json"].write_text(as_json(data))
    if plot is not None:
        if not png_name:
            raise ValueError("a report with a figure needs png_name")
        paths["png"] = out / png_name
        plot(paths["png"])
    return paths
