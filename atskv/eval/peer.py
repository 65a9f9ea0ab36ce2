"""The peer check: NVIDIA kvpress's presses beside atskv's selectors, on the same model, the same
task prompts and the same budgets, as an external check of our baseline numbers.

kvpress pins an older transformers than atskv's, so it runs in a venv of its own
(`benchmarks/peer_kvpress/setup.sh`) through its script `run_presses.py`; the two sides meet
only in JSON files: the examples going out, kvpress's generations coming back, scored here with
the same `TaskExample.score` as ours.

How the two are made comparable (the settings that change results):
- budgets are fractions of the prompt; kvpress's `compression_ratio` is `1 - budget`;
- the whole prompt, question included, is compressed on both sides;
- kvpress compresses every layer, so atskv runs with `dense_layers=0` here (its default keeps
  the first 2 layers dense);
- both prefill densely and generate the first token from the full prompt; kvpress then cuts the
  cache once, atskv's evicting selectors keep `ceil(budget * context)` tokens at every step;
- each side uses its own defaults for a method's parameters (e.g. SnapKV: kvpress window 64,
  average pooling 5; atskv window 32, max pooling 7, as the paper's code).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from atskv.budget import check_budget
from atskv.data import TaskExample
from atskv.errors import InputError
from atskv.eval.method import DENSE, HOOK, KVPRESS, OWN, Method, check_methods
from atskv.eval.report import write_report
from atskv.paths import default_cache_dir
from atskv.selectors.base import Selector

PEER_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_kvpress"
KVPRESS_SCRIPT = PEER_DIR / "run_presses.py"
KVPRESS_SETUP = PEER_DIR / "setup.sh"


class KvpressNotInstalled(FileNotFoundError):
    """The kvpress venv (or its script) is missing; the message says how to set it up."""


def compression_ratio(budget: float) -> float:
    """kvpress's compression ratio (fraction of the prompt's KV removed) for an atskv budget given
    as a fraction of the prompt kept (a float budget, `check_budget`: strictly between 0 and 1);
    rounded so that 0.7 maps to 0.3, not 0.30000000000000004."""
    check_budget(budget)
    if not isinstance(budget, float):
        raise InputError(f"peer budgets are fractions of the prompt (floats strictly between 0 and 1), got {budget!r}")
    return round(1.0 - budget, 12)


def budget_fraction(ratio: float) -> float:
    """The inverse of `compression_ratio`."""
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"a compression ratio lies strictly between 0 and 1, got {ratio!r}")
    return round(1.0 - ratio, 12)


# --- examples ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerExample:
    """A task example with its id and the prompt length it was asked for (its real length,
    `example.n_tokens`, falls a few tokens short)."""

    id: str
    length: int
    example: TaskExample


def build_examples(
    tokenizer, task: str, lengths: list[int], trials: int, filler: str | None = None
) -> list[PeerExample]:
    """`trials` examples per length from the task registry, with ids `task-length-trial`; the
    needle depths spread evenly over (0, 1) and every (length, trial) has its own seed."""
    from atskv.data import TASKS

    try:
        builder = TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}") from None
    return [
        PeerExample(f"{task}-{n}-{t}", n, builder(tokenizer, n, (t + 0.5) / trials, 1000 * n + t, filler=filler))
        for n in lengths
        for t in range(trials)
    ]


def write_examples(path: Path, examples: list[PeerExample]) -> None:
    """The examples as the JSON list `run_presses.py` reads (`id`, `prompt`, `answer`), with the
    rest of each example so that `read_examples` gives them back whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    items = [{"id": e.id, "length": e.length, "answer": e.example.answer, **asdict(e.example)} for e in examples]
    path.write_text(json.dumps(items, indent=1))


def read_examples(path: Path) -> list[PeerExample]:
    return [
        PeerExample(
            item["id"],
            item["length"],
            TaskExample(
                item["prompt"],
                tuple(item["answers"]),
                tuple(tuple(span) for span in item["needle_token_ranges"]),
                item["n_tokens"],
            ),
        )
        for item in json.loads(Path(path).read_text())
    ]


# --- kvpress -----------------------------------------------------------------------------------


def default_kvpress_python() -> Path:
    return default_cache_dir() / "venvs" / "kvpress" / "bin" / "python"


def check_kvpress(python: Path) -> None:
    """Fail early, with the set-up command, when the kvpress venv or its script is missing."""
    if not KVPRESS_SCRIPT.is_file():
        raise KvpressNotInstalled(
            f"{KVPRESS_SCRIPT} is missing: the peer check runs from a source checkout of atskv"
        )
    if not Path(python).is_file():
        venv = Path(python).parent.parent
        raise KvpressNotInstalled(
            f"no kvpress environment at {venv} (python {python} not found). Create it with:\n"
            f"  bash {KVPRESS_SETUP} {venv}"
        )


def run_kvpress(
    python: Path,
    examples_path: Path,
    model_dir: Path,
    presses: list[str],
    budgets: list[float],
    out_path: Path,
    *,
    max_new_tokens: int,
    device: str,
    dtype: str,
) -> list[dict]:
    """Run `run_presses.py` in the kvpress venv on `presses` (`none`: its full-KV run) at each
    budget and return its records; its output streams through so that progress shows."""
    check_kvpress(python)
    command = [
        str(python), str(KVPRESS_SCRIPT),
        "--examples", str(examples_path),
        "--model", str(model_dir),
        "--presses", *presses,
        "--compression-ratios", *(str(compression_ratio(b)) for b in budgets),
        "--out", str(out_path),
        "--max-new-tokens", str(max_new_tokens),
        "--device", device,
        "--dtype", dtype,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads(Path(out_path).read_text())


# --- scoring and the table -----------------------------------------------------------------------


@dataclass(frozen=True)
class PeerRun:
    """One generation of one example: `method` is `dense`, `hook:NAME` (atskv's reference hook)
    or `kvpress:NAME`;
    `score` is `TaskExample.score` (the fraction of the answers found); `kv_fraction` the KV held
    after generation over what full KV holds for as many tokens (None where not measured)."""

    method: str
    budget: float | None
    example_id: str
    length: int  # requested prompt length
    score: float
    kv_fraction: float | None
    text: str

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget:g}"


def _cached_tokens(prompt_tokens: int, new_tokens: int) -> int:
    """Tokens in a full cache after generation: all but the last generated one."""
    return prompt_tokens + new_tokens - 1


def dense_bytes_per_token(kv_bytes: int, prompt_tokens: int, new_tokens: int) -> float:
    """Full-KV bytes per token, from a dense run."""
    return kv_bytes / _cached_tokens(prompt_tokens, new_tokens)


def held_fraction(kv_bytes: int, prompt_tokens: int, new_tokens: int, bytes_per_token: float) -> float:
    """KV held after a generation over what full KV holds for as many tokens."""
    return kv_bytes / (bytes_per_token * _cached_tokens(prompt_tokens, new_tokens))


def score_kvpress(
    records: list[dict], examples: list[PeerExample], bytes_per_token: dict[str, float] | None
) -> list[PeerRun]:
    """kvpress's records scored like ours; `bytes_per_token`: full KV per token, by example id
    (None: `kv_fraction` is left None). Refuses records whose prompt was tokenized to a different
    length than atskv's."""
    by_id = {e.id: e for e in examples}
    runs = []
    for r in records:
        peer_example = by_id[r["id"]]
        example = peer_example.example
        if r["prompt_tokens"] != example.n_tokens:
            raise ValueError(
                f"{r['id']}: kvpress saw {r['prompt_tokens']} prompt tokens, atskv {example.n_tokens}; "
                "the two environments tokenize differently, so the comparison would not be fair"
            )
        none = r["press"] == "none"
        runs.append(
            PeerRun(
                method=str(Method(KVPRESS, r["press"])),
                budget=None if none else budget_fraction(r["compression_ratio"]),
                example_id=r["id"],
                length=peer_example.length,
                score=example.score(r["text"]),
                kv_fraction=None if bytes_per_token is None else held_fraction(
                    r["kv_bytes"], r["prompt_tokens"], r["new_tokens"], bytes_per_token[r["id"]]
                ),
                text=r["text"],
            )
        )
    return runs


@dataclass(frozen=True)
class PeerRow:
    """A method@budget over all examples: `accuracy` is the mean score, `solved` its sum."""

    label: str
    budget: float | None
    accuracy: float
    solved: float
    trials: int
    kv_fraction: float
    accuracy_by_length: dict[int, float]


def summarize(runs: list[PeerRun]) -> list[PeerRow]:
    """One row per method@budget: full-KV rows first, then by budget, atskv before kvpress."""
    groups: dict[str, list[PeerRun]] = defaultdict(list)
    for run in runs:
        groups[run.label].append(run)

    def order(label: str):
        first = groups[label][0]
        return (first.budget is not None, first.budget or 0.0, Method.parse(first.method).runtime == KVPRESS, label)

    rows = []
    for label in sorted(groups, key=order):
        group = groups[label]
        by_length: dict[int, list[float]] = defaultdict(list)
        for run in group:
            by_length[run.length].append(run.score)
        solved = sum(run.score for run in group)
        rows.append(
            PeerRow(
                label=label,
                budget=group[0].budget,
                accuracy=solved / len(group),
                solved=solved,
                trials=len(group),
                kv_fraction=sum(run.kv_fraction for run in group) / len(group),
                accuracy_by_length={n: sum(c) / len(c) for n, c in sorted(by_length.items())},
            )
        )
    return rows


def markdown_table(rows: list[PeerRow]) -> str:
    """Rows method@budget; accuracy (mean score) overall and per requested prompt length, mean
    KV held vs dense."""
    lengths = sorted({n for row in rows for n in row.accuracy_by_length})
    header = ["method@budget", "accuracy", *(f"acc @{n} tok" for n in lengths), "KV held vs dense"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        per_length = (
            f"{row.accuracy_by_length[n]:.0%}" if n in row.accuracy_by_length else "-" for n in lengths
        )
        cells = [row.label, f"{row.accuracy:.0%} ({row.solved:g}/{row.trials})", *per_length, f"{row.kv_fraction:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the comparison ----------------------------------------------------------------------------


def check_peer_plan(python: Path, budgets: list[float], presses: list[str], our_selectors: list[str]) -> None:
    """Refuse a missing kvpress venv, a budget that is not a fraction, an unknown selector or
    press, before any model loads."""
    check_kvpress(python)
    for budget in budgets:
        compression_ratio(budget)
    check_methods([*our_selectors, *(str(Method(KVPRESS, press)) for press in presses)], (OWN, KVPRESS))


def compare_with_kvpress(
    loaded,
    python: Path,
    out: Path,
    *,
    task: str,
    lengths: list[int],
    trials: int,
    budgets: list[float],
    presses: list[str],
    our_selectors: list[Selector],
    max_new_tokens: int | None,
    filler: str,
    device: str,
    dtype: str,
) -> tuple[list[PeerRow], str]:
    """Run the task prompts through `loaded` (an `atskv.models.LoadedModel`), dense and with each
    of `our_selectors` (built for the model: `selectors_for_model`) at each budget, then through
    kvpress's `presses` (the venv of `python`); write peer.md, peer.json, examples.json and
    kvpress.json under `out`. Returns the summary rows and the table with its notes. `device` and
    `dtype` (by name) are the model's; kvpress gets the same."""
    from atskv.data import filler_text
    from atskv.data.prompts import encode_prompt
    from atskv.eval.generation import generate_one
    from atskv.eval.tasks import answer_room

    model_dir = Path(loaded.model.name_or_path)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"kvpress needs a Hugging Face model directory; {loaded.name!r} loaded from {model_dir}")
    examples = build_examples(loaded.tokenizer, task, lengths, trials, filler_text(filler))
    new_tokens = max_new_tokens or answer_room(loaded.tokenizer, [e.example for e in examples])
    out = Path(out)
    write_examples(out / "examples.json", examples)

    runs, bytes_per_token = [], {}
    settings = [(None, None)] + [(s, b) for b in budgets for s in our_selectors]
    for e in examples:
        ids = encode_prompt(loaded.tokenizer, e.example.prompt, chat=False)
        for selector, budget in settings:
            run = generate_one(
                loaded.model, loaded.tokenizer, ids, selector=selector, budget=budget,
                dense_layers=0, max_new_tokens=new_tokens, example=e.example,
            )  # fmt: skip
            if selector is None:
                bytes_per_token[e.id] = dense_bytes_per_token(run.kv_bytes, run.prompt_tokens, run.new_tokens)
            method = DENSE if selector is None else str(Method(HOOK, selector.name))
            kv = held_fraction(run.kv_bytes, run.prompt_tokens, run.new_tokens, bytes_per_token[e.id])
            runs.append(PeerRun(method, budget, e.id, e.length, run.score, kv, run.text))
            print(f"{runs[-1].label:>28} {e.id}: score {run.score:.2f} {run.text.strip()[:32]!r}", file=sys.stderr,
                  flush=True)  # fmt: skip

    records = run_kvpress(
        python, out / "examples.json", model_dir, ["none", *presses], budgets, out / "kvpress.json",
        max_new_tokens=new_tokens, device=device, dtype=dtype,
    )  # fmt: skip
    runs += score_kvpress(records, examples, bytes_per_token)
    rows = summarize(runs)
    table = markdown_table(rows)
    notes = (
        f"{loaded.name} ({dtype}, {device}), task {task}, {trials} examples per length, {filler} filler, "
        f"greedy, up to {new_tokens} new tokens. Budget: fraction of the prompt kept (kvpress "
        "compression_ratio = 1 - budget). The whole prompt, question included, is compressed. atskv: "
        "dense_layers=0, dense prefill, then its evicting selectors keep ceil(budget x context) tokens per "
        "layer and KV head at every step. kvpress: every layer compressed once after its prefill attention, "
        "press defaults. KV held: bytes after generation over full KV for as many tokens (atskv's slot buffers "
        "include their growth headroom). kvpress:none is full KV in kvpress's environment (a check that "
        "both agree)."
    )
    settings_json = {
        "model": loaded.name, "task": task, "lengths": lengths, "trials": trials, "budgets": budgets,
        "compression_ratios": [compression_ratio(b) for b in budgets], "atskv_dense_layers": 0,
        "question_compressed": True, "filler": filler, "max_new_tokens": new_tokens, "device": device,
        "dtype": dtype,
    }  # fmt: skip
    report = {"settings": settings_json, "rows": rows, "runs": runs}
    write_report(out, table, report, json_name="peer.json", markdown_name="peer.md", notes=notes)
    return rows, f"{table}\n\n{notes}"
