"""Computing a leaderboard's missing cells into its folder: atskv's rows through `generate_batch`
(the fast path, the hook, the two-tier store or the host tier, as the row's runtime says),
kvpress's presses through the peer check's venv, one process a press, and the vLLM rows (vanilla
vLLM and vLLM with atskv's plugin) through `atskv.eval.vllm_generate`, one engine a row and ratio
over every prompt of the grid."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from atskv.data import filler_text
from atskv.data.prompts import encode_prompt
from atskv.errors import InputError
from atskv.eval import peer
from atskv.eval.generation import Runtime, cut_at_eos, eos_ids, generate_batch, pad_left
from atskv.eval.leaderboard.grid import KVPRESS_DENSE, VLLM_DENSE, Cell, Grid, build_examples, check_tiering
from atskv.eval.leaderboard.report import describe, write
from atskv.eval.leaderboard.store import CellStore
from atskv.eval.method import DENSE, HOOK, HOST, KVPRESS, OWN, TIERED, Method
from atskv.eval.tasks import answer_room


def kvpress_unavailable(python: Path, loaded) -> str | None:
    """Why kvpress cannot run here (no venv, not a Hugging Face model directory), or None."""
    try:
        peer.check_kvpress(python)
    except peer.KvpressNotInstalled as missing:
        return str(missing)
    if not (Path(loaded.model.name_or_path) / "config.json").is_file():
        return f"kvpress needs a Hugging Face model directory; {loaded.name!r} loaded from {loaded.model.name_or_path}"
    return None


def _atskv_cell(loaded, examples, key, selector, budget, dense_layers, new_tokens, batch_size, runtime: Runtime):
    """Greedy runs of `examples` in left-padded batches on `runtime`, as one cell."""
    tokenizer, runs = loaded.tokenizer, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        ids, mask = pad_left(tokenizer, [encode_prompt(tokenizer, ex.prompt, chat=False)[0] for ex in batch])
        runs += generate_batch(
            loaded.model, tokenizer, ids, mask, selector=selector, budget=budget, dense_layers=dense_layers,
            max_new_tokens=new_tokens, examples=batch, runtime=runtime,
        )  # fmt: skip
    context, task, seed, method, ratio = key
    prefill = "sparse" if runtime.sparse_prefill and selector is not None else "dense"
    return Cell(
        context, task, seed, method, ratio, budget, None if selector is None else dense_layers, prefill, new_tokens,
        sum(r.score for r in runs) / len(runs), tuple(r.score for r in runs), tuple(r.prompt_tokens for r in runs),
        tuple(r.text for r in runs),
    )  # fmt: skip


def _runtime(method: str, grid: Grid, fast: bool, sparse_prefill: bool, tiering, host) -> Runtime:
    """The runtime of a row: its method's (`tiered:`, `host:`), else the leaderboard's (`--fast`)."""
    if method in grid.tiered:
        return Runtime(TIERED, sparse_prefill, tiering or {})
    if method in grid.hosted:
        return Runtime(HOST, host=host)
    return Runtime(OWN) if fast else Runtime(HOOK, sparse_prefill)


def _kvpress_cells(loaded, python, folder, examples, group, press, ratios, new_tokens, device, dtype) -> list[Cell]:
    """kvpress's `press` (`none`: its full-KV run) at `ratios` on `examples` through
    `peer.run_kvpress`, scored like atskv's runs; `group` is (context, task, seed)."""
    context, task, seed = group
    tagged = [peer.PeerExample(f"{task}-{context}-{seed}-{i}", context, ex) for i, ex in enumerate(examples)]
    peer.write_examples(folder / "examples.json", tagged)
    budgets = [peer.budget_fraction(r) for r in ratios]
    records = peer.run_kvpress(
        python, folder / "examples.json", Path(loaded.model.name_or_path), [press], budgets,
        folder / "kvpress.json", max_new_tokens=new_tokens, device=device, dtype=dtype,
    )  # fmt: skip
    runs = defaultdict(list)
    for run in peer.score_kvpress(records, tagged, None):
        runs[run.method, None if run.budget is None else peer.compression_ratio(run.budget)].append(run)
    order = {e.id: i for i, e in enumerate(tagged)}
    cells = []
    for (method, ratio), group_runs in runs.items():
        group_runs.sort(key=lambda run: order[run.example_id])
        cells.append(
            Cell(
                context, task, seed, method, ratio, None if ratio is None else peer.budget_fraction(ratio),
                None if ratio is None else 0,
                "dense" if ratio is None else "dense, compressed once after prefill", new_tokens,
                sum(r.score for r in group_runs) / len(group_runs), tuple(r.score for r in group_runs),
                tuple(e.n_tokens for e in examples), tuple(r.text for r in group_runs),
            )
        )  # fmt: skip
    return cells


def _engine_cells(loaded, out: Path, wanted: dict, batches: dict, new_tokens: dict, dense_layers: int,
                  selector_options: Mapping | None, host_tier: dict | None = None,
                  engine_options: Mapping | None = None) -> tuple[list[Cell], list[str]]:  # fmt: skip
    """The vLLM rows' cells, and the engines that failed (their rows' cells stay empty): for each
    (method, ratio) of `wanted` (by group: the keys it lacks), one engine over the prompts of all
    its groups (`batches`, generating the most `new_tokens` any needs), each output cut to its
    group's new tokens and at the model's end of sequence, decoded and scored as atskv's runs
    are; with `host_tier`, every sparse row frees blocks and parks them (the plugin's
    `host_tier`); `engine_options` by selector name go over `selector_options` there. The model
    is saved once as a Hugging Face directory in `out`."""
    from atskv.eval.vllm_generate import GenerationJob, generate, save_for_vllm
    from atskv.runtime.vllm.config import PluginConfig

    model_dir = save_for_vllm(loaded, out / "vllm-model")
    tokenizer, jobs, groups_of = loaded.tokenizer, {}, defaultdict(list)
    prompt_ids = {g: [encode_prompt(tokenizer, ex.prompt, chat=False)[0].tolist() for ex in batches[g]] for g in wanted}
    for group, keys in wanted.items():
        for key in keys:
            groups_of[key].append(group)
    for (method, ratio), groups in groups_of.items():
        name = Method.parse(method).name
        budget = None if ratio is None else peer.budget_fraction(ratio)
        options = {**(selector_options or {}).get(name, {}), **(engine_options or {}).get(name, {})}
        tier = host_tier if name and ratio is not None else None
        if name:  # the plugin's settings checked here, before an engine starts (a bad option: one line)
            PluginConfig.from_additional_config({"atskv": {
                "selector": name, "budget": budget, "dense_layers": dense_layers, "options": options,
                **({"free_blocks": True, "host_tier": tier} if tier is not None else {})}})  # fmt: skip
        requests = [{"id": f"{c}-{t}-{s}-{i}", "prompt_token_ids": prompt_ids[c, t, s][i]} for c, t, s in groups
                    for i in range(len(batches[c, t, s]))]  # fmt: skip
        jobs[method, ratio] = GenerationJob(method, str(model_dir), budget, dense_layers,
                                            max(new_tokens[g] for g in groups), requests, options, tier)  # fmt: skip
    outputs, failed = generate(list(jobs.values()), out / "vllm" / "outputs.jsonl")
    stops, cells = eos_ids(loaded.model, tokenizer), []
    for (method, ratio), job in jobs.items():
        if job.label not in outputs:
            continue
        for c, t, s in groups_of[method, ratio]:
            texts = []
            for i in range(len(batches[c, t, s])):
                tokens = cut_at_eos(outputs[job.label][f"{c}-{t}-{s}-{i}"][: new_tokens[c, t, s]], stops)
                texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
            scores = tuple(ex.score(text) for ex, text in zip(batches[c, t, s], texts))
            cells.append(Cell(
                c, t, s, method, ratio, job.budget, None if ratio is None else dense_layers, "dense (vLLM's)",
                new_tokens[c, t, s], sum(scores) / len(scores), scores,
                tuple(ex.n_tokens for ex in batches[c, t, s]), tuple(texts),
            ))  # fmt: skip
    return cells, failed


def run_leaderboard(
    loaded,
    out: str | Path,
    grid: Grid,
    *,
    examples: int = 4,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    filler: str = "classic",
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    kvpress_python: Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    selector_options: dict[str, dict] | None = None,
    tiering: dict | None = None,
    host_tier: dict | None = None,
    engine_host_tier: dict | None = None,
    engine_options: dict[str, dict] | None = None,
    fast: bool = True,
    progress: bool = True,
) -> dict[str, Path]:
    """Compute the grid's missing cells for `loaded` (a `LoadedModel`) into `out`, then write the
    report (see `write`). kvpress methods are skipped, with a message on stderr and in the table's
    notes, where kvpress cannot run (`kvpress_unavailable`). `selector_options`: constructor
    arguments by selector name (`atskv.selectors.selectors_for_model`), part of the settings a
    rerun into `out` must share, as are `tiering` (the `TieringConfig` options of the `tiered:`
    rows; none: its defaults), `host_tier` (the `HostRetrieval` options of the `host:` rows) and
    `engine_host_tier` (the vLLM plugin's `host_tier` for the `vllm:` rows, which then free blocks)
    and `engine_options` (plugin options for the `vllm:` rows alone, by selector name).
    `fast`: atskv's selectors run on `atskv.generate`'s fast path (what a user serves with), else
    on the reference path (`atskv.sparse` under `model.generate`); the `tiered:` rows run
    `atskv.tiered` under `model.generate` and the `host:` rows the fast path either way; dense is
    always transformers' own `generate`."""
    from atskv.runtime.fast.host_pages import HostRetrieval
    from atskv.selectors import selectors_for_model

    check_tiering(grid, tiering, sparse_prefill, host_tier)
    if engine_host_tier is not None and not grid.engine_rows:
        raise InputError("--engine_host_tier is the vllm: rows' host tier; no vllm:<selector> method is given")
    engine_names = {Method.parse(m).name for m in grid.engine_rows}
    if unknown := sorted(set(engine_options or {}) - engine_names):
        raise InputError(f"--engine_options for {unknown[0]!r}, which no vllm:<selector> row runs")
    if grid.engine_rows:
        from atskv.eval.vllm_generate import check_vllm

        check_vllm()  # before any row runs
    host = HostRetrieval(**(host_tier or {}))  # the host: rows' tier options (a call builds its own store)

    settings = {
        "model": loaded.name, "examples": examples, "filler": filler, "dense_layers": dense_layers,
        "prefill": "sparse" if sparse_prefill else "dense", "max_new_tokens": max_new_tokens, "dtype": dtype,
        "runtime": "fast" if fast else "reference",
        **({"selector_options": {k: _as_setting(opts) for k, opts in selector_options.items()}}
           if selector_options else {}),
        **({"tiering": _as_setting(tiering)} if tiering else {}),
        # every field of the host: rows' tier, defaults included: a default that changes (the key summary
        # did, from bounds to int4) must not let a rerun add cells of another tier to a folder
        **({"host_tier": _as_setting(asdict(host))} if grid.hosted else {}),
        **({"engine_host_tier": _as_setting(engine_host_tier)} if engine_host_tier is not None else {}),
        **({"engine_options": {k: _as_setting(o) for k, o in engine_options.items()}} if engine_options else {}),
    }  # fmt: skip
    built = dict(zip(grid.selector_names, selectors_for_model(grid.selector_names, loaded.name, selector_options)))
    selectors = {m: built[Method.parse(m).name] for m in grid.selectors}  # a tiered: or host: row shares its selector
    if fast and (slow := [m for m, s in selectors.items() if m not in grid.tiered and not s.has_fast_path()]):
        raise InputError(f"{', '.join(slow)} run on the reference path only; run the leaderboard with --fast false")
    if fast and sparse_prefill:
        raise InputError("the fast path prefills densely; sparse prefill needs --fast false")
    if no_host := [m for m in grid.hosted if not selectors[m].has_fast_path()]:
        raise InputError(f"{', '.join(no_host)}: the host tier lives on the fast path, which this selector lacks")
    store = CellStore(Path(out), settings)
    python = Path(kvpress_python) if kvpress_python else peer.default_kvpress_python()
    skipped = kvpress_unavailable(python, loaded) if grid.presses else None
    if skipped:
        print(f"kvpress methods skipped ({', '.join(str(Method(KVPRESS, p)) for p in grid.presses)}): {skipped}",
              file=sys.stderr)  # fmt: skip
    presses = [] if skipped else grid.presses
    groups = [(c, t, s) for c in grid.contexts for t in grid.tasks for s in grid.seeds]
    atskv_keys = {g: [(DENSE, None)] + [(m, r) for m in selectors for r in grid.ratios] for g in groups}
    press_runs = [(KVPRESS_DENSE, None)] + [(str(Method(KVPRESS, p)), r) for p in presses for r in grid.ratios]
    press_keys = {g: press_runs if presses else [] for g in groups}
    engine_runs = [(VLLM_DENSE, None)] + [(m, r) for m in grid.engine_rows for r in grid.ratios]
    engine_keys = {g: engine_runs if grid.engine_rows else [] for g in groups}
    pending = {g: [k for k in atskv_keys[g] + press_keys[g] + engine_keys[g] if (*g, *k) not in store] for g in groups}
    batches, room = {}, {}  # the vLLM rows' prompts and new tokens, by group, for one engine over them all
    text = filler_text(filler)
    bar = tqdm(total=sum(map(len, pending.values())), desc="leaderboard", disable=not progress)
    failed: list[str] = []
    for group in groups:
        if not pending[group]:
            continue
        context, task, seed = group
        batch = build_examples(loaded.tokenizer, task, context, seed, examples, text)
        new_tokens = max_new_tokens or answer_room(loaded.tokenizer, batch)
        batches[group], room[group] = batch, new_tokens
        for method, ratio in (k for k in pending[group] if k in atskv_keys[group]):
            bar.set_postfix_str(f"{context} {task} seed {seed} {method} {ratio or ''}")
            budget = None if ratio is None else peer.budget_fraction(ratio)
            runtime = _runtime(method, grid, fast, sparse_prefill, tiering, host)
            store.add(
                _atskv_cell(
                    loaded, batch, (*group, method, ratio), selectors.get(method), budget, dense_layers, new_tokens,
                    batch_size, runtime,
                )
            )  # fmt: skip
            bar.update()
        wanted = [k for k in pending[group] if k in press_keys[group]]
        for name in dict.fromkeys(Method.parse(m).name for m, _ in wanted):  # one process a press: a
            # kill (a call's time limit) loses at most the press under way, a failure only that press
            press = str(Method(KVPRESS, name))
            bar.set_postfix_str(f"{context} {task} seed {seed} {press}")
            ratios = [r for m, r in wanted if m == press and r is not None]
            folder = store.out / "kvpress" / f"{task}-{context}-seed{seed}" / name
            try:
                made = _kvpress_cells(loaded, python, folder, batch, group, name, ratios, new_tokens, device, dtype)
            except subprocess.CalledProcessError as error:
                failed.append(f"{press} on {task} at {context} tokens, seed {seed} (exit {error.returncode})")
                print(f"{failed[-1]} failed (its output is above); its cells stay empty and a rerun tries again",
                      file=sys.stderr)  # fmt: skip
                continue
            for cell in made:
                store.add(cell)
                bar.update()
    engine_wanted = {g: [k for k in pending[g] if k in engine_keys[g]] for g in groups}
    if any(engine_wanted.values()):  # after atskv's and kvpress's rows: an engine that fails loses only its own
        bar.set_postfix_str("vLLM")
        made, engines_failed = _engine_cells(loaded, store.out, {g: k for g, k in engine_wanted.items() if k}, batches,
                                             room, dense_layers, selector_options, engine_host_tier,
                                             engine_options)  # fmt: skip
        for cell in made:
            store.add(cell)
            bar.update()
        failed += [f"the vLLM engine of {label}" for label in engines_failed]
    bar.close()
    every = {g: atskv_keys[g] + press_keys[g] + engine_keys[g] for g in groups}
    cells = [store.cells[(*g, *k)] for g in groups for k in every[g] if (*g, *k) in store.cells]
    notes = describe(settings, grid, skipped)
    if failed:
        notes += "\n\nRuns that failed (their cells are empty; a rerun tries again): " + "; ".join(failed)
    return write(cells, store.out, grid, loaded.name, notes, settings)


def _as_setting(options: Mapping) -> dict[str, str]:
    """Options as `settings.json` keeps them (values as text), so a rerun compares like with like."""
    return {k: str(v) for k, v in options.items()}
