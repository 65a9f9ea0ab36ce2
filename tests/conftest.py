"""Tiny random models of every supported family, built from configs in code (no weights needed)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU (set before any @triton.jit)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from atskv.data import synthetic_filler

VOCAB = 96
# an int budget beyond every context in the tests: every token kept (1.0 is no budget: a float is a
# fraction strictly between 0 and 1)
EVERY_TOKEN = 1 << 20

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **COMMON)),
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(num_hidden_layers=4, num_key_value_heads=2, sliding_window=None, **COMMON)
    ),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=4, num_key_value_heads=2, **COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, **COMMON)),
    # Gemma 3 as the real one: 4 query heads on 1 KV head, sliding-window layers, global every 3rd here
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            sliding_window_pattern=3,
            **COMMON,
        )
    ),
}


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip where no CUDA device is present (CI runs on CPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _interpreter_too_old() -> str | None:
    """The Triton version when kernels run in Triton's interpreter (no CUDA) and it is older than
    3.9, the first whose interpreter runs them all (3.6 refuses a loaded scalar as a `range` bound,
    3.7 and 3.8 have no bf16 constants); None otherwise."""
    if torch.cuda.is_available():
        return None
    try:
        import triton
    except ImportError:
        return None
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return triton.__version__ if (major, minor) < (3, 9) else None


OLD_INTERPRETER = _interpreter_too_old()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Under an interpreter older than 3.9 (a CUDA image's Triton with the GPU hidden), a kernel
    the interpreter cannot run is a skip that says so, not a failure; every other failure stays."""
    outcome = yield
    if OLD_INTERPRETER is None or outcome.excinfo is None:
        return
    from triton.runtime.errors import InterpreterError

    if isinstance(outcome.excinfo[1], InterpreterError):
        reason = f"Triton {OLD_INTERPRETER}'s interpreter cannot run this kernel (3.9's can; on a GPU it compiles)"
        outcome.force_exception(pytest.skip.Exception(reason, _use_item_location=True))


def tiny_model(family: str, seed: int = 0):
    """A tiny random model of `family`, fp32, eval mode, SDPA attention."""
    torch.manual_seed(seed)
    model = FAMILIES[family]().eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def random_prompt(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def left_padded(family: str, tokens: int, padding: int, seed: int):
    """A tiny model that never stops at EOS, and two prompts, the second left-padded by `padding`:
    (model, ids, attention mask)."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    ids = random_prompt(tokens, seed=seed, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    ids[1, :padding] = 0
    return model, ids, mask


def tiny_bpe_tokenizer(vocab_size: int = 400, extra_texts: list[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in code (no hub) that adds a BOS token, like Llama-family tokenizers."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [synthetic_filler(2000, 0), "What is the pass key? The pass key is 0123456789", *extra_texts]
    bpe.train_from_iterator(texts, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def run_cli(args: list[str]) -> int:
    """Run the `atskv` command in-process; its exit status."""
    from atskv import cli

    try:
        cli.main(args)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


@pytest.fixture(scope="module")
def engine_mlp(tmp_path_factory):
    """A random predictor of the SmolLM2 shape (3 KV heads) that reads what the vLLM plugin shows
    it, in eval mode, its batch-norm statistics away from 0 / 1 so that folding them matters: the
    folded-MLP kernels' tests score with it."""
    from atskv.eval.vllm_speed import random_engine_predictor
    from atskv.predictor.export import load_predictor

    folder = random_engine_predictor("smollm2-135m-shape", 2, tmp_path_factory.mktemp("p") / "p")
    loaded = load_predictor(folder).mlp.eval()
    with torch.no_grad():
        loaded.scalar_norm.running_mean.uniform_(-1, 1)
        loaded.scalar_norm.running_var.uniform_(0.5, 2)
    return loaded
