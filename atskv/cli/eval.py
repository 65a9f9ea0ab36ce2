"""`atskv eval recall|tasks|ppl|peer|leaderboard|heldout`: measure selectors (and predictors) against dense
attention."""

from __future__ import annotations

from pathlib import Path

from atskv.cli.common import load, load_with_selectors, selector_help
from atskv.data.tasks import TASKS
from atskv.errors import InputError
from atskv.eval.method import KVPRESS_PRESSES, Method
from atskv.models import DEFAULT_MODEL, resolve_device


def recall(
    model: str = DEFAULT_MODEL,
    corpus: str = "sotu",
    window_tokens: int = 2048,
    windows: int = 4,
    n_queries: int = 16,
    selectors: list[str] = ["oracle", "quest", "sparq", "sparcas", "h2o", "snapkv", "streaming_llm"],  # noqa: B006
    budgets: list[int] = [32, 64, 128, 256, 512, 1024],  # noqa: B006
    tiering: dict | None = None,
    dense_layers: int = 2,
    batch_size: int = 4,
    out: Path = Path("results/recall"),
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Attention recall of each selector at each budget on held-out text windows.

    Beside them, the per-query oracle and the best-single-set ceilings; writes table.md,
    recall.json and recall.png. A method `tiered:<selector>` runs the selector through the
    two-tier store (`atskv.tiered`): what a query reads is then its budget plus the parked tokens
    retrieval brings back (the table says how many).

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        corpus: held-out text (a corpus name, a folder of .txt files, or hf:NAME[:split]).
        window_tokens: tokens per window (prompt plus the decoded queries).
        windows: how many windows, spread evenly over the corpus.
        n_queries: the last tokens of each window, decoded one at a time and measured.
        selectors: methods to measure: selectors (see `atskv selectors`) and tiered:<selector>
            (through the two-tier store, e.g. tiered:learned+sparq: its budget is then what a query
            attends among the GPU tier).
        budgets: token budgets per layer and KV head.
        tiering: `TieringConfig` options of the tiered: rows, for example {retrieve: 32, index: exact}.
        dense_layers: the first layers stay dense (and are not measured).
        batch_size: windows per forward.
        out: output folder.
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data import corpus_windows
    from atskv.eval.method import OWN, TIERED, check_methods
    from atskv.eval.recall import attention_recall

    methods = check_methods(selectors, (OWN, TIERED))
    plain = [m.name for m in methods if m.runtime == OWN]
    tiered = [m.name for m in methods if m.runtime == TIERED]
    names = plain + tiered
    loaded, chosen = load_with_selectors(model, device, dtype, names, budgets, predictor, selector_options)
    ids = corpus_windows(loaded.tokenizer, corpus, window_tokens, windows)
    report = attention_recall(
        loaded.model, ids, chosen[: len(plain)], budgets, tiered=chosen[len(plain) :], tiering=tiering,
        n_queries=n_queries, dense_layers=dense_layers,
        batch_size=batch_size, model_name=loaded.name,
    )
    report.write(out)
    print(report.markdown())
    print(f"\nwritten to {out}/ (table.md, recall.json, recall.png)")


def ppl(
    model: str = DEFAULT_MODEL,
    corpus: str = "sotu",
    lengths: list[int] = [1024, 2048, 4096],  # noqa: B006
    windows: int = 4,
    n_eval: int = 64,
    selectors: list[str] = ["quest", "h2o", "snapkv", "streaming_llm"],  # noqa: B006
    budgets: list[int | float] = [0.1],  # noqa: B006
    dense_layers: int = 2,
    batch_size: int = 4,
    out: Path = Path("results/ppl"),
    tiering: dict | None = None,
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Perplexity while decoding with each selector at each budget, beside the dense model's.

    The last N_EVAL tokens of held-out windows are decoded one at a time after a dense prefill.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        corpus: held-out text (a corpus name, a folder of .txt files, or hf:NAME[:split]).
        lengths: window lengths in tokens.
        windows: windows per length, spread evenly over the corpus.
        n_eval: tokens scored at the end of each window.
        selectors: selectors to measure.
        budgets: token budgets (int) or fractions of the context (float).
        dense_layers: the first layers stay dense.
        batch_size: windows per forward.
        out: output folder.
        tiering: run under `atskv.tiered` (GPU/host KV tiers) with these `TieringConfig` options,
            e.g. '{retrieve: 64, index: faiss}' ('{}' for the defaults); none: `atskv.sparse`.
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data import corpus_windows
    from atskv.eval import perplexity

    loaded, chosen = load_with_selectors(model, device, dtype, selectors, budgets, predictor, selector_options)
    by_length = {n: corpus_windows(loaded.tokenizer, corpus, n, windows) for n in lengths}
    records = perplexity.evaluate_perplexity(
        loaded.model, by_length, chosen, budgets,
        n_eval=n_eval, dense_layers=dense_layers, batch_size=batch_size, tiering=tiering
    )
    paths = perplexity.write(records, out)
    print(perplexity.markdown(records))
    print(f"\nwritten to {out}/ ({', '.join(path.name for path in paths.values())})")


def tasks(
    model: str = DEFAULT_MODEL,
    tasks: list[str] = list(TASKS),  # noqa: B006, B008 (jsonargparse reads it)
    lengths: list[int] = [1024, 2048],  # noqa: B006
    depths: list[float] = [0.1, 0.5, 0.9],  # noqa: B006
    trials: int = 4,
    selectors: list[str] = ["oracle", "quest", "snapkv", "h2o", "streaming_llm"],  # noqa: B006
    budgets: list[int | float] = [64, 128, 256],  # noqa: B006
    dense_layers: int = 2,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    filler: str = "classic",
    out: Path = Path("results/tasks"),
    tiering: dict | None = None,
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Synthetic long-context tasks with exact scoring, dense KV against each selector at each budget.

    Pass key, needles, variable tracking and common words; prints the mean scores and writes
    table.md, results.json and tasks.png.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        tasks: task names (see `atskv.data.tasks.TASKS`).
        lengths: prompt lengths in tokens.
        depths: where the needle sits, as fractions of the haystack (common_words has none).
        trials: seeded examples per task, length and depth.
        selectors: selectors to compare with dense KV (see `atskv selectors`).
        budgets: KV tokens kept per layer and KV head (int), or fractions of the context (float).
        dense_layers: the first layers stay dense.
        max_new_tokens: tokens to generate; default: twice the answer's length plus 4.
        batch_size: examples generated together (left-padded).
        filler: the haystack: "classic" (the pass-key test's repeated lines), "varied"
            (generated sentences), or a corpus (name, folder or hf:...) whose text is used.
        out: output folder.
        tiering: run under `atskv.tiered` (GPU/host KV tiers) with these `TieringConfig` options,
            e.g. '{retrieve: 64, index: faiss}' ('{}' for the defaults); none: `atskv.sparse`.
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data import filler_text
    from atskv.eval.tasks import check_plan, evaluate_tasks, markdown, write
    from atskv.selectors import selector_options as by_name
    from atskv.selectors import selectors_for_model

    check_plan(tasks, lengths, depths, trials, selectors, budgets)
    options = by_name(selectors, selector_options, predictor)
    filler_str = filler_text(filler)
    loaded = load(model, device, dtype, announce=False)
    results = evaluate_tasks(
        loaded,
        tasks,
        lengths,
        depths,
        trials,
        selectors_for_model(selectors, loaded.name, options),
        budgets,
        dense_layers=dense_layers,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        filler=filler_str,
        tiering=tiering,
    )
    write(results, out)
    print(markdown(results))
    print(f"\nwritten to {out}/ (table.md, results.json, tasks.png)")


def peer(
    model: str = DEFAULT_MODEL,
    task: str = "passkey",
    lengths: list[int] = [1024, 2048],  # noqa: B006 (jsonargparse reads it)
    trials: int = 3,
    budgets: list[float] = [0.1, 0.25],  # noqa: B006
    presses: list[str] = list(KVPRESS_PRESSES),  # noqa: B006
    our_selectors: list[str] = ["snapkv", "streaming_llm", "h2o"],  # noqa: B006
    kvpress_python: Path | None = None,
    out: Path = Path("results/peer"),
    max_new_tokens: int | None = None,
    filler: str = "classic",
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> list:
    """NVIDIA kvpress's presses beside atskv's selectors on the same task prompts at the same
    budgets; prints and writes a markdown table and JSON (accuracy, KV held vs dense).

    Both compress the whole prompt, question included; atskv runs with every layer managed
    (dense_layers=0) because kvpress compresses every layer; kvpress's compression ratio is
    1 - budget. kvpress runs in its own venv (benchmarks/peer_kvpress/setup.sh).

    Args:
        model: a named model, a Hugging Face directory or a .gguf file (kvpress is given the
            Hugging Face directory it loads from).
        task: a task name from `atskv.data.TASKS`.
        lengths: prompt lengths in tokens.
        trials: examples per length (needle depths spread over the haystack).
        budgets: KV kept, as fractions of the prompt.
        presses: kvpress presses (snapkv, streaming_llm, observed_attention, expected_attention, tova, kvzip).
        our_selectors: atskv selectors to run beside them.
        kvpress_python: the python of the kvpress venv (default: ~/.cache/atskv/venvs/kvpress).
        out: output folder (peer.md, peer.json, examples.json, kvpress.json).
        max_new_tokens: tokens generated per example; default: twice the answer's length plus 4.
        filler: the haystack: "classic", "varied", or a corpus (name, folder or hf:...).
        predictor: {PREDICTOR_HELP}; it must manage every layer (here dense_layers=0).
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.eval.peer import check_peer_plan, compare_with_kvpress, default_kvpress_python

    python = Path(kvpress_python) if kvpress_python else default_kvpress_python()
    check_peer_plan(python, budgets, presses, our_selectors)
    loaded, chosen = load_with_selectors(model, device, dtype, our_selectors, budgets, predictor, selector_options)
    device, torch_dtype = resolve_device(device, dtype)
    rows, report = compare_with_kvpress(
        loaded, python, Path(out), task=task, lengths=lengths, trials=trials, budgets=budgets, presses=presses,
        our_selectors=chosen, max_new_tokens=max_new_tokens, filler=filler, device=device,
        dtype=str(torch_dtype).removeprefix("torch."),
    )  # fmt: skip
    print(f"\n{report}\nwritten to {out}/ (peer.md, peer.json, examples.json, kvpress.json)")
    return rows


def leaderboard(
    model: str = DEFAULT_MODEL,
    methods: list[str] = ["snapkv", "h2o", "streaming_llm", "learned", "kvpress:snapkv", "kvpress:tova"],  # noqa: B006
    contexts: list[int] = [4096, 8192],  # noqa: B006
    ratios: list[float] = [0.25, 0.5, 0.75, 0.875, 0.9],  # noqa: B006
    tasks: list[str] = list(TASKS),  # noqa: B006, B008 (jsonargparse reads it)
    seeds: list[int] = [0, 1, 2],  # noqa: B006
    examples: int = 4,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    filler: str = "classic",
    fast: bool = True,
    kvpress_python: Path | None = None,
    out: Path = Path("results/leaderboard"),
    predictor: Path | None = None,
    selector_options: dict | None = None,
    tiering: dict | None = None,
    host_tier: dict | None = None,
    engine_host_tier: dict | None = None,
    engine_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """The long-context leaderboard for one model: dense, atskv's selectors and kvpress's presses
    at each compression ratio on the same task prompts, per context length, over seeds; writes
    leaderboard.md (a table per context), leaderboard.json (every cell) and leaderboard.png.

    Resumable: rerun into the same OUT and only missing cells are computed. kvpress runs in its
    own venv (benchmarks/peer_kvpress/setup.sh); without it, its methods are skipped with a message.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        methods: atskv selectors by name (learned and compositions included), tiered:<selector>
            (the selector in the two-tier store: the budget on the GPU, the rest in host memory,
            retrieved when needed), host:<selector> (the fast path's host tier: an evicting
            selector's budget on the GPU, each step reading back the pages of the parked tokens
            a query rates highest), kvpress:<press> (snapkv, streaming_llm,
            observed_attention, expected_attention, tova, kvzip) and vllm:<selector> (atskv's
            vLLM plugin, beside vanilla vLLM: one engine a row and ratio over all the prompts, the
            model saved once as a Hugging Face directory in OUT; needs vLLM and a GPU); dense
            always runs.
        contexts: prompt lengths in tokens.
        ratios: compression ratios, the fraction of the KV removed, in (0, 1); budget = 1 - ratio.
        tasks: task names (see `atskv.data.tasks.TASKS`); a seed's score is their mean.
        seeds: each seed is its own set of prompts; the table gives mean ± std over seeds.
        examples: prompts per task, context and seed (needle depths spread over the haystack).
        dense_layers: the first layers stay dense under atskv (kvpress compresses every layer).
        sparse_prefill: atskv selectors also choose during prefill (default: dense prefill).
        max_new_tokens: tokens to generate; default: twice the answer's length plus 4.
        batch_size: prompts generated together (left-padded).
        filler: the haystack: "classic", "varied", or a corpus (name, folder or hf:...).
        fast: atskv's selectors run on the fast path (`atskv.generate`: static cache, CUDA graph),
            as one serves with; false: the reference path (`atskv.sparse` under `model.generate`).
        kvpress_python: the python of the kvpress venv (default: ~/.cache/atskv/venvs/kvpress).
        out: output folder, also the record of finished cells (cells.jsonl, settings.json).
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        tiering: the tiered: rows' `TieringConfig` options, e.g. '{retrieve: 64, index: exact}'
            (none: its defaults).
        host_tier: the host: rows' `HostRetrieval` options, e.g. '{tokens: 0.125, cache: 2}'
            (tokens read back per step: an int, or a fraction of the prompt; none: its defaults).
        engine_host_tier: the vllm: rows' host tier (they then free blocks and park them), the
            plugin's `host_tier`, e.g. '{regions: 4, pages: 16}' or '{gib: 8}'; snapkv, h2o and learned only.
        engine_options: plugin options for the vllm: rows alone, by selector name, over
            `selector_options` there, e.g. '{learned: {prompt_sample: 8}}' (the engine samples the
            prompt's queries, atskv's own rows do not).
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.eval.leaderboard import check_grid, check_tiering, run_leaderboard
    from atskv.models import load_model
    from atskv.selectors import selector_options as by_name

    grid = check_grid(contexts, ratios, methods, tasks, seeds, examples)
    check_tiering(grid, tiering, sparse_prefill, host_tier)
    engine_names = [Method.parse(m).name for m in grid.engine_rows]  # the plugin's selectors take the same options
    options = by_name(list(dict.fromkeys(grid.selector_names + engine_names)), selector_options, predictor)
    device, torch_dtype = resolve_device(device, dtype)
    loaded = load_model(model, dtype=torch_dtype, device=device)
    paths = run_leaderboard(
        loaded, out, grid, examples=examples, dense_layers=dense_layers, sparse_prefill=sparse_prefill,
        filler=filler, max_new_tokens=max_new_tokens, batch_size=batch_size, kvpress_python=kvpress_python,
        device=device, dtype=str(torch_dtype).removeprefix("torch."), selector_options=options, tiering=tiering,
        host_tier=host_tier, engine_host_tier=engine_host_tier, engine_options=engine_options, fast=fast,
    )  # fmt: skip
    print(paths["markdown"].read_text())
    print(f"written to {out}/ (leaderboard.md, leaderboard.json, leaderboard.png; cells.jsonl for resuming)")


def heldout(
    model: str = DEFAULT_MODEL,
    supervised: list[str] | None = None,
    finetuned: Path | None = None,
    out: Path = Path("results/rl"),
    corpus: str = "moby-dick",
    windows: int = 16,
    context_tokens: int = 2048,
    continuation_tokens: int = 32,
    tasks: list[str] = ["passkey", "needle_single"],  # noqa: B006 (read-only; a list for the CLI)
    task_examples: int = 16,
    budgets: list[float] = [0.05, 0.1, 0.2, 0.4],  # noqa: B006
    shared_budgets: list[float] = [],  # noqa: B006
    offsets: list[float] = [],  # noqa: B006
    baselines: list[str] = ["h2o", "snapkv", "streaming_llm"],  # noqa: B006
    retrieve: int | float = 0,
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> str:
    """Supervised and fine-tuned predictors on held-out data, at equal memory, beside the evicting
    baselines; prints the table and writes records.json, table.md and quality-memory.png into OUT.

    Args:
        model: the base model.
        supervised: supervised predictors (exported folders or model names; several are seeds);
            default: MODEL's (the user's export, else the shipped one).
        finetuned: a folder of exported fine-tuned predictors named alpha<A>-seed<S> (A: the
            alpha it was trained with, which its reward is computed at; `benchmarks/rl_finetune.sh`
            writes WORK/predictors); none: the supervised predictors and baselines alone.
        out: output folder.
        corpus: held-out text (not trained on).
        windows: corpus windows.
        context_tokens: T, the context decided on.
        continuation_tokens: C, the tokens scored after it.
        tasks: synthetic tasks (prompts from seeds HELDOUT_TASK_SEED_BASE on).
        task_examples: prompts per task.
        budgets: retained fractions for the equal-memory comparisons (top-b) and the baselines.
        shared_budgets: retained fractions for one threshold shared by all layers and KV heads
            (`shared<b>`), e.g. the fine-tuned predictors' threshold memories.
        offsets: logit thresholds c for `above<c>` (the threshold moved by c).
        baselines: evicting selectors run through the hook at the same budgets (learned too).
        retrieve: judged as a two-tier store's GPU tier: each continuation query reads back this
            many dropped tokens per layer and KV head, those it rates highest (int: tokens; float:
            a fraction of the context), for predictors and baselines alike; 0: dropped is gone.
        predictor: {PREDICTOR_HELP}; for `learned` among the baselines (the predictors compared
            top-b are SUPERVISED and FINETUNED).
        selector_options: {OPTIONS_HELP}; for the baselines.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.predictor.export import load_predictor
    from atskv.rl.evaluate import heldout_records, write_report
    from atskv.rl.rollout import retrieved_tokens

    retrieved_tokens(retrieve, 1)  # bad values and paths fail before the model loads
    paths = {f"supervised-seed{i}": _exported_predictor(s, "--supervised") for i, s in enumerate(supervised or [model])}
    if finetuned is not None:
        tuned = sorted(Path(finetuned).glob("alpha*-seed*"))
        if not tuned:
            raise InputError(f"--finetuned {finetuned}: no fine-tuned predictors (alpha<A>-seed<S> folders) there")
        paths.update((folder.name, folder) for folder in tuned)
    lm, chosen = load_with_selectors(model, device, dtype, baselines, budgets, predictor, selector_options)
    device, _ = resolve_device(device, dtype)
    runs = {name: load_predictor(path, lm.model, device) for name, path in paths.items()}
    records = heldout_records(
        lm, runs, corpus=corpus, windows=windows, context_tokens=context_tokens,
        continuation_tokens=continuation_tokens, tasks=tasks, task_examples=task_examples, budgets=budgets,
        shared_budgets=shared_budgets, offsets=offsets, baselines=chosen, retrieve=retrieve,
    )  # fmt: skip
    table = write_report(records, out)
    print(table)
    return table


def _exported_predictor(source: str, flag: str) -> Path:
    """An exported predictor (its file or folder), or a model name's (`predictor_path`): refused
    before the model loads when there is none."""
    from atskv.predictor.export import predictor_path

    path = predictor_path(source)
    if not (path.is_file() or (path / "predictor.safetensors").is_file()):
        raise InputError(f"{flag} {source}: no exported predictor there; `atskv export` writes one")
    return path


selector_help(recall, ppl, tasks, peer, leaderboard, heldout)

COMMANDS = {
    "recall": recall,
    "ppl": ppl,
    "tasks": tasks,
    "peer": peer,
    "leaderboard": leaderboard,
    "heldout": heldout,
    "_help": "Measure selectors against dense attention: attention recall, perplexity, tasks, kvpress, "
    "the long-context leaderboard, held-out predictors.",
}
