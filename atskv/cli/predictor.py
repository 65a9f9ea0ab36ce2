"""`atskv collect`, `atskv fit`, `atskv export` and `atskv finetune`: the relevance predictor's
training data, its supervised training, its export, and its policy-gradient fine-tuning."""

from __future__ import annotations

from pathlib import Path

from atskv.cli.common import load, passes_argv
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
    queries; all top-k tokens of that mass and as many others are stored. Rerunning into the
    same folder resumes: finished windows are skipped. With `devices` N > 1, N processes share
    the windows and write into the same folder; the result is that of one process.

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
    CollectSpec(window_tokens, tuple(decision_points), future_queries, topk, influence, dense_layers, seed)
    options = dict(
        model=model, corpus=corpus, windows=windows, window_tokens=window_tokens, decision_points=decision_points,
        future_queries=future_queries, topk=topk, influence=influence, dense_layers=dense_layers, seed=seed,
        tasks=tasks, task_examples=task_examples, out=out, start_over=start_over, dtype=dtype,
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

    fit_main(["fit", *argv])  # Lightning's own CLI (trainer, model, data, checkpoints) takes over


@passes_argv
def finetune(argv: list[str]) -> None:
    """Fine-tune a predictor with policy gradients on rollouts through the base model
    (LightningCLI; see `atskv finetune --help`).

    Typical use: `atskv finetune --config configs/finetune.yaml --seed_everything N --model.alpha A`."""
    from atskv.rl.training import finetune_main

    finetune_main(argv)


def export(checkpoint: Path, out: Path | None = None, model: str | None = None) -> None:
    """Turn a training checkpoint into predictor.safetensors plus its JSON header.

    Args:
        checkpoint: a checkpoint written by `atskv fit` or `atskv finetune` (e.g.
            runs/fit/.../checkpoints/last.ckpt).
        out: output folder (predictor.safetensors, predictor.json); default
            <cache>/predictors/<model name>, where `--selectors [learned]` finds it.
        model: the base model (for its tokenizer's token-type table); default: the one the
            training data was collected from. Its geometry must match the collection's.
    """
    from atskv.models import ModelGeometry, load_model, model_geometry
    from atskv.predictor.export import checkpoint_provenance, default_predictor_dir, export_predictor
    from atskv.predictor.token_types import token_type_table
    from atskv.predictor.training import RelevanceModule

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"{checkpoint}: no such checkpoint; `atskv fit` writes them under runs/fit/")
    module = RelevanceModule.load_from_checkpoint(checkpoint, map_location="cpu")
    collection = module.hparams.collection
    geometry = ModelGeometry.from_dict(collection["geometry"])
    loaded = load_model(model or collection["model"])
    if model_geometry(loaded.model.config) != geometry:
        raise ValueError(f"{loaded.name} is not the model the training data came from ({collection['model']})")
    path = export_predictor(
        module.model.eval(),
        token_type_table(loaded.tokenizer, loaded.model.config.vocab_size),
        out or default_predictor_dir(collection["model"]),
        base_model=collection["model"],
        geometry=geometry,
        managed_layers=collection["managed_layers"],
        training=checkpoint_provenance(checkpoint),
    )
    print(f"wrote {path} ({module.model.parameter_count()} parameters) and {path.with_suffix('.json')}")


COMMANDS = {"collect": collect, "fit": fit, "finetune": finetune, "export": export}
