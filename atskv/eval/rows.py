"""A folder that keeps a long measurement's finished rows, so that a run stopped at a time limit
loses only the row it was on and a rerun into the same folder goes on from there.

`settings.json` records what every row shares (model, budget, ...): a rerun with other settings
is refused rather than mixed in. Each finished row is one JSON line appended to the rows file the
moment it finishes; a line cut short by a kill is not a row and is measured again. The
leaderboard's cells (`atskv eval leaderboard`) and `atskv bench decode`'s records are kept so;
the vLLM benchmarks, whose rows engines in other processes append, read theirs by `json_lines`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import asdict
from pathlib import Path
from typing import Generic, TypeVar

from atskv.errors import InputError

Row = TypeVar("Row")


def json_lines(path: Path) -> list[dict]:
    """The whole JSON lines of a rows file (none if it is missing); a line cut short by a kill is
    not a row and is left out."""
    found = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


class RowStore(Generic[Row]):
    """The rows of `out/<name>` by their `key`, read back through `from_json` (a dataclass's fields
    as `asdict` writes them); `settings` are checked against `out/settings.json`, or written there."""

    def __init__(self, out: Path, settings: dict, name: str, key: Callable[[Row], Hashable],
                 from_json: Callable[[dict], Row]):  # fmt: skip
        self.out, self.path, self.key = Path(out), Path(out) / name, key
        self.out.mkdir(parents=True, exist_ok=True)
        settings_path = self.out / "settings.json"
        if settings_path.is_file():
            before = json.loads(settings_path.read_text())
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            if changed:
                raise InputError(
                    f"{self.out} holds rows made with other settings "
                    f"({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in changed.items())}); "
                    "choose another --out or the same settings"
                )
        else:
            settings_path.write_text(json.dumps(settings, indent=1))
        self.rows: dict[Hashable, Row] = {}
        for found in json_lines(self.path):
            try:
                row = from_json(found)
            except TypeError:  # not a row of this store's kind
                continue
            self.rows[key(row)] = row

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rows

    def add(self, row: Row) -> None:
        """Keep `row`: on disk (flushed) before this returns."""
        self.rows[self.key(row)] = row
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
