"""`atskv demo`, `atskv passkey`, `atskv generate` and `atskv selectors`: run a model with a
selector and look."""

from __future__ import annotations

import sys
from pathlib import Path

from atskv.cli.common import check_selection, load, load_with_selectors, quiet_lightning, selector_help
from atskv.models import DEFAULT_MODEL


def demo(
    model: str = DEFAULT_MODEL,
    out: Path = Path("results/demo"),
    corpus: str = "austen",
    windows: int = 8,
    window_tokens: int = 2048,
    epochs: int = 4,
    heldout: str = "moby-dick",
    baselines: list[str] = ["snapkv", "h2o"],  # noqa: B006 (jsonargparse reads it)
    passkey_budget: int | float = 256,
    recall_budgets: list[int] = [64, 256],  # noqa: B006
    window_share: float = 0.5,
    device: str = "auto",
    dtype: str = "auto",
) -> Path:
    """The main job end to end: collect training data, fit a predictor, export it, and compare it
    with dense KV and baselines on pass-key retrieval and held-out attention recall.

    With the defaults: about 4 minutes and 0.4 GB of disk on a 2-core CPU; a rerun into OUT
    resumes the collection.

    Args:
        model: a named model, a Hugging Face directory or a .gguf file.
        out: output folder (collection, checkpoint, predictor, pass-key and recall reports).
        corpus: training text (a corpus name, a folder of .txt files, or hf:NAME[:split]).
        windows: training windows (about 52 MB of shards each at 2048 tokens on SmolLM2-135M).
        window_tokens: tokens per window, also the pass-key prompt's and the recall windows' length.
        epochs: training epochs.
        heldout: text for the recall comparison, not trained on.
        baselines: selectors the predictor is compared with.
        passkey_budget: KV tokens kept per layer and KV head in the pass-key runs (or a fraction).
        recall_budgets: budgets (tokens) of the recall comparison.
        window_share: share of the learned selector's budget pinned to what the prompt's last 32
            queries attend most (`LearnedSelector.window_share`; 0: the predictor alone).
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU).
    """
    from atskv.eval.pipeline import DemoPlan, run_demo

    plan = DemoPlan(corpus, windows, window_tokens, epochs, heldout, recall_budgets=tuple(recall_budgets),
                    passkey_budget=passkey_budget, baselines=tuple(baselines), window_share=window_share)
    plan.check()
    quiet_lightning()
    loaded = load(model, device, dtype)
    result = run_demo(loaded, out, plan, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"\n{result.table}\n")
    width = max(map(len, result.paths))
    print("wrote:\n" + "\n".join(f"  {kind:<{width}}  {path}" for kind, path in result.paths.items()))
    return Path(out)


def passkey(
    model: str = DEFAULT_MODEL,
    context_tokens: int = 2048,
    depth: float = 0.5,
    seed: int = 0,
    selectors: list[str] = ["learned", "oracle", "snapkv", "h2o", "streaming_llm"],  # noqa: B006 (jsonargparse reads it)
    budget: int | float = 256,
    dense_layers: int = 2,
    max_new_tokens: int = 12,
    filler: str = "classic",
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Pass-key retrieval in a ~2K-token haystack, dense KV against each selector at a budget.

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
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU).
    """
    from atskv.data import filler_text, passkey_example
    from atskv.data.prompts import encode_prompt
    from atskv.eval.generation import generate_one, markdown_table

    haystack = filler_text(filler)
    loaded, chosen = load_with_selectors(model, device, dtype, selectors, [budget], predictor, selector_options)
    example = passkey_example(loaded.tokenizer, context_tokens, depth, seed, filler=haystack)
    ids = encode_prompt(loaded.tokenizer, example.prompt, chat=False)  # the prompt ends "The pass key is"
    print(f"passkey {example.answer} at depth {depth:.0%} of a {ids.shape[1]}-token prompt; budget {budget}")
    runs = []
    for selector in [None, *chosen]:
        run = generate_one(
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
    predictor: Path | None = None,
    selector_options: dict | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Generate a completion of PROMPT, dense or with a selector at a KV budget.

    Args:
        prompt: the prompt text, or @FILE to read it from a file.
        model: a named model, a Hugging Face directory or a .gguf file.
        selector: a selector name (see `atskv selectors`); none for dense KV.
        budget: KV tokens kept per layer and KV head (int), or a fraction of the context (float);
            a token budget that covers prompt and new tokens runs dense, with a note.
        dense_layers: the first layers stay dense.
        sparse_prefill: select during the prompt too (default: dense prefill, sparse decode).
        max_new_tokens: tokens to generate.
        chat: wrap the prompt in the model's chat template, if it has one.
        tiering: run under `atskv.tiered` (GPU/host KV tiers) with these `TieringConfig` options,
            e.g. '{retrieve: 64, index: faiss}' ('{}' for the defaults); none: `atskv.sparse`.
        predictor: {PREDICTOR_HELP}.
        selector_options: {OPTIONS_HELP}.
        device: cpu, cuda, or auto.
        dtype: float32, bfloat16, float16, or auto.
    """
    from atskv.data.prompts import encode_prompt
    from atskv.errors import InputError
    from atskv.eval.generation import Runtime, generate_one
    from atskv.selectors import selector_options as by_name
    from atskv.selectors import selectors_for_model

    if prompt.startswith("@"):
        if not Path(prompt[1:]).is_file():
            raise InputError(f"{prompt[1:]}: no such prompt file")
        prompt = Path(prompt[1:]).read_text()
    if selector is None and (predictor or selector_options):
        raise InputError("--predictor and --selector_options need a --selector")
    if selector is not None:
        check_selection([selector], budget)
        options = by_name([selector], selector_options, predictor)
    loaded = load(model, device, dtype)
    ids = encode_prompt(loaded.tokenizer, prompt, chat)
    whole = ids.shape[1] + max_new_tokens
    if selector is not None and isinstance(budget, int) and budget >= whole:
        print(f"note: budget {budget} covers the whole context ({whole} tokens: prompt plus {max_new_tokens} new), "
              f"so {selector} would drop nothing: running dense", file=sys.stderr)
        selector = None
    run = generate_one(
        loaded.model,
        loaded.tokenizer,
        ids,
        selector=selectors_for_model([selector], loaded.name, options)[0] if selector else None,
        budget=budget if selector else None,
        dense_layers=dense_layers,
        max_new_tokens=max_new_tokens,
        runtime=Runtime.reference(sparse_prefill, tiering),
    )
    print(run.text)
    print(
        f"\n[{run.label}] {run.prompt_tokens} prompt tokens in {run.prefill_seconds:.2f} s, {run.new_tokens} new "
        f"at {run.decode_tokens_per_s:.1f} tokens/s, KV held {run.kv_bytes / 2**20:.2f} MiB",
        file=sys.stderr,
    )


def selectors() -> None:
    """List the registered selectors, how the hook treats each, which run on `atskv.generate`'s
    fast path (the others: `atskv.sparse` with `model.generate`, the reference path) and which run
    inside vLLM through the plugin."""
    from atskv.selectors import SELECTORS
    from atskv.selectors.hybrid import check_parts, parts_have_fast_path

    for name, cls in sorted(SELECTORS.items()):
        kind = "keeps all" if cls.keeps_all else ("query-aware" if cls.query_aware else "query-agnostic")
        fast = "fast path" if cls.fast_path else "reference only"
        print(f"{name:15s} {kind:15s} {'evicts' if cls.evicts else '':6s}  {fast}")
    print("compositions: residency+attention, e.g. learned+sparq, h2o+oracle (an evicting query-agnostic "
          "part holds residency_budget tokens; a query-aware part attends the budget among them)")

    def fast_pair(residency: str, attention: str) -> bool:
        """Whether `residency+attention` runs on the fast path, from the parts' classes."""
        try:
            check_parts(SELECTORS[residency], SELECTORS[attention])
        except ValueError:  # cannot play that role
            return False
        return parts_have_fast_path(SELECTORS[residency], SELECTORS[attention])

    residency = [name for name in sorted(SELECTORS) if fast_pair(name, "oracle")]
    attention = [name for name in sorted(SELECTORS) if fast_pair("h2o", name)]
    print(f"  on the fast path: residency {', '.join(residency)} with attention {', '.join(attention)}; "
          "every composition runs on the reference path and under atskv.tiered")
    from atskv.runtime.vllm.selection import PAGED_SELECTORS

    print(f"inside vLLM (atskv[vllm], attention_backend=CUSTOM): {', '.join(sorted(PAGED_SELECTORS))}; "
          "compositions <residency>+sparq")


selector_help(passkey, generate)
COMMANDS = {"demo": demo, "passkey": passkey, "generate": generate, "selectors": selectors}
