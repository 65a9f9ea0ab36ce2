"""The one report writer of the evaluations (atskv.eval.report)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from atskv.eval.report import as_json, write_report


@dataclass
class Row:
    name: str
    values: tuple[int, ...]


def test_a_report_is_a_table_with_notes_its_json_and_its_figure(tmp_path):
    drawn = []
    paths = write_report(
        tmp_path / "out", "| a |\n|---|", {"settings": {"k": 1}, "rows": [Row("x", (1, 2))]},
        json_name="r.json", markdown_name="r.md", notes="what the numbers mean",
        plot=lambda path: drawn.append(path) or path.write_bytes(b"png"), png_name="r.png",
    )  # fmt: skip
    assert paths == {"markdown": tmp_path / "out" / "r.md", "json": tmp_path / "out" / "r.json",
                     "png": tmp_path / "out" / "r.png"}
    assert paths["markdown"].read_text() == "| a |\n|---|\n\nwhat the numbers mean\n"
    assert json.loads(paths["json"].read_text()) == {"settings": {"k": 1}, "rows": [{"name": "x", "values": [1, 2]}]}
    assert drawn == [paths["png"]]


def test_without_notes_or_figure_the_table_ends_the_file(tmp_path):
    paths = write_report(tmp_path, "| a |", [Row("y", ())], json_name="rows.json")
    assert (tmp_path / "table.md").read_text() == "| a |\n" and set(paths) == {"markdown", "json"}
    assert as_json([Row("y", ())]) == json.dumps([{"name": "y", "values": []}], indent=1)
    with pytest.raises(ValueError, match="png_name"):
        write_report(tmp_path, "| a |", [], json_name="rows.json", plot=lambda path: None)
    with pytest.raises(TypeError, match="not JSON serialisable"):
        as_json({"x": object()})
