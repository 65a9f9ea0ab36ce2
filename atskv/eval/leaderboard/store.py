"""A leaderboard folder's record, what makes the grid resumable: `cells.jsonl`, one finished
cell a line, appended as it finishes, and `settings.json`, what every cell there was made with
(a rerun with other settings is refused)."""

from __future__ import annotations

from pathlib import Path

from atskv.eval.leaderboard.grid import Cell
from atskv.eval.rows import RowStore


class CellStore(RowStore[Cell]):
    """`cells.jsonl` (one finished cell per line, appended as it finishes) and `settings.json`."""

    def __init__(self, out: Path, settings: dict):
        super().__init__(out, settings, "cells.jsonl", key=lambda cell: cell.key, from_json=_cell_from_json)

    @property
    def cells(self) -> dict[tuple, Cell]:
        return self.rows


def _cell_from_json(item: dict) -> Cell:
    return Cell(**{**item, **{k: tuple(item[k]) for k in ("scores", "prompt_tokens", "texts")}})
