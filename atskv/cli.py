"""The `atskv` command line. Thin: each subcommand parses its options (jsonargparse, so every
option can also come from a YAML file under `configs/` via `--config`) and calls the library."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from jsonargparse import auto_cli

from atskv.eval.peer import peer_command
from atskv.eval.tasks import tasks_command
from atskv.models import DEFAULT_MODEL, resolve_device
from atskv.predictor.collect import collect_command
from atskv.selectors.kascade_profile import kascade_profile_command


def _check_selection(selectors: list[str], budget: int | float) -> None:
    """Refuse a bad budget or an unknown selector before any model is loaded."""
    from atskv.selectors import check_selector_names
    from atskv.selectors.base import check_budget

    check_budget(budget)
    check_selector_names(selectors)


def _load(model: str, device: str, dtype: str):
    from atskv.models import load_model

    device, torch_dtype = resolve_device(device, dtype)
    print(f"loading {model} on {device} ({str(torch_dtype).removeprefix('torch.')}) ...", flush=True)
    return load_model(model, dtype=torch_dtype, device=device)


def demo(
    model: str = DEFAULT_MODEL,
    context_tokens: int = 2048,
    depth: float = 0.5,
    seed: int = 0,
    selectors: list[str] = ["learned", "oracle", "snapkv", "h2o", "streaming_llm"],  # noqa: B006 (jsonargparse reads it)
    budget: int | float = 256,
    dense_layers: int = 2,
    max_new_tokens: int = 12,
    filler: str = "classic",
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Passkey retrieval in a ~2K-token haystack, dense KV against each selector at a budget.

    Prints whether each answer is right, the KV bytes held and tokens/s.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        context_tokens: prompt length in tokens.
        depth: where the passkey sits, as a fraction of the haystack.
        seed: picks the passkey and the filler.
        selectors: selectors to compare with dense KV.
        budget: KV tokens kept per layer and KV head (int), or a fraction of the context (float).
        dense_layers: the first layers stay dense.
        max_new_tokens: tokens to generate.
        filler: the haystack: "classic" (the original pass-key test's repeated lines), "varied"
            (generated sentences), or a corpus (name, folder or hf:...) whose text is used.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU).
    """
    from atskv.data import filler_text, passkey_example
    from atskv.eval.generation import encode_prompt, generate, markdown_table
    from atskv.selectors import selectors_for_model

    _check_selection(selectors, budget)
    haystack = filler_text(filler)
    loaded = _load(model, device, dtype)
    example = passkey_example(loaded.tokenizer, context_tokens, depth, seed, filler=haystack)
    ids = encode_prompt(loaded.tokenizer, example.prompt, chat=False)  # the prompt ends "The pass key is"
    print(f"passkey {example.answer} at depth {depth:.0%} of a {ids.shape[1]}-token prompt; budget {budget}")
    runs = []
    for selector in [None, *selectors_for_model(selectors, loaded.name)]:
        run = generate(
            loaded.model,
            loaded.tokenizer,
            ids,
            selector=selector,
            budget=budget,
            dense_layers=dense_layers,
            max_new_tokens=max_new_tokens,
            example=example,
        )
        print(f"  {run.label:>20}: {'correct' if run.correct else 'wrong  '}  {run.text.strip()[:40]!r}", flush=True)
        runs.append(run)
    print()
    print(markdown_table(runs))
    print(
        f"\nKV held: bytes of the cache's buffers after generation (all {loaded.geometry.num_layers} layers; "
        f"the first {dense_layers} stay dense). Query-aware selectors (oracle) keep the full cache reachable; "
        "evicting ones (learned, snapkv, h2o, streaming_llm) free what they drop."
    )


def generate(
    prompt: str,
    model: str = DEFAULT_MODEL,
    selector: str | None = None,
    budget: int | float = 256,
    dense_layers: int = 2,
    sparse_prefill: bool = False,
    max_new_tokens: int = 64,
    chat: bool = True,
    tiering: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Generate a completion of PROMPT, dense or with a selector at a KV budget.

    Args:
        prompt: the prompt text, or @FILE to read it from a file.
        model: a named model, a Hugging Face directory or a .gguf file.
        selector: a selector name (see `atskv selectors`); none for dense KV.
        budget: KV tokens kept per layer and KV head (int), or a fraction of the context (float).
        dense_layers: the first layers stay dense.
        sparse_prefill: select during the prompt too (default: dense prefill, sparse decode).
        max_new_tokens: tokens to generate.
        chat: wrap the prompt in the model's chat template, if it has one.
        tiering: run under `atskv.tiered` (GPU/host KV tiers) with these `TieringConfig` options,
            e.g. '{retrieve: 64, index: faiss}' ('{}' for the defaults); none: `atskv.sparse`.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.eval.generation import encode_prompt
    from atskv.eval.generation import generate as run_generation
    from atskv.selectors import selectors_for_model

    if prompt.startswith("@"):
        prompt = Path(prompt[1:]).read_text()
    if selector is not None:
        _check_selection([selector], budget)
    loaded = _load(model, device, dtype)
    ids = encode_prompt(loaded.tokenizer, prompt, chat)
    run = run_generation(
        loaded.model,
        loaded.tokenizer,
        ids,
        selector=selectors_for_model([selector], loaded.name)[0] if selector else None,  # learned: its predictor
        budget=budget if selector else None,
        dense_layers=dense_layers,
        sparse_prefill=sparse_prefill,
        max_new_tokens=max_new_tokens,
        tiering=tiering,
    )
    print(run.text)
    print(
        f"\n[{run.label}] {run.prompt_tokens} prompt tokens in {run.prefill_seconds:.2f} s, {run.new_tokens} new "
        f"at {run.decode_tokens_per_s:.1f} tokens/s, KV held {run.kv_bytes / 2**20:.2f} MiB",
        file=sys.stderr,
    )


def eval_recall(
    model: str = DEFAULT_MODEL,
    corpus: str = "sotu",
    window_tokens: int = 2048,
    windows: int = 4,
    n_queries: int = 16,
    selectors: list[str] = ["oracle", "quest", "sparq", "sparcas", "h2o", "snapkv", "streaming_llm"],  # noqa: B006
    budgets: list[int] = [32, 64, 128, 256, 512, 1024],  # noqa: B006
    dense_layers: int = 2,
    batch_size: int = 4,
    out: Path = Path("results/recall"),
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Attention recall of each selector at each budget on held-out text windows.

    Beside them, the per-query oracle and the best-single-set ceilings; writes table.md,
    recall.json and recall.png.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        corpus: held-out text (a corpus name, a folder of .txt files, or hf:NAME[:split]).
        window_tokens: tokens per window (prompt plus the decoded queries).
        windows: how many windows, spread evenly over the corpus.
        n_queries: the last tokens of each window, decoded one at a time and measured.
        selectors: selectors to measure (see `atskv selectors`).
        budgets: token budgets per layer and KV head.
        dense_layers: the first layers stay dense (and are not measured).
        batch_size: windows per forward.
        out: output folder.
        tiering: run under `atskv.tiered` (GPU/host KV tiers) with these `TieringConfig` options,
            e.g. '{retrieve: 64, index: faiss}' ('{}' for the defaults); none: `atskv.sparse`.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data import corpus_windows
    from atskv.eval.recall import attention_recall
    from atskv.selectors import selectors_for_model

    _check_selection(selectors, budgets[0])
    loaded = _load(model, device, dtype)
    ids = corpus_windows(loaded.tokenizer, corpus, window_tokens, windows)
    report = attention_recall(
        loaded.model, ids, selectors_for_model(selectors, loaded.name), budgets,
        n_queries=n_queries, dense_layers=dense_layers,
        batch_size=batch_size, model_name=loaded.name,
    )
    report.write(out)
    print(report.markdown())
    print(f"\nwritten to {out}/ (table.md, recall.json, recall.png)")


def eval_ppl(
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
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data import corpus_windows
    from atskv.eval import perplexity
    from atskv.selectors import selectors_for_model

    for budget in budgets:
        _check_selection(selectors, budget)
    loaded = _load(model, device, dtype)
    by_length = {n: corpus_windows(loaded.tokenizer, corpus, n, windows) for n in lengths}
    records = perplexity.evaluate_perplexity(
        loaded.model, by_length, selectors_for_model(selectors, loaded.name), budgets,
        n_eval=n_eval, dense_layers=dense_layers, batch_size=batch_size, tiering=tiering
    )
    perplexity.write(records, out)
    print(perplexity.markdown(records))


def bench(
    selectors: list[str] = ["oracle", "quest", "sparq", "sparcas", "snapkv"],  # noqa: B006
    batch_sizes: list[int] = [1, 16],  # noqa: B006
    contexts: list[int] = [8192, 32768, 131072],  # noqa: B006
    budget: float = 0.05,
    geometry: str = "llama3-8b",
    steps: int = 50,
    out: Path = Path("results/bench"),
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Decode-attention latency of each selector's full path against dense SDPA, as ratios.

    One managed layer's decode step (append, score, top budget, attend) is timed with CUDA events
    in the same run as PyTorch SDPA over the whole context; writes table.md and bench.json.

    Args:
        selectors: selectors to time (see `atskv selectors`).
        batch_sizes: batch sizes.
        contexts: context lengths in tokens.
        budget: KV budget as a fraction of the context.
        geometry: attention shape: llama3-8b (32/8 heads, dim 128), smollm2-135m or gemma3-270m.
        steps: timed decode steps per setting (after a warm-up).
        out: output folder.
        device: cuda, cpu, or auto.
        dtype: bfloat16, float16, float32, or auto (bfloat16 on GPU, float32 on CPU).
    """
    import platform

    from atskv.eval import bench as benchmark

    device, torch_dtype = resolve_device(device, dtype)
    records = benchmark.bench_decode_attention(
        selectors, batch_sizes, contexts, budget, geometry, torch_dtype, device, steps=steps, warmup=max(3, steps // 5)
    )
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    meta = {"device": gpu, "dtype": str(torch_dtype), "geometry": geometry, "budget": budget}
    meta["torch"] = torch.__version__
    benchmark.write(records, out, meta)
    print(f"{gpu}, {geometry}, {str(torch_dtype).removeprefix('torch.')}, budget {budget:.0%} of the context\n")
    print(benchmark.markdown(records))


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


def fit() -> None:
    """Train the relevance predictor on collected shards (LightningCLI; see `atskv fit --help`).

    Typical use: `atskv fit --config configs/fit.yaml --seed_everything N` for N = 0, 1, 2."""


def finetune() -> None:
    """Fine-tune a predictor with policy gradients on rollouts through the base model
    (LightningCLI; see `atskv finetune --help`).

    Typical use: `atskv finetune --config configs/finetune.yaml --seed_everything N --model.alpha A`."""


def selectors() -> None:
    """List the registered selectors and how the hook treats each."""
    from atskv.selectors import SELECTORS

    for name, cls in sorted(SELECTORS.items()):
        kind = "keeps all" if cls.keeps_all else ("query-aware" if cls.query_aware else "query-agnostic")
        print(f"{name:15s} {kind:15s} {'evicts' if cls.evicts else ''}")


def fetch(name: str, cache_dir: Path | None = None, force: bool = False) -> None:
    """Fetch an offline corpus (austen, sotu, moby-dick) into the cache as plain-text files.

    Args:
        name: corpus name.
        cache_dir: cache folder (default $ATSKV_CACHE or ~/.cache/atskv).
        force: fetch again even if present.
    """
    from atskv.data import fetch_corpus

    path = fetch_corpus(name, cache_dir=cache_dir, force=force)
    files = sorted(path.glob("*.txt"))
    print(f"{name}: {len(files)} documents, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB in {path}")


def corpora() -> None:
    """List the corpora `atskv data fetch` knows."""
    from atskv.data import CORPORA

    for name in CORPORA:
        print(name)


COMMANDS = {
    "demo": demo,
    "generate": generate,
    "selectors": selectors,
    "data": {"fetch": fetch, "list": corpora, "_help": "Offline corpora for training and evaluation."},
    "bench": bench,
    "collect": collect_command,
    "fit": fit,
    "finetune": finetune,
    "export": export,
    "profile": {
        "kascade": kascade_profile_command,
        "_help": "Per-model profiles that selectors need (Kascade's anchor layers and head map).",
    },
    "eval": {
        "recall": eval_recall,
        "ppl": eval_ppl,
        "tasks": tasks_command,
        "peer": peer_command,
        "_help": "Measure selectors against dense attention: attention recall, perplexity, tasks.",
    },
}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["fit"]:  # Lightning's own CLI (trainer, model, data, checkpoints) takes over
            from atskv.predictor.training import fit_main

            fit_main(["fit", *argv[1:]])
            return
        if argv[:1] == ["finetune"]:  # the same for policy-gradient fine-tuning
            from atskv.rl.training import finetune_main

            finetune_main(argv[1:])
            return
        auto_cli(COMMANDS, args=argv, as_positional=True, prog="atskv")
    except (ValueError, FileNotFoundError, ImportError, TypeError) as error:
        print(f"atskv: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
