"""Every `atskv` command the README shows, and the one each `configs/*.yaml` names in its first
line, runs as written, with toy sizes appended (options given twice: the last wins) on a tiny
random model saved under the default model's name; the README's Python snippets run too, with
toy sizes swapped in; so examples cannot rot unnoticed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atskv.data import synthetic_filler
from tests.conftest import COMMON, run_cli, tiny_bpe_tokenizer
from tests.test_cli import export_random_predictor

ROOT = Path(__file__).resolve().parent.parent
TOY_CORPUS = "corpus"  # a folder of .txt files in the workspace, for every corpus name
TINY = "models/smollm2-135m"  # the tiny model: its folder name is the default model's, as the configs' paths expect
CORPUS = ["--corpus", TOY_CORPUS]
# per command: options appended for toy sizes; the model and the corpus are swapped in every command that takes them
TOY = {
    "demo": [*CORPUS, "--heldout", TOY_CORPUS, "--windows", "2", "--window_tokens", "300", "--epochs", "1",
             "--passkey_budget", "32", "--recall_budgets", "[16]", "--device", "cpu"],
    "passkey": ["--context_tokens", "200", "--budget", "32", "--max_new_tokens", "2", "--device", "cpu"],
    "generate": ["--max_new_tokens", "2", "--device", "cpu", "--chat", "false"],
    "collect": [*CORPUS, "--windows", "2", "--window_tokens", "96", "--decision_points", "[0.5]",
                "--future_queries", "8", "--topk", "8", "--device", "cpu"],
    "fit": ["--data.num_workers", "0", "--data.batch_size", "256", "--data.validation_fraction", "0.5",
            "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"],
    "export": [],
    "ridge": ["--alphas", "[1.0]"],
    "finetune": ["--model.model", TINY, "--data.corpus", TOY_CORPUS, "--data.windows", "2",
                 "--data.context_tokens", "64", "--data.continuation_tokens", "4", "--data.tasks", "[]",
                 "--data.task_examples", "0",
                 "--model.samples", "2", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false"],
    "profile kascade": [*CORPUS, "--windows", "2", "--window_tokens", "96", "--queries", "8", "--topk", "8",
                        "--n_anchors", "2", "--device", "cpu"],
    "eval recall": [*CORPUS, "--window_tokens", "96", "--windows", "2", "--n_queries", "4", "--budgets", "[16]",
                    "--tiering", "{retrieve: 4, index: exact, recent: 8, refresh_every: 4}", "--device", "cpu"],
    "eval tasks": ["--tasks", "[passkey]", "--lengths", "[200]", "--depths", "[0.5]", "--trials", "1",
                   "--budgets", "[0.1]", "--device", "cpu"],
    "eval leaderboard": ["--methods", "[h2o,learned]", "--contexts", "[200]", "--ratios", "[0.9]",
                         "--tasks", "[passkey]", "--seeds", "[0]", "--examples", "1", "--device", "cpu"],
    "selectors": [],
}
NOT_HERE = {"data fetch"}  # needs the network (apt or npm)
# the README's Python snippets: text swapped for toy sizes (each must still be found in a snippet)
PYTHON_TOY = {
    'load_model("smollm2-135m")': f"load_model({TINY!r})",
    "DemoPlan(windows=8, epochs=4)": f"DemoPlan(corpus={TOY_CORPUS!r}, heldout={TOY_CORPUS!r}, windows=2, "
    "window_tokens=300, epochs=1, passkey_budget=32, recall_budgets=(16,))",
    '"...a long prompt..."': repr(synthetic_filler(520, seed=3)),  # ~940 tokens: 10% holds the tiers
}


def shown_commands() -> list[str]:
    """`atskv ...` lines of the README's bash blocks and the first line of every config."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines()]
    lines += [path.read_text().splitlines()[0].lstrip("# ") for path in sorted((ROOT / "configs").glob("*.yaml"))]
    return [line.split("  #")[0].split("   (")[0].strip() for line in lines if line.strip().startswith("atskv ")]


def command_name(argv: list[str]) -> str:
    two = " ".join(argv[1:3])
    return two if two in TOY or two in NOT_HERE else argv[1]


def toy_argv(line: str) -> list[str]:
    argv = shlex.split(line)
    name = command_name(argv)
    extra = list(TOY[name])
    if name not in ("fit", "finetune", "selectors"):
        extra += ["--model", TINY]
    here = {"configs/": f"{ROOT}/configs/", "results/demo/predictor": "cache/predictors/smollm2-135m"}
    for old, new in here.items():
        argv = [a.replace(old, new) for a in argv]
    return argv[1:] + extra


def python_snippets(readme: str) -> list[str]:
    """The README's ```python blocks."""
    return re.findall(r"```python\n(.*?)```", readme, re.S)


def run_snippets(snippets: list[str], toy: dict[str, str]) -> None:
    """Run the snippets in order in one namespace, as a reader pastes them into one session (a
    later one uses the model an earlier one loaded), each with `toy`'s swaps made."""
    namespace = {}
    for i, snippet in enumerate(snippets, 1):
        for old, new in toy.items():
            snippet = snippet.replace(old, new)
        exec(compile(snippet, f"README.md python snippet {i}", "exec"), namespace)


def build_workspace(root: Path) -> Path:
    """The tiny model, a toy corpus and a long prompt file in `root`."""
    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(root / TINY)
    tokenizer.save_pretrained(root / TINY)
    (root / TOY_CORPUS).mkdir()
    for i in range(2):
        (root / TOY_CORPUS / f"doc{i}.txt").write_text(synthetic_filler(1500, seed=i))
    (root / "long.txt").write_text(synthetic_filler(900, seed=3))  # ~1600 tokens: 10% holds the tiers
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding the tiny model, a toy corpus and a long prompt file, with the cache inside."""
    return build_workspace(tmp_path_factory.mktemp("readme"))


def runnable_commands() -> list[str]:
    """The shown commands that run here, those that make the predictor the `learned` selector
    then finds first."""
    first = ["collect", "fit", "export"]
    names = {line: command_name(shlex.split(line)) for line in shown_commands()}
    chosen = [line for line, name in names.items() if name not in NOT_HERE]
    return sorted(chosen, key=lambda line: first.index(names[line]) if names[line] in first else len(first))


def test_the_readme_and_the_configs_show_commands():
    names = {command_name(shlex.split(line)) for line in shown_commands()}
    assert {"demo", "generate", "collect", "fit", "export", "eval recall"} <= names
    assert names <= set(TOY) | NOT_HERE, f"a command without toy sizes: {names - set(TOY) - NOT_HERE}"


def test_every_shown_command_runs_at_toy_sizes(workspace, monkeypatch, capsys):
    """About 30 s on 2 cores: every command, the demo's whole pipeline included."""
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("ATSKV_CACHE", str(workspace / "cache"))
    for line in runnable_commands():
        code = run_cli(toy_argv(line))
        assert code == 0, f"{line!r} exited with {code}: {capsys.readouterr().err[-2000:]}"


def test_the_readme_python_snippets_run_at_toy_sizes(tmp_path, monkeypatch):
    """A few seconds: the demo's pipeline, atskv.sparse with snapkv and learned (by name and from
    the demo's export), the fast path and the tiers, in a workspace of their own."""
    snippets = python_snippets((ROOT / "README.md").read_text())
    stale = [old for old in PYTHON_TOY if not any(old in snippet for snippet in snippets)]
    assert len(snippets) >= 3 and not stale, f"toy swaps the README's snippets no longer contain: {stale}"
    monkeypatch.chdir(build_workspace(tmp_path))
    monkeypatch.setenv("ATSKV_CACHE", str(tmp_path / "cache"))
    export_random_predictor(TINY)  # the model's own, which "learned" by name finds (the shipped one is SmolLM2's)
    run_snippets(snippets, PYTHON_TOY)


def test_a_broken_python_snippet_fails():
    with pytest.raises(NameError, match="undefined_name"):
        run_snippets(["x = 1", "print(undefined_name)"], {})
