"""The long-context leaderboard, after kvpress's RULER table: for one model, every method (dense,
atskv's selectors, kvpress's presses) at every compression ratio on the same synthetic task
prompts, at several context lengths, over several seeds.

A compression ratio r removes that fraction of the KV: atskv runs at budget 1 - r (a fraction of
the context), kvpress at `compression_ratio` r, through the peer check's venv and script
(`atskv.eval.peer`). A `tiered:<selector>` row runs the selector in the two-tier store
(`atskv.tiered`): the GPU tier holds the budget, as an evicting selector would, but the rest is
parked in host memory and retrieved when a query needs it, so it frees the same GPU memory
without losing what it parks. A `host:<selector>` row is the fast path's own two-tier decode
(`atskv.HostRetrieval`): the evicting selector's budget on the GPU, every token in pinned host
memory, and each step reads back the pages of parked tokens the query rates highest (the GPU also
keeps page bounds and a page cache). Seed s of a (task, context) is `examples` prompts built from seeds
1000 s + i, needles at depths spread evenly over (0, 1); the score of a cell is their mean exact
score, a seed's score the mean over tasks, and the table gives mean ± std over seeds.

The grid is long on a GPU, so it is resumable: each finished cell is appended to `cells.jsonl` in
the output folder at once, and a rerun into that folder computes only the missing cells (the
grid may grow: more seeds, ratios, methods). The settings that change a cell's score beyond its
grid coordinates (model, examples, filler, dense layers, prefill, new tokens) are kept in
`settings.json`, and a rerun with other settings is refused.
"""


from atskv.eval.leaderboard.grid import KVPRESS_DENSE, RUNTIMES, Cell, Grid, build_examples, check_grid, check_tiering
from atskv.eval.leaderboard.merge import VARIANT_SETTINGS, merge_folders
from atskv.eval.leaderboard.report import Summary, describe, markdown, near_dense, plot, summarize, write
from atskv.eval.leaderboard.runs import kvpress_unavailable, run_leaderboard
from atskv.eval.leaderboard.store import CellStore

__all__ = [
    "KVPRESS_DENSE", "RUNTIMES", "VARIANT_SETTINGS", "Cell", "CellStore", "Grid", "Summary", "build_examples",
    "check_grid", "check_tiering", "describe", "kvpress_unavailable", "markdown", "merge_folders", "near_dense",
    "plot", "run_leaderboard", "summarize", "write",
]  # fmt: skip
