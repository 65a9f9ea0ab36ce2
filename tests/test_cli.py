"""The `atskv` command line: help everywhere, clear errors before any work, the demo end to end
on a tiny random model saved as a Hugging Face directory."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atskv import cli
from atskv.learned_options import check_refresh_every
from tests.conftest import COMMON, run_cli, tiny_bpe_tokenizer

SUBCOMMANDS = ["demo", "passkey", "generate", "selectors", "collect", "fit", "finetune", "export", "ridge"]
SUBCOMMANDS += ["eval", "bench", "eval recall", "eval tasks", "eval ppl", "eval peer", "eval heldout"]
SUBCOMMANDS += ["profile kascade"]


@pytest.mark.parametrize("command", [*SUBCOMMANDS, "data fetch", "data list"])
def test_every_subcommand_has_help(command, capsys):
    assert run_cli([*command.split(), "--help"]) == 0
    assert "usage: atskv" in capsys.readouterr().out


@pytest.mark.parametrize("group", ["", "eval", "data", "bench", "profile"])
def test_the_lists_of_subcommands_show_whole_summaries(group, capsys):
    """Each listed summary is its docstring's whole first paragraph, not the first line of it."""
    import inspect

    entries = cli.COMMANDS[group] if group else cli.COMMANDS
    assert run_cli([*group.split(), "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    for name, entry in entries.items():
        if name != "_help":
            doc = entry["_help"] if isinstance(entry, dict) else entry.__doc__
            summary = " ".join(inspect.cleandoc(doc).partition("\n\n")[0].split())
            assert f"{name} {summary}" in shown, name


def test_help_names_a_path_option_s_type_plainly(capsys):
    assert run_cli(["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(required, type: Path)" in out and "<class" not in out


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("atskv.models.load_model", refuse)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["passkey", "--budget", "0"], "bad budget 0: a budget is an int"),
        (["passkey", "--budget", "1.5"], "bad budget 1.5"),
        (["passkey", "--budget", "1.0"], "bad budget 1.0"),
        (["demo", "--passkey_budget", "1.0"], "bad budget 1.0"),
        (["demo", "--baselines", "[quest2]"], "unknown selector 'quest2'"),
        (["demo", "--window_share", "1.5"], "window_share is a share of the budget, in [0, 1]; got 1.5"),
        (["eval", "tasks", "--budgets", "[64,1.0]"], "bad budget 1.0"),
        (["eval", "ppl", "--budgets", "[0.1,-2]"], "bad budget -2"),
        (["eval", "recall", "--budgets", "[64,0]"], "bad budget 0"),
        (["eval", "recall", "--selectors", "[h2o,host:h2o]"], "methods here: <selector>, tiered:<selector>"),
        (["eval", "recall", "--selectors", "[tiered:h2o2]"], "unknown selector 'h2o2'"),
        (["passkey", "--selectors", "[quest2]"], "unknown selector 'quest2'; choose one of"),
        (["generate", "hi", "--selector", "nope"], "unknown selector 'nope'"),
        (["generate", "@/no/such/prompt.txt"], "/no/such/prompt.txt: no such prompt file"),
        (["generate", "hi", "--selector", "h2o", "--predictor", "p"], "select `learned` too"),
        (["generate", "hi", "--selector", "learned", "--predictor", "/no/such"], "--predictor /no/such: no such"),
        (["generate", "hi", "--selector", "h2o", "--selector_options", "{threshold: 0.0}"],
         "selector 'h2o' has no option 'threshold'"),
        (["eval", "recall", "--selectors", "[h2o]", "--selector_options", "{learned: {threshold: 0.0}}"],
         "options given for 'learned', which is not selected"),
        (["generate", "hi", "--predictor", "p"], "need a --selector"),
        (["eval", "heldout", "--selector_options", "{threshold: 0.0}"], "selector 'h2o' has no option 'threshold'"),
        (["eval", "heldout", "--predictor", "p"], "select `learned` too"),
        (["eval", "heldout", "--supervised", "[/no/such]"], "--supervised /no/such: no exported predictor there"),
        (["eval", "heldout", "--finetuned", "/no/such"], "--finetuned /no/such: no fine-tuned predictors"),
        (["eval", "peer", "--kvpress_python", sys.executable, "--selector_options", "{bogus: 1}"],
         "selector 'snapkv' has no option 'bogus'"),
        (["eval", "peer", "--kvpress_python", sys.executable, "--our_selectors", "[learned]",
          "--predictor", "/no/such"], "--predictor /no/such: no such"),
    ],
)
def test_bad_input_fails_clearly_before_loading(args, message, capsys, no_model_loading):
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_model_path_is_a_clear_error(capsys):
    assert run_cli(["generate", "hi", "--model", "/no/such/model"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_every_bad_input_is_one_line_and_code_2(monkeypatch, capsys):
    """Errors the library does not word itself (an OS error while reading) still end in one line."""

    def fail(**kwargs):
        raise PermissionError(13, "Permission denied", "/root/secret.txt")

    monkeypatch.setitem(cli.COMMANDS, "selectors", fail)
    assert run_cli(["selectors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "atskv: error: PermissionError" in err and "/root/secret.txt" in err


def test_a_message_naming_atskv_is_not_prefixed_twice(monkeypatch, capsys):
    """The plugin's and the learned selector's options words start "atskv:" (they are read in
    vLLM's logs too); the command line says "atskv: error:" once."""

    def fail(**kwargs):
        check_refresh_every(-1)

    monkeypatch.setitem(cli.COMMANDS, "selectors", fail)
    assert run_cli(["selectors"]) == 2
    want = "atskv: error: refresh_every is a count of decode steps >= 0 (0: never after the prompt), got -1\n"
    assert capsys.readouterr().err == want


def test_ctrl_c_is_one_line_and_code_130(monkeypatch, capsys):
    def interrupted():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setitem(cli.COMMANDS, "selectors", interrupted)
    before = signal.getsignal(signal.SIGINT)  # not always Python's default: a shell or CI may ignore SIGINT
    assert run_cli(["selectors"]) == 130
    assert capsys.readouterr().err == "atskv: interrupted\n", "selectors keeps nothing: no talk of resuming"
    assert signal.getsignal(signal.SIGINT) is before, "the handler is put back"


def test_selectors_lists_the_registry(capsys):
    assert run_cli(["selectors"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ["dense", "oracle", "snapkv", "h2o", "streaming_llm"])
    assert "learned+sparq" in out  # compositions are named too
    from atskv.runtime.vllm.selection import PAGED_SELECTORS

    vllm_line = next(line for line in out.splitlines() if line.startswith("inside vLLM"))
    assert vllm_line == (f"inside vLLM (atskv[vllm], attention_backend=CUSTOM): {', '.join(sorted(PAGED_SELECTORS))}; "
                         "compositions <residency>+sparq")
    assert {"quest", "snapkv", "streaming_llm"} <= set(PAGED_SELECTORS)


def test_selectors_says_which_run_on_the_fast_path(capsys, monkeypatch):
    """Each selector's line says whether `atskv.generate` runs it (`Selector.fast_path`); a last line
    names the composition parts it runs (quest and kascade keep their structure only alone)."""
    from atskv.selectors import SELECTORS

    assert run_cli(["selectors"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line.split()[0]: line for line in out if line and not line.startswith(" ")}
    for name in ["dense", "h2o", "snapkv", "quest", "sparq", "learned", "kascade"]:
        assert SELECTORS[name].fast_path and lines[name].endswith("fast path")
    monkeypatch.setattr(SELECTORS["kascade"], "fast_path", False)
    assert run_cli(["selectors"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("kascade")][0].endswith(
        "reference only"
    )
    (fast,) = [line for line in out if line.startswith("  on the fast path:")]
    residency, attention = fast.split(": residency ")[1].split(";")[0].split(" with attention ")
    assert residency.split(", ") == ["h2o", "learned", "snapkv", "streaming_llm"]
    assert "sparq" in attention.split(", ") and "quest" not in attention.split(", ")


@pytest.fixture
def tiny_model_dir(tmp_path) -> str:
    """A tiny random Llama with the tiny BPE tokenizer, saved as a Hugging Face directory."""
    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_passkey_end_to_end_on_a_tiny_model(tiny_model_dir, capsys):
    code = run_cli(["passkey", "--model", tiny_model_dir, "--context_tokens", "300", "--budget", "32",
                "--max_new_tokens", "3", "--dense_layers", "0",
                "--selectors", "[oracle,snapkv,h2o,streaming_llm]"])
    assert code == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "MiB" in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "dense",
        "oracle@32",
        "snapkv@32",
        "h2o@32",
        "streaming_llm@32",
    ]
    held = {row.split("|")[1].strip(): float(row.split("|")[3].split()[0]) for row in rows}
    assert held["snapkv@32"] < held["dense"] / 2, "evicting selectors must hold less KV than dense"


def test_generate_runs_dense_with_a_note_when_the_budget_covers_the_context(tiny_model_dir, capsys):
    """A short prompt at the default budget (256 tokens, more than prompt plus new tokens) is the
    first thing a user tries: it runs dense, saying so in one line on stderr, not refused."""
    args = ["generate", "short prompt", "--model", tiny_model_dir, "--selector", "learned", "--max_new_tokens", "4",
            "--device", "cpu", "--chat", "false"]  # fmt: skip
    assert run_cli(args) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note: budget 256 covers the whole context")]
    assert len(notes) == 1 and notes[0].endswith("so learned would drop nothing: running dense")
    assert "[dense]" in err
    assert run_cli([*args[:5], "h2o", *args[6:], "--budget", "3"]) == 0
    assert "[h2o@3]" in capsys.readouterr().err


def test_generate_writes_only_the_completion_to_stdout(tiny_model_dir, capsys):
    """`atskv generate ... > out.txt` gets the completion alone: loading and timing lines go to stderr."""
    args = ["generate", "short prompt", "--model", tiny_model_dir, "--max_new_tokens", "4", "--device", "cpu",
            "--chat", "false"]  # fmt: skip
    assert run_cli(args) == 0
    out, err = capsys.readouterr()
    assert "loading" not in out and "loading " in err and "[dense]" in err
    from atskv.data.prompts import encode_prompt
    from atskv.eval.generation import generate_one
    from atskv.models import load_model

    loaded = load_model(tiny_model_dir, device="cpu")
    run = generate_one(loaded.model, loaded.tokenizer, encode_prompt(loaded.tokenizer, "short prompt", False),
                   max_new_tokens=4)  # fmt: skip
    assert out == run.text + "\n"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["passkey", "--budget", "abc"], "--budget takes int | float; got 'abc'"),
        (["eval", "recall", "--window_tokens", "2k"], "--window_tokens takes int; got '2k'"),
        (["generate", "hi", "--tiering", "[1"], "--tiering takes dict | None; got '[1'"),
        (["passkey", "--budgte", "3"], "unrecognized arguments: --budgte 3; see `atskv passkey --help`"),
        (["passkey", "--config", "{config}"],
         "Subcommand 'passkey' does not accept option 'budgte'; see `atskv passkey --help`"),
        (["fit", "--trainer.max_epochs", "abc"], "--trainer.max_epochs takes int | None; got 'abc'"),
        (["fit", "--config", "{config}"], "Subcommand 'fit' does not accept option 'budgte'; see `atskv fit --help`"),
        (["finetune", "--model.alpha", "x"], "--model.alpha takes float; got 'x'"),
    ],
)
def test_a_parse_error_is_one_line_naming_the_option(args, line, tmp_path, capsys, no_model_loading):
    """A value of the wrong type or a misspelt key (on the command line or in a --config file) is
    one line naming the option and what it takes, exit code 2, not jsonargparse's usage block."""
    config = tmp_path / "typo.yaml"
    config.write_text("budgte: 3\n")
    assert run_cli([arg.replace("{config}", str(config)) for arg in args]) == 2
    assert capsys.readouterr().err == f"atskv: error: {line}\n"


def test_generate_tiered_from_the_command_line(tiny_model_dir, capsys):
    """`--tiering` runs under atskv.tiered: a budget too small for sinks + recent is refused
    clearly, a workable one generates and reports the GPU-held KV."""
    prompt = " ".join(["word"] * 200)
    args = ["generate", prompt, "--model", tiny_model_dir, "--selector", "h2o", "--max_new_tokens", "4",
            "--device", "cpu", "--chat", "false"]
    assert run_cli([*args, "--budget", "40", "--tiering", "{}"]) == 2
    assert "cannot hold" in capsys.readouterr().err
    assert run_cli([*args, "--budget", "40", "--tiering", "{retreive: 8}"]) == 2  # a misspelt option
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last.startswith("atskv: error: tiering has no option 'retreive'; its options: host_path, index,")
    assert run_cli([*args, "--budget", "40", "--tiering", "{policy: {momentum: 0.0, q: 1}}"]) == 2
    assert "the tiering policy has no option 'q'" in capsys.readouterr().err
    tiering = "{sinks: 2, recent: 8, refresh_every: 4, retrieve: 8}"
    assert run_cli([*args, "--budget", "40", "--tiering", tiering, "--dense_layers", "0"]) == 0
    assert "KV held" in capsys.readouterr().err


def test_generate_tiered_with_a_composition_from_the_command_line(tiny_model_dir, capsys):
    """A composition under `--tiering`: its residency budget is the GPU tier (refused in one line
    when too small for sinks + recent), `--budget` what a query reads among it."""
    prompt = " ".join(["word"] * 200)
    args = ["generate", prompt, "--model", tiny_model_dir, "--selector", "h2o+sparq", "--budget", "8",
            "--max_new_tokens", "4", "--device", "cpu", "--chat", "false"]
    assert run_cli([*args, "--tiering", "{}"]) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]  # after the model's loading bar
    assert last.startswith("atskv: error: h2o+sparq holds its residency budget 32 on the GPU: a GPU budget of 32")
    tiering = "{sinks: 2, recent: 8, refresh_every: 4, retrieve: 8}"
    assert run_cli([*args, "--tiering", tiering, "--selector_options", "{residency_budget: 40}"]) == 0
    assert "[h2o+sparq@8]" in capsys.readouterr().err


def export_random_predictor(model_dir: str, folder=None, managed_layers=(2, 3)):
    """A random predictor for the model in `model_dir`, exported into `folder` (default: where
    `learned` finds the model's own); returns the folder."""
    from atskv.features import SCALAR_FEATURES
    from atskv.models import load_model, model_geometry
    from atskv.predictor.export import default_predictor_dir, export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP

    loaded = load_model(model_dir, device="cpu")
    config = loaded.model.config
    spec = FeatureSpec(config.hidden_size, SCALAR_FEATURES, len(managed_layers), config.num_key_value_heads)
    types = torch.zeros(config.vocab_size, dtype=torch.int8)
    folder = folder or default_predictor_dir(loaded.name)
    export_predictor(RelevanceMLP(spec, reduced_width=8, hidden=16).eval(), types, folder, base_model=loaded.name,
                     geometry=model_geometry(config), managed_layers=list(managed_layers))
    return folder


def test_generate_with_the_learned_selector_finds_the_models_predictor(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`--selector learned` uses the predictor exported for the model (as `eval` does), not a bare
    selector without one."""
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path))
    export_random_predictor(tiny_model_dir)
    prompt = " ".join(["word"] * 120)
    args = ["generate", prompt, "--model", tiny_model_dir, "--selector", "learned", "--budget", "32",
            "--max_new_tokens", "4", "--device", "cpu", "--chat", "false"]
    assert run_cli(args) == 0
    assert "[learned@32]" in capsys.readouterr().err


def check_learned_gets_its_options(args: list[str], predictor, row: str, caplog, capsys) -> None:
    """`args`, a command running `learned` with `--predictor PREDICTOR` and selector options, puts
    `row` in its output and logs the predictor it loaded; a bad value of an option then fails in
    the selector (so the options reached it)."""
    with caplog.at_level(logging.INFO, logger="atskv"):
        assert run_cli(args) == 0
    assert row in capsys.readouterr().out
    assert any(f"predictor {predictor}" in r.getMessage() for r in caplog.records)
    assert run_cli([*args, "--selector_options", "{learned: {refresh_every: -1}}"]) == 2
    assert "refresh_every is a count of decode steps >= 0" in capsys.readouterr().err


def test_eval_peer_runs_learned_with_the_given_predictor_and_options(tiny_model_dir, tmp_path, caplog, capsys):
    """`eval peer --predictor --selector_options` reach the learned selector; kvpress is a
    stand-in that returns no records."""
    kvpress = tmp_path / "python"
    kvpress.write_text(f"#!{sys.executable}\nimport sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write('[]')")
    kvpress.chmod(0o755)
    predictor = export_random_predictor(tiny_model_dir, tmp_path / "predictor", managed_layers=range(4))
    args = ["eval", "peer", "--model", tiny_model_dir, "--lengths", "[200]", "--trials", "1", "--budgets", "[0.25]",
            "--presses", "[]", "--our_selectors", "[learned]", "--predictor", str(predictor),
            "--selector_options", "{learned: {refresh_every: 4}}", "--kvpress_python", str(kvpress),
            "--max_new_tokens", "2", "--out", str(tmp_path / "out"), "--device", "cpu"]
    check_learned_gets_its_options(args, predictor, "| hook:learned@0.25 |", caplog, capsys)


def test_recall_runs_tiered_rows_through_the_two_tier_store(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from atskv.eval import recall

    asked = {}
    real = recall.attention_recall

    def spy(model, ids, selectors, budgets, **kwargs):
        asked.update(plain=[s.name for s in selectors], tiered=[s.name for s in kwargs["tiered"]])
        return real(model, ids, selectors, budgets, **kwargs)

    monkeypatch.setattr(recall, "attention_recall", spy)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The river ran past the old mill and on to the sea. " * 60)
    args = ["eval", "recall", "--model", tiny_model_dir, "--device", "cpu", "--corpus", str(corpus), "--window_tokens",
            "96", "--windows", "1", "--n_queries", "2", "--budgets", "[16]", "--selectors", "[h2o,tiered:h2o]",
            "--tiering", "{sinks: 2, recent: 4, refresh_every: 4, retrieve: 4}", "--dense_layers", "1",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert run_cli(args) == 0
    assert asked == {"plain": ["h2o"], "tiered": ["h2o"]}
    assert "tiered:h2o" in (tmp_path / "out" / "table.md").read_text()
