"""The kvpress peer check: example files, the budget mapping, the missing-venv error, scoring of
kvpress's output. Only the `slow` test runs kvpress itself (in its venv, when set up)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

import atskv.cli.eval
from atskv.data import TaskExample, filler_text
from atskv.eval import peer
from tests.conftest import tiny_bpe_tokenizer


def test_examples_json_round_trip(tmp_path):
    examples = peer.build_examples(tiny_bpe_tokenizer(), "passkey", [256, 320], trials=2)
    assert [e.id for e in examples] == ["passkey-256-0", "passkey-256-1", "passkey-320-0", "passkey-320-1"]
    assert [e.length for e in examples] == [256, 256, 320, 320]
    assert all(e.length - 8 <= e.example.n_tokens <= e.length for e in examples)
    assert len({e.example.answer for e in examples}) == 4, "every (length, trial) draws its own key"
    path = tmp_path / "sub" / "examples.json"
    peer.write_examples(path, examples)
    items = json.loads(path.read_text())
    assert {"id", "prompt", "answer"} <= set(items[0])  # what run_presses.py reads
    assert items[0]["id"] == "passkey-256-0" and items[0]["answer"] == examples[0].example.answer
    assert peer.read_examples(path) == examples
    with pytest.raises(ValueError, match="unknown task 'nope'.*passkey"):
        peer.build_examples(tiny_bpe_tokenizer(), "nope", [256], trials=1)


def test_budget_compression_ratio_mapping():
    assert peer.compression_ratio(0.1) == 0.9
    assert peer.compression_ratio(0.25) == 0.75
    assert peer.compression_ratio(0.7) == 0.3  # not 0.30000000000000004
    for budget in (0.1, 0.25, 0.3, 0.7, 0.99):
        assert peer.budget_fraction(peer.compression_ratio(budget)) == budget
    with pytest.raises(ValueError, match="fractions of the prompt"):
        peer.compression_ratio(256)  # a valid budget, but tokens: kvpress takes fractions only
    for bad in (1.0, 0.0, 1.5, -0.1, True):  # not budgets at all (atskv.budget.check_budget)
        with pytest.raises(ValueError, match=f"bad budget {bad!r}"):
            peer.compression_ratio(bad)
    for ratio in (1.0, 0.0):
        with pytest.raises(ValueError, match="compression ratio"):
            peer.budget_fraction(ratio)


def test_missing_venv_fails_first_with_the_setup_command(tmp_path, monkeypatch):
    python = tmp_path / "venvs" / "kvpress" / "bin" / "python"
    with pytest.raises(peer.KvpressNotInstalled) as error:
        peer.check_kvpress(python)
    message = str(error.value)
    assert f"bash {peer.KVPRESS_SETUP} {tmp_path / 'venvs' / 'kvpress'}" in message
    assert peer.KVPRESS_SETUP.is_file() and peer.KVPRESS_SCRIPT.is_file()

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the kvpress venv was checked")

    monkeypatch.setattr("atskv.models.load_model", no_model)
    with pytest.raises(peer.KvpressNotInstalled, match="setup.sh"):
        atskv.cli.eval.peer(kvpress_python=python, out=tmp_path / "out")


EXAMPLES = [
    peer.PeerExample("a", 104, TaskExample("prompt a", ("12345",), ((1, 5),), 100)),
    peer.PeerExample("b", 208, TaskExample("prompt b", ("67890",), ((1, 5),), 200)),
]
PER_TOKEN = {"a": 10.0, "b": 10.0}


def record(id_, press, ratio, text, kept_tokens, new_tokens=4):
    prompt = {"a": 100, "b": 200}[id_]
    held = kept_tokens + new_tokens - 1
    return {
        "id": id_, "press": press, "compression_ratio": ratio, "prompt_tokens": prompt,
        "kept_tokens": kept_tokens, "kv_bytes": int(held * PER_TOKEN[id_]), "new_tokens": new_tokens, "text": text,
    }  # fmt: skip


def test_scoring_a_fake_kvpress_output():
    records = [
        record("a", "none", 0.0, " 12345. Remember", 100),
        record("b", "none", 0.0, " 67890.", 200),
        record("a", "snapkv", 0.9, " 123456.", 10),  # a longer number is not the answer
        record("b", "snapkv", 0.9, "It is 67890", 20),
        record("a", "tova", 0.75, " 1000", 25),
        record("b", "tova", 0.75, " 67890", 50),
    ]
    runs = peer.score_kvpress(records, EXAMPLES, PER_TOKEN)
    by_label = {(r.label, r.example_id): r for r in runs}
    assert [by_label["kvpress:none", i].score for i in "ab"] == [1.0, 1.0]
    assert [by_label["kvpress:snapkv@0.1", i].score for i in "ab"] == [0.0, 1.0]
    assert by_label["kvpress:snapkv@0.1", "a"].budget == 0.1
    assert by_label["kvpress:none", "a"].budget is None
    assert by_label["kvpress:none", "b"].kv_fraction == pytest.approx(1.0)
    assert by_label["kvpress:tova@0.25", "a"].kv_fraction == pytest.approx(28 / 103)

    ours = [
        peer.PeerRun("dense", None, "a", 104, 1.0, 1.0, "12345"),
        peer.PeerRun("dense", None, "b", 208, 0.0, 1.0, "1"),
        peer.PeerRun("hook:snapkv", 0.1, "a", 104, 1.0, 0.12, "12345"),
        peer.PeerRun("hook:snapkv", 0.1, "b", 208, 1.0, 0.11, "67890"),
    ]
    rows = peer.summarize(runs + ours)
    assert [r.label for r in rows] == [
        "dense", "kvpress:none", "hook:snapkv@0.1", "kvpress:snapkv@0.1", "kvpress:tova@0.25",
    ]  # fmt: skip
    snap = rows[3]
    assert (snap.solved, snap.trials, snap.accuracy) == (1, 2, 0.5)
    assert snap.accuracy_by_length == {104: 0.0, 208: 1.0}
    assert rows[2].kv_fraction == pytest.approx(0.115)
    table = peer.markdown_table(rows)
    assert table.splitlines()[0] == "| method@budget | accuracy | acc @104 tok | acc @208 tok | KV held vs dense |"
    assert "| kvpress:snapkv@0.1 | 50% (1/2) | 0% | 100% |" in table
    assert "| dense | 50% (1/2) | 100% | 0% | 100.0% |" in table

    mismatched = [{**records[0], "prompt_tokens": 101}]
    with pytest.raises(ValueError, match="tokenize differently"):
        peer.score_kvpress(mismatched, EXAMPLES, PER_TOKEN)


def test_run_kvpress_passes_ratios_and_reads_records(tmp_path):
    """A stand-in for the venv's python: records its command line, writes one record per ratio."""
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "argv = sys.argv[1:]\n"
        "json.dump(argv, open(sys.argv[0] + '.argv', 'w'))\n"
        "ratios = argv[argv.index('--compression-ratios') + 1 : argv.index('--out')]\n"
        "out = argv[argv.index('--out') + 1]\n"
        "json.dump([{'compression_ratio': float(r)} for r in ratios], open(out, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    records = peer.run_kvpress(
        fake, tmp_path / "ex.json", tmp_path / "model", ["none", "snapkv", "tova"], [0.1, 0.25], tmp_path / "kv.json",
        max_new_tokens=5, device="cpu", dtype="float32",
    )  # fmt: skip
    assert records == [{"compression_ratio": 0.9}, {"compression_ratio": 0.75}]
    argv = json.loads(Path(str(fake) + ".argv").read_text())
    assert argv[0] == str(peer.KVPRESS_SCRIPT)
    assert argv[argv.index("--presses") + 1 : argv.index("--compression-ratios")] == ["none", "snapkv", "tova"]
    assert argv[argv.index("--max-new-tokens") + 1] == "5"


SMOLLM2_DIR = Path(os.environ.get("ATSKV_CACHE") or "~/.cache/atskv").expanduser() / "models" / "smollm2-135m"


@pytest.mark.slow
def test_real_kvpress_on_smollm2(tmp_path):
    """kvpress in its venv on SmolLM2: full KV gives atskv's dense answer token for token, and a
    press keeps int(T * (1 - ratio)) tokens per layer."""
    python = peer.default_kvpress_python()
    if not python.is_file() or not (SMOLLM2_DIR / "config.json").is_file():
        pytest.skip("needs the kvpress venv (benchmarks/peer_kvpress/setup.sh) and SmolLM2 converted by `atskv demo`")
    from atskv.data.prompts import encode_prompt
    from atskv.eval.generation import generate_one
    from atskv.models import load_model

    loaded = load_model(SMOLLM2_DIR)
    examples = peer.build_examples(loaded.tokenizer, "passkey", [384], trials=1, filler=filler_text("classic"))
    peer.write_examples(tmp_path / "ex.json", examples)
    records = peer.run_kvpress(
        python, tmp_path / "ex.json", SMOLLM2_DIR, ["none", "snapkv"], [0.5], tmp_path / "kv.json",
        max_new_tokens=8, device="cpu", dtype="float32",
    )  # fmt: skip
    key, example = examples[0].id, examples[0].example
    dense = generate_one(loaded.model, loaded.tokenizer, encode_prompt(loaded.tokenizer, example.prompt, chat=False),
                     max_new_tokens=8, example=example)  # fmt: skip
    none, snap = records
    assert none["press"] == "none" and none["text"] == dense.text and dense.correct
    assert none["prompt_tokens"] == dense.prompt_tokens == example.n_tokens
    assert snap["press"] == "snapkv" and snap["kept_tokens"] == int(example.n_tokens * 0.5)
    per_token = {key: peer.dense_bytes_per_token(dense.kv_bytes, dense.prompt_tokens, dense.new_tokens)}
    scored = peer.score_kvpress(records, examples, per_token)
    assert scored[0].kv_fraction == pytest.approx(1.0)
    assert scored[1].kv_fraction == pytest.approx(0.5, abs=0.02)


@pytest.mark.slow
def test_kvpress_compresses_only_gemma3_global_layers(tmp_path):
    """kvpress's Gemma 3 rule (sliding-window layers keep their own cache) holds for the text-only
    Gemma3ForCausalLM too (`run_presses.press_on`): at ratio 0.5 only the 2 global layers of the
    tiny 6-layer Gemma 3 lose half the prompt, so the mean kept per layer drops by 2/6 of that, for
    SnapKV and for the two presses that failed on Gemma 3 before (observed and expected attention);
    the sliding-window layers hold only their window."""
    from tests.conftest import tiny_model

    python = peer.default_kvpress_python()
    if not python.is_file():
        pytest.skip("needs the kvpress venv (benchmarks/peer_kvpress/setup.sh)")
    model, tokenizer = tiny_model("gemma3"), tiny_bpe_tokenizer()
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(tmp_path / "gemma3")
    tokenizer.save_pretrained(tmp_path / "gemma3")
    examples = peer.build_examples(tokenizer, "passkey", [256], trials=1)
    peer.write_examples(tmp_path / "ex.json", examples)
    none, *pressed = peer.run_kvpress(
        python, tmp_path / "ex.json", tmp_path / "gemma3", ["none", "snapkv", "observed_attention",
        "expected_attention"], [0.5], tmp_path / "kv.json", max_new_tokens=2, device="cpu", dtype="float32",
    )  # fmt: skip
    tokens = none["prompt_tokens"]
    # the 4 sliding-window layers keep their 8-token window (a cache built from the config), as under
    # generate: the full cache's bytes would count tokens those layers never attend
    assert none["kept_tokens"] <= (2 * tokens + 4 * 8) / 6
    for run in pressed:  # observed attention (eager prefill) decodes too; expected attention rotates
        assert run["kept_tokens"] == pytest.approx(none["kept_tokens"] - 2 * (tokens - int(tokens * 0.5)) / 6)
        assert run["new_tokens"] == 2
