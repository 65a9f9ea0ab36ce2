"""`atskv.eval.method`: one value for a method and its runtime, read back from every spelling the
commands, result files and tables use, and refused in one line where it names nothing runnable."""

from __future__ import annotations

from pathlib import Path

import pytest

from atskv.errors import InputError
from atskv.eval.method import HOOK, HOST, KVPRESS, OWN, PLAIN, TIERED, VLLM, Method, check_methods

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.mark.parametrize(
    ("text", "method"),
    [
        ("dense", Method(OWN, "dense")),
        ("learned+sparq", Method(OWN, "learned+sparq")),
        ("hook:quest", Method(HOOK, "quest")),
        ("tiered:learned", Method(TIERED, "learned")),
        ("host:snapkv (int4 read 1/8)", Method(HOST, "snapkv", "int4 read 1/8")),
        ("spark (over learned, window 0.5)", Method(OWN, "spark", "over learned, window 0.5")),
        ("kvpress:none", Method(KVPRESS, "none")),
        ("vllm", Method(VLLM)),
        ("vllm:streaming_llm", Method(VLLM, "streaming_llm")),
        ("plain", Method(PLAIN)),
        ("plain-static", Method("plain-static")),
    ],
)
def test_a_spelling_parses_to_its_method_and_back(text, method):
    assert Method.parse(text) == method
    assert str(method) == text


def method_column(path: Path) -> list[str]:
    """The cells under a `method` header in the markdown tables of `path`."""
    found, column = [], None
    for line in path.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            column = None
        elif "method" in cells:
            column = cells.index("method")
        elif column is not None and set(line) - set("|-: "):
            found.append(cells[column])
    return found


def test_every_method_in_the_leaderboard_and_decode_speed_results_reads_back():
    tables = [*RESULTS.glob("leaderboard-*/**/leaderboard.md"), *RESULTS.glob("decode-speed-h200/**/*.md")]
    methods = {text for path in tables for text in method_column(path)}
    assert {"tiered:snapkv", "host:learned (int4 read 1/8)", "kvpress:kvzip", "hook:learned", "plain-static"} <= methods
    for text in methods:
        assert str(Method.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fast:snapkv", "fast:snapkv: unknown runtime 'fast'; runtimes: <selector>, hook:<selector>,"),
        (":snapkv", "':snapkv': unknown runtime ''"),
        ("plain:snapkv", "plain:snapkv: plain runs no selector"),
        ("hook:", "'hook': a method names a selector, as hook:<selector>"),
    ],
)
def test_a_spelling_without_a_runtime_that_runs_it_is_refused_in_one_line(text, message):
    with pytest.raises(InputError) as error:
        Method.parse(text)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hook:nope", "unknown selector 'nope'; choose one of: dense, "),
        ("nope", "(methods: <selector>, tiered:<selector>, hook:<selector>, kvpress:<press>)"),
        ("tiered:sparq+quest", "'sparq' cannot decide residency"),
        ("kvpress:nope", "unknown kvpress press 'nope'; choose from: snapkv, streaming_llm,"),
        ("kvpress:none", "unknown kvpress press 'none'"),  # always run beside the presses, never asked for
        ("vllm:quest", "vllm:quest (vLLM: alone its own attention, with a selector atskv's plugin) does not run here"),
        ("snapkv (window)", "snapkv (window): a label comes from merging runs"),
    ],
)
def test_check_methods_refuses_what_the_evaluator_cannot_run(text, message):
    with pytest.raises(InputError) as error:
        check_methods(["h2o", text], (OWN, TIERED, HOOK, KVPRESS))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_vllm_methods_name_the_plugins_selectors():
    """atskv's registry is not the plugin's: a selector it has not brought to vLLM is refused there."""
    assert [str(m) for m in check_methods(["vllm", "vllm:h2o", "vllm:learned+sparq"], (VLLM,))] == [
        "vllm", "vllm:h2o", "vllm:learned+sparq"]  # fmt: skip
    with pytest.raises(InputError, match="plugin has no selector 'kascade'; it has: h2o, learned, quest, snapkv"):
        check_methods(["vllm:kascade"], (VLLM,))
    with pytest.raises(InputError, match="no selector 'learned\\+spark'"):
        check_methods(["vllm:learned+spark"], (VLLM,))


def test_check_methods_gives_the_methods_in_order():
    texts = ["dense", "tiered:learned+sparq", "kvpress:kvzip"]
    assert check_methods(texts, (OWN, TIERED, KVPRESS)) == [Method.parse(t) for t in texts]
