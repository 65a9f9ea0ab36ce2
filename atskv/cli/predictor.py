"""`atskv collect`, `atskv fit`, `atskv export`, `atskv ridge` and `atskv finetune`: the relevance
predictor's training data, its supervised training, its export, the closed-form linear scorer
beside it, and its policy-gradient fine-tuning."""

from __future__ import annotations

from pathlib import Path

from atskv.cli.common import load, passes_argv, quiet_lightning
from atskv.models import DEFAULT_MODEL


def collect(
    model: str = DEFAULT_MODEL,
    corpus: str = "austen",
    windows: int = 32,
    window_tokens: int = 2048,
    decision_points: list[float] = [0.5, 0.75],  # noqa: B006 (read-only; a list for the CLI)
    future_queries: int = 64,
    topk: int = 128,
    influence: bool = False,
    dense_layers: int = 2,
    seed: int = 0,
    label: str = "mass",
    full_windows: int = 0,
    tasks: list[str] = [],  # noqa: B006
    task_examples: int = 0,
    out: Path | None = None,
    start_over: bool = False,
    device: str = "auto",
    devices: int = 1,
    dtype: str = "auto",
) -> Path:
    """Collect the relevance predictor's training data: features and labels of MODEL's tokens.

    Every window is run once densely; at each decision time t the tokens 0..t of every managed
    layer and KV head get their features and the attention they receive from the next W
    queries; all top-k tokens of that mass (or of the kvzip score) and as many others are
    stored (every token in the first FULL_WINDOWS windows). Rerunning into the same folder
    resumes: finished windows are skipped. With `devices` N > 1, N processes share the windows
    and write into the same folder; the result is that of one process.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        corpus: training text: a corpus name, a folder of .txt files or hf:<dataset>.
        windows: token windows to collect, spread evenly over the corpus.
        window_tokens: tokens per window.
        decision_points: decision times t as fractions of the window.
        future_queries: W, the queries after t whose attention (and loss) define the labels.
        topk: size of the oracle top-k set whose members are the positives.
        influence: also compute the influence label (one extra forward and backward per window).
        dense_layers: the first layers the hook keeps dense; use the same value at run time.
        seed: seed of the negative sampling.
        label: what ranks the tokens, picking the positives and what `fit` learns: mass (the
            attention of the next W queries) or kvzip (KVzip+ reconstruction scores from one more
            forward per decision time that repeats tokens 0..t after an instruction; stored in a
            kvzip column beside the mass).
        full_windows: the first N windows keep every token 0..t of each group, not a sample, so
            `fit` can validate the whole-window recall (val/window_recall, its checkpoint metric
            when some of them land in the validation split: about N x the validation fraction do).
            Such a window is several times a sampled one's size; training reads only their
            sampled rows.
        tasks: synthetic tasks (e.g. [passkey,needle_single]) whose prompts, answer appended, are
            collected too, decided at the prompt's end with the answer's queries as the future.
        task_examples: prompts per task (window_tokens long each).
        out: output folder (default: data/collect/<model name>).
        start_over: empty OUT first; without it, a folder holding another collection (other
            corpus, model or settings) is refused.
        device: the accelerator: cpu, cuda, or auto (cuda when there is a GPU).
        devices: processes, each with the model: N GPUs (NCCL; process r on cuda:r) or N CPU
            processes (gloo) sharing the cores.
        dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU).
    """
    from atskv.predictor.collect import CollectSpec
    from atskv.predictor.launch import spawn

    # fail early, before the model loads
    CollectSpec(
        window_tokens, tuple(decision_points), future_queries, topk, influence, dense_layers, seed, label, full_windows
    )
    options = dict(
        model=model, corpus=corpus, windows=windows, window_tokens=window_tokens, decision_points=decision_points,
        future_queries=future_queries, topk=topk, influence=influence, dense_layers=dense_layers, seed=seed,
        label=label, full_windows=full_windows, tasks=tasks, task_examples=task_examples, out=out,
        start_over=start_over, dtype=dtype,
    )
    folder = spawn(collect_process, devices, device, options)
    extra = f" and {task_examples} prompts of each of {', '.join(tasks)}" if tasks and task_examples else ""
    on = f" on {devices} processes" if devices > 1 else ""
    print(f"collected {windows} windows{extra}{on} into {folder}")
    return folder


def collect_process(device: str, options: dict) -> Path:
    """One process of `collect`: loads the model on `device`, reads the windows, collects its share."""
    from atskv.data import corpus_windows
    from atskv.predictor.collect import collect as collect_shards

    o = dict(options)
    loaded = load(o.pop("model"), device, o.pop("dtype"), announce=False)
    corpus, windows, window_tokens = o.pop("corpus"), o.pop("windows"), o.pop("window_tokens")
    try:
        ids = corpus_windows(loaded.tokenizer, corpus, window_tokens, windows)
    except ValueError as err:
        raise ValueError(
            f"cannot collect {windows} windows of {window_tokens} tokens from corpus {corpus!r}: {err}"
        ) from err
    out = o.pop("out") or Path("data/collect") / loaded.name
    corpus = Path(corpus).name if "/" in corpus else corpus
    return collect_shards(loaded.model, loaded.tokenizer, ids, out, model_name=loaded.name, corpus=corpus, **o)


@passes_argv
def fit(argv: list[str]) -> None:
    """Train the relevance predictor on collected shards (LightningCLI; see `atskv fit --help`).

    Typical use: `atskv fit --config configs/fit.yaml --seed_everything N` for N = 0, 1, 2."""
    from atskv.predictor.training import fit_main

    quiet_lightning()
    cli = fit_main(["fit", *argv])  # Lightning's own CLI (trainer, model, data, checkpoints) takes over
    wrote_checkpoints(cli.trainer)


@passes_argv
def finetune(argv: list[str]) -> None:
    """Fine-tune a predictor with policy gradients on rollouts through the base model
    (LightningCLI; see `atskv finetune --help`).

    Typical use: `atskv finetune --config configs/finetune.yaml --seed_everything N --model.alpha A`."""
    from atskv.rl.training import finetune_main

    quiet_lightning()
    cli = finetune_main(argv)
    wrote_checkpoints(cli.trainer)


def wrote_checkpoints(trainer) -> None:
    """The last line of `fit` and `finetune`: where the checkpoints are and what to run next: the
    best checkpoint where it was chosen by recall over whole held-out windows (`collect
    --full_windows`), else the last (the sampled mass recall it falls back on is near 1 throughout)."""
    from atskv.predictor.training import MONITOR

    callback = trainer.checkpoint_callback
    if callback is not None and callback.last_model_path:
        best = f"best {callback.best_model_path}, " if callback.best_model_path else ""
        chosen = callback.best_model_path if callback.best_model_path and callback.monitor == MONITOR else None
        print(f"wrote checkpoints into {callback.dirpath} ({best}last {callback.last_model_path}); "
              f"next: atskv export {chosen or callback.last_model_path}")


def export(checkpoint: Path, out: Path | None = None, model: str | None = None, overwrite: bool = False) -> Path:
    """Turn a training checkpoint into predictor.safetensors plus its JSON header.

    Args:
        checkpoint: a checkpoint written by `atskv fit` or `atskv finetune` (e.g.
            runs/fit/.../checkpoints/last.ckpt).
        out: output folder (predictor.safetensors, predictor.json); default
            <cache>/predictors/<model name>, where `--selectors [learned]` finds it.
        model: the base model (for its tokenizer's token-type table and the config hash the header
            records); default: the one the training data was collected from. Its geometry must
            match the collection's.
        overwrite: allow writing into the folder of a predictor shipped with atskv.
    """
    from atskv.predictor.export import export_checkpoint

    path = export_checkpoint(checkpoint, out, load(model, "cpu", "float32") if model else None, overwrite=overwrite)
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return path


def ridge(
    folder: Path,
    out: Path | None = None,
    alphas: list[float] = [0.01, 0.1, 1.0, 10.0],  # noqa: B006
    validation_fraction: float = 0.1,
    seed: int = 0,
    model: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Fit the linear scorer (ridge regression per managed layer and KV head, closed form) on
    collected shards and export it as a predictor the `learned` selector loads like the MLP's.

    Args:
        folder: a shard folder written by `atskv collect` (either label).
        out: output folder (predictor.safetensors, predictor.json); default
            <cache>/predictors/<model name>, where `--selectors [learned]` finds it.
        alphas: penalties to try (per row, on standardised inputs); the one with the best
            validation recall is kept (window recall over held-out full windows, else mass recall).
        validation_fraction: share of the windows held out to choose the penalty.
        seed: the train/validation split (as `atskv fit`'s data.seed).
        model: the base model (token-type table, config hash); default: the collection's.
        overwrite: allow writing into the folder of a predictor shipped with atskv.
    """
    from atskv.predictor.export import export_trained
    from atskv.predictor.ridge import fit_ridge

    fit = fit_ridge(folder, alphas, validation_fraction, seed)
    recalls = {str(alpha): recall for alpha, recall in fit.validation.items()}
    training = {"stage": "ridge", "data": {"folder": str(folder), "seed": seed}, "alpha": fit.alpha,
                f"validation_{fit.metric}": recalls}
    loaded = load(model, "cpu", "float32") if model else None
    path = export_trained(fit.scorer, fit.collection, out, loaded, training, overwrite=overwrite)
    print(f"alpha {fit.alpha} (validation {fit.metric.replace('_', ' ')} by alpha: {recalls}); wrote {path}")
    return path


COMMANDS = {"collect": collect, "fit": fit, "finetune": finetune, "export": export, "ridge": ridge}
