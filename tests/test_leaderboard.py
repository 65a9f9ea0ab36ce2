"""The long-context leaderboard (atskv.eval.leaderboard) on a tiny random Llama: every cell in the
JSON with its settings, dense beside every row, resuming without recomputing, refusals, and the
kvpress part skipped with its message where kvpress is not installed."""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from atskv.data.tasks import TASKS
from atskv.errors import InputError
from atskv.eval import leaderboard
from atskv.eval.leaderboard import Cell, Grid, check_grid, run_leaderboard, runs
from atskv.eval.method import HOST, OWN
from atskv.models.loading import LoadedModel
from tests.conftest import run_cli, tiny_bpe_tokenizer, tiny_model

PLAN = dict(contexts=[200, 260], ratios=[0.5, 0.75], methods=["streaming_llm", "h2o"], tasks=["needle_single"])
RUN = dict(examples=2, dense_layers=1, max_new_tokens=3, progress=False)
CELLS_PER_SEED = 2 * (1 + 2 * 2)  # contexts x (dense + methods x ratios)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    base = tiny_bpe_tokenizer()
    texts = [TASKS["needle_single"](base, 300, 0.5, seed).prompt for seed in range(3)]
    tokenizer = tiny_bpe_tokenizer(vocab_size=600, extra_texts=texts)
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return LoadedModel(model, tokenizer, "tiny-llama", "test")


@pytest.fixture
def calls(monkeypatch) -> list:
    """Every `generate_batch` the leaderboard makes (one per cell here: 2 prompts, batch 8)."""
    made, real = [], runs.generate_batch

    def counted(*args, **kwargs):
        made.append(kwargs["budget"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "generate_batch", counted)
    return made


def test_grid_json_table_and_resume(loaded, calls, tmp_path):
    grid = check_grid(**PLAN, seeds=[0, 1], examples=2)
    paths = run_leaderboard(loaded, tmp_path, grid, **RUN)
    assert len(calls) == 2 * CELLS_PER_SEED
    data = json.loads(paths["json"].read_text())
    cells = data["cells"]
    assert len(cells) == 2 * CELLS_PER_SEED
    assert {(c["context"], c["seed"], c["method"], c["ratio"]) for c in cells} == {
        (n, s, m, r) for n in (200, 260) for s in (0, 1)
        for m, r in [("dense", None)] + [(m, r) for m in ("streaming_llm", "h2o") for r in (0.5, 0.75)]
    }  # fmt: skip
    for c in cells:
        assert len(c["scores"]) == len(c["texts"]) == 2 and c["prefill"] == "dense" and c["max_new_tokens"] == 3
        assert c["budget"] == (None if c["ratio"] is None else 1 - c["ratio"])
        assert c["dense_layers"] == (None if c["method"] == "dense" else 1)
    assert data["settings"]["dense_layers"] == 1 and data["settings"]["prefill"] == "dense"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["png_top"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a random model: every row near dense

    table = paths["markdown"].read_text()
    for context in (200, 260):
        assert f"### tiny-llama, {context} tokens" in table
    means, by_task = table.split(", per task at ratios", 1)  # the tables of means, then per task
    assert "### tiny-llama, 260 tokens, per task at ratios 0.5 / 0.75" in table
    assert "| method | needle_single |" in by_task
    rows = [line.split("|")[1:-1] for line in means.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r[0].strip() for r in rows] == ["dense", "streaming_llm", "h2o"] * 2
    dense = {s["context"]: s for s in data["summaries"] if s["method"] == "dense"}
    for i, context in enumerate((200, 260)):
        beside = f"{100 * dense[context]['mean']:.1f} ± {100 * dense[context]['std']:.1f}"
        assert all(r[1].strip() == beside for r in rows[3 * i : 3 * i + 3]), "dense beside every row"
        assert all(cell.strip() for r in rows[3 * i + 1 : 3 * i + 3] for cell in r[2:])
    assert "first 1 layers dense, dense prefill" in table and "budget 1 - r" in table

    calls.clear()
    again = run_leaderboard(loaded, tmp_path, grid, **RUN)
    assert calls == [] and again["markdown"].read_text() == table
    with open(tmp_path / "cells.jsonl", "a") as f:
        f.write('{"context": 200, "ta')  # a line cut by a crash
    more = check_grid(**PLAN, seeds=[0, 1, 2], examples=2)
    run_leaderboard(loaded, tmp_path, more, **RUN)
    assert len(calls) == CELLS_PER_SEED, "only the new seed's cells"
    assert len(json.loads(paths["json"].read_text())["cells"]) == 3 * CELLS_PER_SEED
    with pytest.raises(InputError, match="dense_layers: 1 there, 2 now"):
        run_leaderboard(loaded, tmp_path, more, **{**RUN, "dense_layers": 2})


def test_kvpress_is_skipped_with_a_message(loaded, calls, tmp_path, capsys):
    grid = check_grid(**{**PLAN, "contexts": [200], "methods": ["h2o", "kvpress:snapkv"]}, seeds=[0], examples=2)
    paths = run_leaderboard(loaded, tmp_path, grid, kvpress_python=tmp_path / "no" / "bin" / "python", **RUN)
    message = "kvpress methods skipped (kvpress:snapkv): no kvpress environment at"
    assert message in capsys.readouterr().err
    table = paths["markdown"].read_text()
    assert "kvpress methods skipped: no kvpress environment" in table and "setup.sh" in table
    assert "| kvpress:snapkv |  |  |  |" in table  # its row stays, empty
    assert len(calls) == 1 + 2 and {c["method"] for c in json.loads(paths["json"].read_text())["cells"]} == {
        "dense", "h2o"
    }  # fmt: skip


def test_summaries_mean_and_std_over_seeds():
    def cell(task, seed, method, ratio, score):
        return Cell(100, task, seed, method, ratio, None, None, "dense", 3, score, (score,), (98,), ("",))

    cells = [
        cell("a", 0, "h2o", 0.5, 1.0), cell("b", 0, "h2o", 0.5, 0.5),  # seed 0: 0.75
        cell("a", 1, "h2o", 0.5, 0.5), cell("b", 1, "h2o", 0.5, 0.0),  # seed 1: 0.25
        cell("a", 2, "h2o", 0.5, 1.0),  # seed 2 lacks task b: left out
        cell("a", 0, "dense", None, 1.0), cell("b", 0, "dense", None, 1.0),
    ]  # fmt: skip
    summaries = {(s.method, s.ratio): s for s in leaderboard.summarize(cells, ["a", "b"])}
    h2o = summaries["h2o", 0.5]
    assert h2o.seeds == (0, 1) and h2o.mean == 0.5 and h2o.std == pytest.approx(0.5**0.5 * 0.5)
    assert h2o.per_task == {"a": 0.75, "b": 0.25}
    grid = Grid((100,), (0.5, 0.9), ("h2o",), ("a", "b"), (0, 1))
    assert leaderboard.markdown(list(summaries.values()), grid, "m").splitlines()[2:] == [
        "| method | dense | 0.5 | 0.9 |",
        "|---|---|---|---|",
        "| dense | 100.0 (1 of 2 seeds) |  |  |",
        "| h2o | 100.0 (1 of 2 seeds) | 50.0 ± 35.4 |  |",
    ]
    three = Grid((100,), (0.5,), ("h2o",), ("a", "b"), (0, 1, 2))  # seed 2 lacks a task: said, not hidden
    assert "| h2o | 100.0 (1 of 3 seeds) | 50.0 ± 35.4 (2 of 3 seeds) |" in leaderboard.markdown(
        list(summaries.values()), three, "m"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ratios": [0.5, 1.0]}, "in (0, 1); got 1.0"),
        ({"ratios": [0.0]}, "in (0, 1); got 0.0"),
        ({"ratios": [-0.25]}, "in (0, 1); got -0.25"),
        ({"methods": ["kvpress:nope"]}, "unknown kvpress press 'nope'"),
        ({"methods": ["nope"]}, "unknown selector 'nope'"),
        ({"methods": ["tiered:nope"]}, "unknown selector 'nope'"),
        ({"methods": ["sparq+quest"]}, "'sparq' cannot decide residency"),
        ({"tasks": ["nope"]}, "unknown task 'nope'"),
        ({"seeds": []}, "--seeds is empty"),
    ],
)
def test_bad_grids_are_refused_before_any_work(change, message, tmp_path, capsys):
    plan = {**PLAN, "seeds": [0], "examples": 1, **change}
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_grid(**plan)
    args = [f"--{k}={json.dumps(v)}" for k, v in plan.items()]
    assert run_cli(["eval", "leaderboard", "--model", "/no/such/model", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


FAKE_KVPRESS = """\
import json, os, sys
argv = sys.argv[2:]
value = lambda flag: argv[argv.index(flag) + 1]
presses = argv[argv.index("--presses") + 1 : argv.index("--compression-ratios")]
ratios = [float(r) for r in argv[argv.index("--compression-ratios") + 1 : argv.index("--out")]]
with open(sys.argv[0] + ".log", "a") as log:
    log.write(" ".join(presses) + "\\n")
if os.path.exists(sys.argv[0] + ".fail") and open(sys.argv[0] + ".fail").read() in presses:
    sys.exit(1)  # as a run killed by a time limit
examples = json.load(open(value("--examples")))
json.dump([{"id": e["id"], "press": p, "compression_ratio": r, "prompt_tokens": e["n_tokens"], "kept_tokens": 0,
            "kv_bytes": 0, "new_tokens": 1, "text": e["answer"] if p == "none" else ""}
           for p in presses for r in ([0.0] if p == "none" else ratios) for e in examples], open(value("--out"), "w"))
"""


def test_kvpress_runs_a_process_a_press_so_a_failed_press_loses_only_itself(loaded, monkeypatch, tmp_path, capsys):
    """kvpress (a stand-in for its venv's python here) runs one process per press: when one fails
    (kvpress refuses KVzip for Gemma 3, or a time limit kills it) the others' cells are kept, the
    table says which failed, and the rerun runs only what is missing."""
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n" + FAKE_KVPRESS)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(loaded.model, "name_or_path", str(tmp_path / "model"))
    plan = {**PLAN, "contexts": [200], "ratios": [0.5, 0.9], "methods": ["kvpress:snapkv", "kvpress:tova"]}
    grid = check_grid(**plan, seeds=[0], examples=2)
    Path(str(python) + ".fail").write_text("snapkv")
    paths = run_leaderboard(loaded, tmp_path / "lb", grid, kvpress_python=python, **RUN)
    done = {json.loads(line)["method"] for line in (tmp_path / "lb" / "cells.jsonl").read_text().splitlines()}
    assert done == {"dense", "kvpress:none", "kvpress:tova"}
    message = "kvpress:snapkv on needle_single at 200 tokens, seed 0 (exit 1)"
    assert f"{message} failed" in capsys.readouterr().err and message in paths["markdown"].read_text()
    Path(str(python) + ".fail").unlink()
    paths = run_leaderboard(loaded, tmp_path / "lb", grid, kvpress_python=python, **RUN)
    assert Path(str(python) + ".log").read_text().splitlines() == ["none", "snapkv", "tova", "snapkv"]
    cells = {(c["method"], c["ratio"]): c["score"] for c in json.loads(paths["json"].read_text())["cells"]}
    assert cells[("kvpress:none", None)] == 1.0 and cells[("kvpress:snapkv", 0.9)] == 0.0 and len(cells) == 6
    assert "failed" not in paths["markdown"].read_text()


# the two stores that park what the GPU tier drops: (prefix, option, options reading every parked
# token back, an option changed, where the row runs, what its report note says)
STORES = [
    ("tiered", "tiering", {"retrieve": 100_000, "recent": 8, "refresh_every": 4}, ("retrieve", 64), "reference",
     "tiered:<selector>: the selector in atskv.tiered"),
    ("host", "host_tier", {"tokens": 4096, "page_size": 8}, ("tokens", 64), "fast",
     "host:<selector>: the selector on the fast path with its host tier"),
]  # fmt: skip


@pytest.mark.parametrize("prefix,option,every,changed,path,note", STORES)
def test_a_row_with_a_host_store_reads_parked_tokens_back(loaded, monkeypatch, tmp_path, capsys, prefix, option,
                                                          every, changed, path, note):  # fmt: skip
    """tiered:<selector> (the two-tier store, reference path) and host:<selector> (the fast path's
    host tier) run the selector at the same GPU budget: reading every parked token back at each
    step they write dense's text, where the selector alone does not; their options are settings a
    rerun must share, and bad ones fail before any work, as sparse prefill and a host: row whose
    selector keeps everything do."""
    taken, real = [], runs.generate_batch

    def spy(*args, **kwargs):
        taken.append("fast" if kwargs["runtime"].kind in (OWN, HOST) else "reference")
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "generate_batch", spy)
    row = f"{prefix}:streaming_llm"
    plan = {**PLAN, "contexts": [260], "ratios": [0.75], "methods": ["streaming_llm", row]}
    grid = check_grid(**plan, seeds=[0], examples=2)
    paths = run_leaderboard(loaded, tmp_path, grid, **{option: every}, **{**RUN, "max_new_tokens": 6})
    assert taken == ["fast", "fast", path]  # dense (transformers' generate), the selector alone, the row
    texts = {c["method"]: c["texts"] for c in json.loads(paths["json"].read_text())["cells"]}
    assert texts[row] == texts["dense"] != texts["streaming_llm"]
    assert note in paths["markdown"].read_text()
    key, value = changed
    refused = f"other settings .*'{key}': '{every[key]}'.* there, .*'{key}': '{value}'.* now"
    with pytest.raises(InputError, match=refused):
        run_leaderboard(loaded, tmp_path, grid, **{option: {**every, key: value}}, **{**RUN, "max_new_tokens": 6})
    with pytest.raises(InputError, match=f"--{option}: .*unexpected keyword argument 'nope'"):
        run_leaderboard(loaded, tmp_path / "bad", grid, **{option: {"nope": 1}}, **RUN)
    with pytest.raises(InputError, match=r"prefill densely \(drop --sparse_prefill\)"):
        run_leaderboard(loaded, tmp_path / "bad", grid, sparse_prefill=True, **{**RUN, "fast": False})
    if prefix == "host":  # every field of the tier is a setting, defaults included: a changed default refuses too
        settings = json.loads((tmp_path / "settings.json").read_text())["host_tier"]
        assert settings == {"tokens": "4096", "page_size": "8", "cache": "2.0", "summary": "int4"}
        with pytest.raises(InputError, match="other settings .*'summary': 'int4'.* there, .*'summary': 'bounds'"):
            run_leaderboard(loaded, tmp_path, grid, **{option: {**every, "summary": "bounds"}}, **RUN)
        quest = check_grid(**{**plan, "methods": ["host:quest"]}, seeds=[0], examples=2)
        with pytest.raises(InputError, match="host:quest: a host tier parks what an evicting selector drops"):
            run_leaderboard(loaded, tmp_path / "bad", quest, **RUN)
    assert not (tmp_path / "bad").exists()
    args = [f"--methods=[{prefix}:h2o]", f"--{option}={{nope: 1}}", "--out", str(tmp_path / "bad")]
    assert run_cli(["eval", "leaderboard", "--model", "/no/such/model", *args]) == 2  # before the model loads
    assert f"--{option}: " in capsys.readouterr().err


def test_folders_computed_in_parallel_merge_into_one_report(loaded, calls, tmp_path):
    """Two processes' folders (one seed each) give the report of one run over both seeds, and
    merging computes nothing; a folder made with other settings, or one that is not a leaderboard's,
    is refused."""
    for seed in (0, 1):
        run_leaderboard(loaded, tmp_path / f"seed{seed}", check_grid(**PLAN, seeds=[seed], examples=2), **RUN)
    whole = run_leaderboard(loaded, tmp_path / "whole", check_grid(**PLAN, seeds=[0, 1], examples=2), **RUN)
    calls.clear()
    seeds = [tmp_path / "seed0", tmp_path / "seed1", tmp_path / "seed1"]
    merged = leaderboard.merge_folders(tmp_path / "merged", seeds)
    assert calls == []
    assert len(json.loads(merged["json"].read_text())["cells"]) == 2 * CELLS_PER_SEED
    assert merged["markdown"].read_text() == whole["markdown"].read_text()
    run_leaderboard(loaded, tmp_path / "other", check_grid(**PLAN, seeds=[2], examples=2), **{**RUN, "dense_layers": 2})
    with pytest.raises(InputError, match="other settings"):
        leaderboard.merge_folders(tmp_path / "merged", [tmp_path / "other"])
    with pytest.raises(InputError, match=f"not a leaderboard folder .*: {tmp_path}$"):  # names the folder at fault
        leaderboard.merge_folders(tmp_path / "merged", [tmp_path / "seed0", tmp_path])


def test_a_run_with_other_selector_options_joins_the_report_as_labelled_rows(loaded, calls, tmp_path):
    """A variant folder (StreamingLLM with one sink instead of four, same prompts) adds its rows as
    "streaming_llm (one sink)" beside the plain ones, and its dense cells stay out; a variant that
    changes more than the selector options is refused."""
    plan = dict(PLAN, methods=["streaming_llm"], contexts=[200])
    run_leaderboard(loaded, tmp_path / "main", check_grid(**plan, seeds=[0], examples=2), **RUN)
    variant = run_leaderboard(
        loaded, tmp_path / "sink1", check_grid(**plan, seeds=[0], examples=2),
        selector_options={"streaming_llm": {"sinks": 1}}, **RUN,
    )  # fmt: skip
    merged = leaderboard.merge_folders(tmp_path / "merged", [tmp_path / "main"], {"one sink": tmp_path / "sink1"})
    data = json.loads(merged["json"].read_text())
    assert data["grid"]["methods"] == ["streaming_llm", "streaming_llm (one sink)"]
    assert data["settings"]["variants"] == {"one sink": {"selector_options": {"streaming_llm": {"sinks": "1"}}}}
    by_method = {(c["method"], c["ratio"]): c for c in data["cells"]}
    assert sum(c["method"] == "dense" for c in data["cells"]) == 1
    for cell in json.loads(variant["json"].read_text())["cells"]:
        if cell["method"] != "dense":
            assert by_method["streaming_llm (one sink)", cell["ratio"]]["texts"] == cell["texts"]
    assert "| streaming_llm (one sink) |" in merged["markdown"].read_text()
    # the merged folder (its settings record the variant) merges again with a second variant: both labels stay
    run_leaderboard(loaded, tmp_path / "sink2", check_grid(**plan, seeds=[0], examples=2),
                    selector_options={"streaming_llm": {"sinks": 2}}, **RUN)  # fmt: skip
    again = leaderboard.merge_folders(tmp_path / "again", [tmp_path / "merged"], {"two sinks": tmp_path / "sink2"})
    data = json.loads(again["json"].read_text())
    assert data["grid"]["methods"] == ["streaming_llm", "streaming_llm (one sink)", "streaming_llm (two sinks)"]
    assert set(data["settings"]["variants"]) == {"one sink", "two sinks"}
    # a later run under a label the merged folder records joins it when its options agree, else it is refused
    joined = leaderboard.merge_folders(tmp_path / "joined", [tmp_path / "merged"], {"one sink": tmp_path / "sink1"})
    one_sink = {"one sink": {"selector_options": {"streaming_llm": {"sinks": "1"}}}}
    assert json.loads(joined["json"].read_text())["settings"]["variants"] == one_sink
    for other in ("sink2", "main"):  # two sinks, or the default four, under the one-sink label
        with pytest.raises(InputError, match="'one sink'.* selector_options of streaming_llm"):
            leaderboard.merge_folders(tmp_path / other / "out", [tmp_path / "merged"], {"one sink": tmp_path / other})
    for sources in ([tmp_path / "main", tmp_path / "merged"], [tmp_path / "merged", tmp_path / "main"]):  # any order
        assert leaderboard.merge_folders(tmp_path / f"mixed-{sources[0].name}", sources)["json"].is_file()
    other = tmp_path / "deeper"
    other.mkdir()
    settings = json.loads((tmp_path / "sink1" / "settings.json").read_text())
    (other / "settings.json").write_text(json.dumps({**settings, "dense_layers": 2}))
    with pytest.raises(InputError, match="other settings .*dense_layers"):
        leaderboard.merge_folders(tmp_path / "merged2", [tmp_path / "main"], {"deeper": other})


def test_the_top_plot_holds_the_rows_near_their_own_dense():
    """A row that loses 2 points on average (one ratio 4 below) is near; one that loses 4 is not;
    a kvpress row is measured against kvpress's own dense."""
    grid = Grid((4096,), (0.5, 0.9), ("close", "far", "kvpress:p"), ("qa",), (0,))

    def at(method, ratio, mean):
        return leaderboard.Summary(4096, method, ratio, (0,), (mean,), mean, 0.0, {"qa": mean})

    summaries = [at("dense", None, 0.5), at("kvpress:none", None, 0.3), at("close", 0.5, 0.5), at("close", 0.9, 0.46),
                 at("far", 0.5, 0.46), at("far", 0.9, 0.46),
                 at("kvpress:p", 0.5, 0.29), at("kvpress:p", 0.9, 0.29)]  # fmt: skip
    assert leaderboard.near_dense(summaries, grid) == ["close", "kvpress:p"]



def test_the_plot_draws_each_environments_dense_beside_its_rows(tmp_path, monkeypatch):
    """atskv's dense, vanilla vLLM's (the plugin's rows' baseline) and kvpress's own, each a
    horizontal line of its own, labelled; a method's line over the ratios beside them."""
    import matplotlib.figure

    grid = Grid((4096,), (0.5, 0.9), ("learned", "vllm:learned", "kvpress:p"), ("qa",), (0,))

    def at(method, ratio, mean):
        return leaderboard.Summary(4096, method, ratio, (0,), (mean,), mean, 0.0, {"qa": mean})

    summaries = [at("dense", None, 0.5), at("vllm", None, 0.55), at("kvpress:none", None, 0.3),
                 at("learned", 0.5, 0.4), at("learned", 0.9, 0.3), at("vllm:learned", 0.5, 0.45)]  # fmt: skip
    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self) or save(self, *a, **k))  # fmt: skip
    leaderboard.plot(summaries, grid, "m", tmp_path / "plot.png")
    ax = figures[0].axes[0]
    flat = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if len(set(line.get_ydata())) == 1
            and line.get_label().endswith(("dense", "(dense)"))}  # fmt: skip
    assert flat == pytest.approx({"dense": 50.0, "vllm (dense)": 55.0, "kvpress:none (dense)": 30.0})


def test_the_table_marks_each_ratios_top_and_breaks_the_rows_near_dense_down_by_task():
    """Ties at the printed precision are all bold; a per-task table shows what a mean hides: two rows
    at 50 points, one from task a, the other from task b."""
    grid = Grid((4096,), (0.5, 0.9), ("x", "y", "z"), ("a", "b"), (0,))

    def at(method, ratio, a, b):
        return leaderboard.Summary(4096, method, ratio, (0,), ((a + b) / 2,), (a + b) / 2, 0.0, {"a": a, "b": b})

    summaries = [at("dense", None, 1.0, 0.0), at("x", 0.5, 1.0, 0.0), at("y", 0.5, 0.0, 1.0), at("z", 0.5, 0.5, 0.0),
                 at("x", 0.9, 0.5, 0.0), at("y", 0.9, 0.25, 0.0)]  # fmt: skip
    lines = leaderboard.markdown(summaries, grid, "m", ["x", "y"]).splitlines()
    assert "| x | 50.0 | **50.0** | **25.0** |" in lines and "| y | 50.0 | **50.0** | 12.5 |" in lines
    assert "| z | 50.0 | 25.0 |  |" in lines
    at_task = lines[lines.index("### m, 4096 tokens, per task at ratios 0.5 / 0.9") :]
    assert at_task[2:6] == ["| method | a | b |", "|---|---|---|", "| dense | 100 | 0 |", "| x | 100 / 50 | 0 / 0 |"]
    assert at_task[6] == "| y | 0 / 25 | 100 / 0 |" and not any(line.startswith("| z") for line in at_task)
    # a row over fewer seeds than the others at a ratio is not ranked, however high its one seed
    lone = leaderboard.Summary(4096, "z", 0.9, (1,), (0.9,), 0.9, 0.0, {"a": 0.9, "b": 0.9})
    two = [replace(s, seeds=(0, 1)) for s in summaries if s.ratio == 0.9]
    two_seeds = Grid((4096,), (0.9,), ("x", "y", "z"), ("a", "b"), (0, 1))
    lines = leaderboard.markdown([*two, lone], two_seeds, "m").splitlines()
    assert "| x |  | **25.0 ± 0.0** |" in lines and "| z |  | 90.0 (1 of 2 seeds) |" in lines


def test_vllm_rows_run_one_engine_a_row_and_ratio_over_every_group(loaded, calls, monkeypatch, tmp_path):
    """`vllm:<selector>` rows (an engine stand-in here: transformers' greedy decoding of the job's
    token ids, what vanilla vLLM would give) come beside vanilla vLLM, each (method, ratio) one
    engine over the prompts of every (context, task, seed); the outputs are cut to each group's
    new tokens and scored as atskv's, so the stand-in's rows score as atskv's dense; a rerun starts
    no engine."""
    import torch

    from atskv.eval import vllm_generate

    engines = []

    def engine(module, job_file, rows, check=False):
        job = vllm_generate.GenerationJob(**json.loads(Path(job_file).read_text()))
        engines.append((job.label, len(job.requests), job.max_new_tokens))
        assert module == "atskv.eval.vllm_generate" and (Path(job.model_dir) / "config.json").is_file()
        with open(rows, "a") as f:
            for r in job.requests:
                ids = torch.tensor([r["prompt_token_ids"]])
                out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job.max_new_tokens,
                                            do_sample=False, pad_token_id=0)  # fmt: skip
                f.write(json.dumps({"job": job.label, "id": r["id"], "tokens": out[0, ids.shape[1] :].tolist()}) + "\n")

    monkeypatch.setattr(vllm_generate, "engine_process", engine)
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))  # where vLLM would be: the stand-in needs none
    grid = check_grid(**{**PLAN, "methods": ["h2o", "vllm:h2o", "vllm"]}, seeds=[0], examples=2)
    assert grid.engine_rows == ["vllm:h2o"] and grid.selectors == ["h2o"]
    paths = run_leaderboard(loaded, tmp_path, grid, **{**RUN, "max_new_tokens": None})
    assert sorted(engines) == [("vllm", 4, engines[0][2]), ("vllm:h2o@0.25", 4, engines[0][2]),
                               ("vllm:h2o@0.5", 4, engines[0][2])]  # fmt: skip
    cells = {(c["context"], c["method"], c["ratio"]): c for c in json.loads(paths["json"].read_text())["cells"]}
    for context in (200, 260):
        dense = cells[context, "dense", None]
        for key in [(context, "vllm", None), (context, "vllm:h2o", 0.5), (context, "vllm:h2o", 0.75)]:
            assert cells[key]["texts"] == dense["texts"] and cells[key]["scores"] == dense["scores"], key
            assert cells[key]["max_new_tokens"] == dense["max_new_tokens"]
        assert cells[context, "vllm:h2o", 0.75]["budget"] == 0.25
        assert cells[context, "vllm:h2o", 0.5]["dense_layers"] == 1
    table = paths["markdown"].read_text()
    row = next(line for line in table.splitlines() if line.startswith("| vllm:h2o |"))
    vanilla = next(s for s in json.loads(paths["json"].read_text())["summaries"] if s["method"] == "vllm")
    assert row.split("|")[2].strip().startswith(f"{100 * vanilla['mean']:.1f}"), "vanilla vLLM beside the plugin's rows"
    engines.clear()
    run_leaderboard(loaded, tmp_path, grid, **{**RUN, "max_new_tokens": None})
    assert engines == []


def recorded_engines(monkeypatch, tmp_path, field: str) -> list[tuple]:
    """An engine stand-in that answers one token a request: the list it fills, (job label, the job's
    `field`) an engine started."""
    from atskv.eval import vllm_generate

    jobs = []

    def engine(module, job_file, rows, check=False):
        job = vllm_generate.GenerationJob(**json.loads(Path(job_file).read_text()))
        jobs.append((job.label, getattr(job, field)))
        with open(rows, "a") as f:
            for r in job.requests:
                f.write(json.dumps({"job": job.label, "id": r["id"], "tokens": [0]}) + "\n")

    monkeypatch.setattr(vllm_generate, "engine_process", engine)
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))
    return jobs


def test_the_vllm_rows_host_tier_goes_to_their_engines_and_into_the_settings(loaded, monkeypatch, tmp_path):
    """`engine_host_tier`: the sparse rows' engines free blocks and park them (vanilla's not), the
    folder records it (a rerun with another tier is refused as any changed setting is); one the
    plugin refuses (Quest parks nothing) is one line before any engine starts."""
    jobs = recorded_engines(monkeypatch, tmp_path, "host_tier")
    tier = {"regions": 2, "pages": 4}
    grid = check_grid(**{**PLAN, "contexts": [200], "ratios": [0.5], "methods": ["vllm:h2o"]}, seeds=[0], examples=2)
    run_leaderboard(loaded, tmp_path / "lb", grid, engine_host_tier=tier, **RUN)
    assert sorted(jobs) == [("vllm", None), ("vllm:h2o@0.5", tier)]
    assert json.loads((tmp_path / "lb" / "settings.json").read_text())["engine_host_tier"] == {"regions": "2",
                                                                                              "pages": "4"}
    with pytest.raises(InputError, match="settings"):
        run_leaderboard(loaded, tmp_path / "lb", grid, engine_host_tier={"regions": 3}, **RUN)
    quest = check_grid(**{**PLAN, "contexts": [200], "methods": ["vllm:quest"]}, seeds=[0], examples=2)
    jobs.clear()
    with pytest.raises(InputError, match="host_tier parks what a compacting selector frees"):
        run_leaderboard(loaded, tmp_path / "quest", quest, engine_host_tier=tier, **RUN)
    assert jobs == []


def test_engine_options_reach_the_vllm_rows_alone_and_the_settings(loaded, monkeypatch, tmp_path):
    """`engine_options` (what atskv's own selector lacks, `prompt_sample`) go over the shared
    options in the plugin rows' engines only, and into the settings and the table's notes; one for a
    selector no vllm: row runs, or that the plugin refuses, is one line before any engine."""
    jobs = recorded_engines(monkeypatch, tmp_path, "options")
    grid = check_grid(**{**PLAN, "contexts": [200], "ratios": [0.5], "methods": ["h2o", "vllm:h2o"]}, seeds=[0],
                      examples=2)  # fmt: skip
    paths = run_leaderboard(loaded, tmp_path / "lb", grid, selector_options={"h2o": {"recent_fraction": 0.25}},
                            engine_options={"h2o": {"prompt_sample": 4}}, **RUN)  # fmt: skip
    assert sorted(jobs) == [("vllm", {}), ("vllm:h2o@0.5", {"recent_fraction": 0.25, "prompt_sample": 4})]
    settings = json.loads((tmp_path / "lb" / "settings.json").read_text())
    assert settings["engine_options"] == {"h2o": {"prompt_sample": "4"}}
    assert "prompt_sample" in paths["markdown"].read_text()
    jobs.clear()
    for options, message in (({"snapkv": {"prompt_sample": 4}}, "no vllm:<selector> row runs"),
                             ({"h2o": {"sample": 4}}, "no option 'sample'")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            run_leaderboard(loaded, tmp_path / "bad", grid, engine_options=options, **RUN)
    assert jobs == []


def test_a_vllm_row_with_an_option_the_plugin_lacks_is_one_line_before_any_engine(loaded, monkeypatch, tmp_path):
    from atskv.eval import vllm_generate

    monkeypatch.setattr(vllm_generate, "engine_process", lambda *a, **k: pytest.fail("an engine started"))
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))
    grid = check_grid(**{**PLAN, "contexts": [200], "methods": ["vllm:h2o"]}, seeds=[0], examples=2)
    with pytest.raises(InputError, match="no option 'window'"):
        run_leaderboard(loaded, tmp_path, grid, selector_options={"h2o": {"window": 8}}, **RUN)


def test_vllm_rows_without_vllm_are_one_line_before_any_row_runs(loaded, calls, monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.delenv("ATSKV_VLLM_PYTHONPATH", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    grid = check_grid(**{**PLAN, "contexts": [200], "methods": ["h2o", "vllm:h2o"]}, seeds=[0], examples=2)
    with pytest.raises(InputError, match="rows need vLLM"):
        run_leaderboard(loaded, tmp_path, grid, **RUN)
    assert calls == []


def test_a_failed_engine_loses_only_its_row_and_the_table_says_so(loaded, monkeypatch, tmp_path):
    import subprocess

    from atskv.eval import vllm_generate

    def engine(module, job_file, rows, check=False):
        job = vllm_generate.GenerationJob(**json.loads(Path(job_file).read_text()))
        if job.method != "vllm":
            raise subprocess.CalledProcessError(3, "engine")
        with open(rows, "a") as f:
            for r in job.requests:
                f.write(json.dumps({"job": job.label, "id": r["id"], "tokens": [1, 2]}) + "\n")

    monkeypatch.setattr(vllm_generate, "engine_process", engine)
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))
    grid = check_grid(**{**PLAN, "contexts": [200], "ratios": [0.5], "methods": ["vllm:h2o"]}, seeds=[0], examples=2)
    paths = run_leaderboard(loaded, tmp_path, grid, **RUN)
    methods = {c["method"] for c in json.loads(paths["json"].read_text())["cells"]}
    assert methods == {"dense", "vllm"}
    assert "the vLLM engine of vllm:h2o@0.5 (exit 3)" in paths["markdown"].read_text()


def test_a_generation_job_reaches_its_engine_with_paths_as_text_and_eager(monkeypatch, tmp_path):
    """The CLI hands the learned selector its predictor as a `Path`: the job file the engine
    process reads holds it as text, and the scored (not timed) engine skips compile and graphs."""
    from atskv.eval import vllm_generate

    seen = []

    def engine(module, job_file, rows, check=False):
        seen.append(json.loads(Path(job_file).read_text()))

    monkeypatch.setattr(vllm_generate, "engine_process", engine)
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))
    job = vllm_generate.GenerationJob("vllm:learned", str(tmp_path), 0.1, 1, 4, [{"id": "a", "prompt_token_ids": [1]}],
                                      {"predictor": tmp_path / "predictor"})  # fmt: skip
    outputs, failed = vllm_generate.generate([job], tmp_path / "out.jsonl")
    assert seen[0]["options"] == {"predictor": str(tmp_path / "predictor")} and seen[0]["eager"]
    assert outputs == {} and failed == []
