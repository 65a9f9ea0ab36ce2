"""One report from leaderboard folders computed in parallel, and from variant folders run with
other selector options or tiers on the same prompts (their rows join as `METHOD (label)`),
computing nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from atskv.data import TASKS
from atskv.errors import InputError
from atskv.eval.leaderboard.grid import KVPRESS_DENSE, VLLM_DENSE, Grid
from atskv.eval.leaderboard.report import describe, write
from atskv.eval.leaderboard.store import CellStore
from atskv.eval.method import DENSE, KVPRESS, Method

VARIANT_SETTINGS = ("selector_options", "tiering", "host_tier", "engine_host_tier")  # what a variant folder may change


def _join_variant(label: str, known: Mapping, new: Mapping, ran: set[str]) -> dict:
    """A label a merged source already has may gain rows from a later run (some of its selectors at
    a new context, say). Each selector the run has rows of (`ran`) must have run with the label's
    options for it (none where the label has none) or be new to the label, whose options then join
    it; other settings must be the label's. A mismatch is refused: one label keeps one setting."""
    if not known:
        return dict(new)
    keys = (set(known) | set(new)) - {"selector_options"}
    clashes = [key for key in sorted(keys) if known.get(key) != new.get(key)]
    ours, theirs = dict(known.get("selector_options", {})), new.get("selector_options", {})
    for selector in sorted(ran):
        if selector in ours and ours[selector] != theirs.get(selector):
            clashes.append(f"selector_options of {selector}")
        elif selector in theirs:
            ours[selector] = theirs[selector]
    if clashes:
        raise InputError(
            f"variant {label!r}: the run differs from what the merged source records under it in {', '.join(clashes)}"
        )
    return {**known, **({"selector_options": ours} if ours else {})}


def _joins_as_variant(method: str) -> bool:
    """A variant folder's atskv rows join the merge; its dense and kvpress cells are the sources', and
    rows that already carry a label keep it out (a row has one label)."""
    parsed = Method.parse(method)
    return method != DENSE and parsed.runtime != KVPRESS and not parsed.variant


def merge_folders(
    out: str | Path, sources: Sequence[str | Path], variants: Mapping[str, str | Path] | None = None
) -> dict[str, Path]:
    """Gather the cells of folders computed in parallel (one process per context and task, say)
    into `out` and write its report from them, computing nothing. The sources must share their
    settings; a cell in several is taken once. The grid is what the cells cover, and a row
    averages over the seeds that have all its tasks (rows may rest on different seeds: the JSON
    lists them). `variants`: label -> a folder run with other `selector_options`, `tiering`,
    `host_tier` or `engine_host_tier` (nothing else may differ): its atskv rows join as "METHOD
    (label)", so one table and plot show a selector under two settings on the same prompts; its
    dense and kvpress cells are left out (the sources hold those)."""
    sources = [Path(s) for s in sources]
    variants = {label: Path(folder) for label, folder in (variants or {}).items()}
    if not sources:
        raise InputError("merge_folders needs at least one source folder")
    if missing := [str(s) for s in [*sources, *variants.values()] if not (s / "settings.json").is_file()]:
        raise InputError(f"not a leaderboard folder (no settings.json; merge its workers first): {', '.join(missing)}")
    settings = json.loads((sources[0] / "settings.json").read_text())
    own = {k: v for k, v in settings.items() if k != "variants"}  # a merged source's record, not its cells' setting
    base = {k: v for k, v in own.items() if k not in VARIANT_SETTINGS}
    varied, variant_stores = {}, {}
    for label, folder in variants.items():
        theirs = json.loads((folder / "settings.json").read_text())
        varied[label] = {k: theirs[k] for k in VARIANT_SETTINGS if k in theirs}
        variant_stores[label] = CellStore(folder, {**base, **varied[label]})  # refuses any other change
    known = settings.get("variants", {})  # a merged source's labels stay
    for label, ours in varied.items():
        ran = {Method.parse(c.method).name for c in variant_stores[label].cells.values() if _joins_as_variant(c.method)}
        varied[label] = _join_variant(label, known.get(label, {}), ours, ran)
    varied = {**known, **varied}
    merged = {**settings, **({"variants": varied} if varied else {})}
    store = CellStore(Path(out), merged)
    for source in sources:
        for key, cell in CellStore(source, own).cells.items():  # refuses other settings
            if key not in store:
                store.add(cell)
    for label, variant in variant_stores.items():
        for cell in variant.cells.values():
            if _joins_as_variant(cell.method):
                labelled = replace(Method.parse(cell.method), variant=label)
                if (renamed := replace(cell, method=str(labelled))).key not in store:
                    store.add(renamed)
    cells = list(store.cells.values())
    methods = [m for m in dict.fromkeys(c.method for c in cells) if m not in (DENSE, KVPRESS_DENSE, VLLM_DENSE)]
    tasks = {c.task for c in cells}
    grid = Grid(
        tuple(sorted({c.context for c in cells})), tuple(sorted({c.ratio for c in cells if c.ratio is not None})),
        tuple(sorted(methods, key=lambda m: Method.parse(m).runtime == KVPRESS)), tuple(t for t in TASKS if t in tasks),
        tuple(sorted({c.seed for c in cells})),
    )  # fmt: skip
    notes = describe(settings, grid, None)
    for label, options in varied.items():
        notes += f" METHOD ({label}): the same prompts, run with {json.dumps(options)}."
    return write(cells, store.out, grid, settings["model"], notes, merged)
