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


def test_the_recall_plot_draws_the_oracle_once_and_counts_windows_in_words(tmp_path, monkeypatch):
    """With the oracle selector measured, the per-query ceiling (the same curve) is not drawn a
    second time; one window is "1 window"."""
    from atskv.eval import recall
    from atskv.eval.recall import ORACLE_CEILING, WINDOW_CEILING, RecallRecord, RecallReport

    drawn = []
    monkeypatch.setattr(recall, "save_figure", lambda fig, path: drawn.append(fig))
    records = [RecallRecord(name, b, 2, 0.5, None, 1, None) for name in ("oracle", "snapkv", ORACLE_CEILING,
               WINDOW_CEILING) for b in (8, 16)]  # fmt: skip
    RecallReport("tiny", 64, 4, 1, 2, records).plot(tmp_path / "r.png")
    (fig,) = drawn
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["oracle", "snapkv", WINDOW_CEILING]
    assert fig._suptitle.get_text() == "tiny: 1 window of 64 tokens, last 4 queries"


def test_the_task_plot_keeps_equal_scores_apart_and_says_over_how_many_prompts(tmp_path, monkeypatch):
    """Two selectors with the same score at one budget (the demo's pass key) are both visible: other
    markers, a little apart; the title says the mean is over 2 prompts."""
    from matplotlib.figure import Figure

    from atskv.eval.tasks import TaskResult, plot

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    results = [TaskResult("passkey", 64, 0.5, seed, selector, budget, 1.0, "", ("1",), 60, 0)
               for seed in (0, 1) for selector, budget in ((None, None), ("learned", 16), ("snapkv", 16))]  # fmt: skip
    plot(results, tmp_path / "t.png")
    (ax,) = drawn[0].axes
    learned, snapkv = [line for line in ax.get_lines() if line.get_label() in ("learned", "snapkv")]
    assert learned.get_xdata()[0] != snapkv.get_xdata()[0] and learned.get_marker() != snapkv.get_marker()
    assert ax.get_title() == "passkey (mean over 2 prompts)"
