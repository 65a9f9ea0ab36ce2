"""Synthetic long-context tasks (atskv.data.tasks) against what each promises: prompt length,
needles at the requested depth, answers in the prompt, exact scoring, seeding; and the task
runner (atskv.eval.tasks) end to end on a tiny random Llama."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from atskv.cli.eval import tasks as tasks_command
from atskv.data.tasks import DEPTH_FREE, TASKS, TaskExample
from atskv.data.tasks.haystack import fresh_item
from atskv.eval.tasks import TaskResult, evaluate_tasks, markdown
from atskv.models.loading import LoadedModel
from tests.conftest import COMMON, tiny_bpe_tokenizer, tiny_model

NEEDLE = r"(?:One of the special magic numbers|The special magic number) for ([a-z]+-[a-z]+) is (\d{7})\."
STATEMENT = {  # task -> (one inserted statement, how many the default task inserts)
    "passkey": (r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", 1),
    "needle_single": (NEEDLE, 1),
    "needle_multikey": (NEEDLE, 4),
    "needle_multivalue": (NEEDLE, 4),
    "variable_tracking": (r"VAR ([A-Z]{5}) = (?:VAR [A-Z]{5}|\d{5})\.", 5),
    "qa": (
        r"([A-Z][a-z]+ [A-Z][a-z]+) "
        r"(lives in the town of|keeps a pet named|works for a company called|grew up on the island of) ([A-Z][a-z]+)\.",
        6,
    ),
}
HAYSTACK_TASKS = sorted(STATEMENT)
PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. In 1811 there were 12345 reasons to doubt it. "
)


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny BPE, trained with the tasks' own text so that their words are not all bytes."""
    base = tiny_bpe_tokenizer()
    texts = [build(base, 800, 0.5, seed).prompt for build in TASKS.values() for seed in range(3)]
    return tiny_bpe_tokenizer(vocab_size=1000, extra_texts=texts)


def test_every_task_is_registered():
    assert sorted(TASKS) == sorted([*HAYSTACK_TASKS, "common_words"])
    assert DEPTH_FREE == {"common_words"}


def count_words(text: str, word: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text))


def check_haystack_example(tokenizer, ex: TaskExample, task: str, n_tokens: int, depth: float) -> None:
    """Length, needles (token spans, count, depth of the first) and answers of a haystack task."""
    pattern, n_statements = STATEMENT[task]
    ids = tokenizer(ex.prompt)["input_ids"]
    assert ex.n_tokens == len(ids)
    assert n_tokens - max(8, 0.02 * n_tokens) <= ex.n_tokens <= n_tokens
    assert len(re.findall(pattern, ex.prompt)) == n_statements
    needles = [tokenizer.decode(ids[s:e]).strip() for s, e in ex.needle_token_ranges]
    assert all(re.fullmatch(pattern, needle) for needle in needles), needles
    starts = [s for s, _ in ex.needle_token_ranges]
    # The first needle sits at `depth` of the filler (head: first line; tail: from the next newline on),
    # up to a filler sentence; measured in the filler's non-space characters.
    body = ex.prompt.split("\n")[1]
    filler_chars = len(re.sub(r"\s", "", re.sub(pattern, "", body)))
    before = len(re.sub(r"\s", "", re.sub(pattern, "", body[: body.index(needles[0])])))
    assert abs(before / filler_chars - depth) <= 0.02 + 60 / filler_chars
    # Answers are where the task put them.
    for answer in ex.answers:
        assert count_words(ex.prompt, answer) >= 1
    if task == "variable_tracking":
        assert starts == sorted(starts)  # the chain in order
        assert [re.fullmatch(pattern, n)[1] for n in needles] == list(ex.answers)
        value = re.fullmatch(r"VAR [A-Z]{5} = (\d{5})\.", needles[0])[1]
        for previous, needle in zip(ex.answers, needles[1:]):
            assert needle.endswith(f"= VAR {previous}.")
        assert ex.prompt.endswith(f"The {len(ex.answers)} variables that hold the value {value} are:")
    elif task == "qa":
        person, relation, answer = re.fullmatch(pattern, needles[0]).groups()
        assert ex.answers == (answer,) and count_words(ex.prompt, answer) == 1
        assert ex.prompt.endswith(f"\nAnswer: {person} {relation}")
        facts = re.findall(pattern, ex.prompt)
        assert len({f[2] for f in facts}) == len(facts), "every fact has its own answer"
        assert sum(f[0] == person for f in facts) == 2, "one distractor about the asked person"
        assert sum(f[:2] == (person, relation) for f in facts) == 1
    else:
        assert [re.search(r"\d+", n)[0] for n in needles] == list(ex.answers)
        assert all(count_words(ex.prompt, answer) == (2 if task == "passkey" else 1) for answer in ex.answers)
    if task.startswith("needle"):
        key = re.fullmatch(pattern, needles[0])[1]
        assert ex.prompt.endswith(f"for {key} is" if task != "needle_multivalue" else f"for {key} are")
        assert all(re.fullmatch(pattern, n)[1] == key for n in needles)


@pytest.mark.parametrize("n_tokens", [512, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("task", HAYSTACK_TASKS)
def test_haystack_tasks_length_needles_and_answers(tokenizer, task, n_tokens, depth):
    check_haystack_example(tokenizer, TASKS[task](tokenizer, n_tokens, depth, seed=3), task, n_tokens, depth)


def test_needle_options_and_corpus_filler(tokenizer):
    ex = TASKS["needle_multikey"](tokenizer, 1500, 0.3, seed=1, filler=PROSE, n_keys=6)
    assert "truth universally acknowledged" in ex.prompt
    assert len(re.findall(NEEDLE, ex.prompt)) == 6 and len(ex.answers) == 1
    ex = TASKS["variable_tracking"](tokenizer, 1500, 0.7, seed=1, n_hops=2, n_chains=3)
    assert len(ex.answers) == 3 and len(re.findall(STATEMENT["variable_tracking"][0], ex.prompt)) == 9
    ex = TASKS["needle_multivalue"](tokenizer, 1000, 0.6, 2, filler=PROSE)
    check_haystack_example(tokenizer, ex, "needle_multivalue", 1000, 0.6)


@pytest.mark.parametrize(("n_tokens", "common", "rare"), [(600, 6, 1), (4096, 30, 3)])
def test_common_words_counts(tokenizer, n_tokens, common, rare):
    ex = TASKS["common_words"](tokenizer, n_tokens, depth=0.5, seed=4)
    assert ex.n_tokens == len(tokenizer(ex.prompt)["input_ids"])
    assert n_tokens - max(12, 0.01 * n_tokens) <= ex.n_tokens <= n_tokens
    entries = re.findall(r"(\d+)\. ([a-z]+)", ex.prompt.split("\n")[1])
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(word for _, word in entries)
    assert len(ex.answers) == 10 and {counts[a] for a in ex.answers} == {common}
    assert len(counts) > 20 and all(n == rare for w, n in counts.items() if w not in ex.answers)
    assert ex.needle_token_ranges == ()
    assert ex.prompt.endswith("The 10 words that occur most often in the list are:")
    assert TASKS["common_words"](tokenizer, n_tokens, depth=0.1, seed=4) == ex  # depth is ignored


@pytest.mark.parametrize("task", sorted(TASKS))
def test_scoring_is_exact(tokenizer, task):
    ex = TASKS[task](tokenizer, 1024, 0.5, seed=5)
    n = len(ex.answers)
    assert ex.score(" " + ", ".join(ex.answers) + ".") == 1.0
    assert ex.score("\n".join(f"{i}. {a}" for i, a in enumerate(reversed(ex.answers), 1))) == 1.0
    assert ex.score(f"It is {ex.answers[-1]}.") == pytest.approx(1 / n)
    assert ex.score("") == 0.0
    assert ex.score(" ".join(a + "7" for a in ex.answers)) == 0.0  # longer numbers / other words
    assert ex.score(" ".join(a[:-1] for a in ex.answers)) == 0.0
    if n > 1:
        assert ex.score(" ".join(ex.answers[:2])) == pytest.approx(2 / n)
    if task == "needle_multikey":
        distractors = [v for _, v in re.findall(NEEDLE, ex.prompt) if v not in ex.answers]
        assert len(distractors) == 3 and ex.score(" ".join(distractors)) == 0.0
    if task == "variable_tracking":
        value = re.search(r"hold the value (\d{5})", ex.prompt)[1]
        assert ex.score(value) == 0.0


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_per_seed(tokenizer, task):
    build = TASKS[task]
    a = build(tokenizer, 700, 0.4, seed=11)
    assert a == build(tokenizer, 700, 0.4, seed=11)
    b = build(tokenizer, 700, 0.4, seed=12)
    assert a.prompt != b.prompt and a.answers != b.answers


@pytest.mark.parametrize("task", sorted(TASKS))
def test_argument_errors(tokenizer, task):
    with pytest.raises(ValueError, match="too small for this task's template"):
        TASKS[task](tokenizer, 40, 0.5, seed=0)
    if task not in DEPTH_FREE:
        with pytest.raises(ValueError, match="depth must be in"):
            TASKS[task](tokenizer, 1000, 1.5, seed=0)


def test_option_errors(tokenizer):
    with pytest.raises(ValueError, match="n_keys and n_values must be positive"):
        TASKS["needle_multikey"](tokenizer, 1000, 0.5, 0, n_keys=0)
    with pytest.raises(ValueError, match="n_chains >= 1"):
        TASKS["variable_tracking"](tokenizer, 1000, 0.5, 0, n_chains=0)
    with pytest.raises(ValueError, match="common_repeats > rare_repeats"):
        TASKS["common_words"](tokenizer, 1000, 0.5, 0, common_repeats=2, rare_repeats=2)
    with pytest.raises(ValueError, match="n_facts must be at least 2"):
        TASKS["qa"](tokenizer, 1000, 0.5, 0, n_facts=1)


def test_fresh_item_avoids_filler_and_taken():
    drawn = iter(["12345", "777", "555", "999"])
    taken = {"777"}
    assert fresh_item(random.Random(0), lambda _: next(drawn), "in 12345 ways", taken) == "555"
    assert taken == {"777", "555"}
    with pytest.raises(ValueError, match="could not draw"):
        fresh_item(random.Random(0), lambda _: "green", None, set())  # a word of the generated filler


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from atskv.models import load_model

    return load_model("smollm2-135m").tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_with_smollm2_tokenizer(smollm2_tokenizer, task):
    tokenizer = smollm2_tokenizer
    ex = TASKS[task](tokenizer, 4096, 0.3, seed=0)
    if task in DEPTH_FREE:
        assert 4096 - 40 <= ex.n_tokens == len(tokenizer(ex.prompt)["input_ids"]) <= 4096
        assert all(count_words(ex.prompt, a) == 30 for a in ex.answers)
    else:
        check_haystack_example(tokenizer, ex, task, 4096, 0.3)


# --- runner ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tokenizer) -> LoadedModel:
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return LoadedModel(model, tokenizer, "tiny-llama", "test")


def test_batched_run_equals_one_at_a_time(loaded):
    """common_words: its prompts differ in length by a few tokens, so the batch is left-padded."""
    plan = dict(
        tasks=["common_words"], lengths=[300], depths=[0.5, 0.9], trials=2, selectors=["h2o", "oracle"],
        budgets=[24], dense_layers=1, max_new_tokens=4, progress=False,
    )  # fmt: skip
    batched = evaluate_tasks(loaded, **plan, batch_size=2)
    single = evaluate_tasks(loaded, **plan, batch_size=1)
    assert len(batched) == len(single) == 2 * 3  # built once per seed: no depth

    def key(r: TaskResult):
        return r.task, r.seed, r.label

    assert sorted(map(key, batched)) == sorted(map(key, single))
    single_text = {key(r): r.text for r in single}
    assert all(r.text == single_text[key(r)] and r.text for r in batched)
    assert len({r.prompt_tokens for r in batched}) > 1  # rows were padded
    assert {r.depth for r in batched} == {None}
    assert all(0.0 <= r.score <= 1.0 for r in batched)


def test_each_example_records_its_gpu_kv_and_the_tiered_store_holds_less_than_dense(loaded):
    plan = dict(tasks=["passkey"], lengths=[300], depths=[0.5], trials=2, selectors=["h2o"], budgets=[40],
                dense_layers=1, max_new_tokens=3, progress=False)  # fmt: skip
    sparse = evaluate_tasks(loaded, **plan)
    tiered = evaluate_tasks(loaded, **plan, tiering={"sinks": 2, "recent": 8, "refresh_every": 4})
    assert [r.label for r in tiered] == ["dense", "dense", "h2o@40", "h2o@40"]
    assert all(r.kv_bytes > 0 for r in sparse + tiered)
    dense = min(r.kv_bytes for r in tiered if r.selector is None)
    assert max(r.kv_bytes for r in sparse + tiered if r.selector is not None) < dense


def test_tasks_command_writes_table_json_and_plot(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "model"
    config = LlamaConfig(num_hidden_layers=3, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    tasks_command(
        model=str(model_dir), tasks=["needle_single"], lengths=[300], depths=[0.2], trials=2,
        selectors=["streaming_llm"], budgets=[32, 0.5], dense_layers=1, max_new_tokens=3, out=out,
        device="cpu", dtype="float32",
    )  # fmt: skip
    table = (out / "table.md").read_text()
    assert table == markdown_from_json(out / "results.json") + "\n"
    scores = table.split("\n\n")[0]
    assert [line.split("|")[1].strip() for line in scores.splitlines()[2:]] == [
        "dense",
        "streaming_llm@32",
        "streaming_llm@0.5",
    ]
    assert table.splitlines()[0] == "| setting | needle_single 300 |"
    records = json.loads((out / "results.json").read_text())
    assert len(records) == 2 * 3
    assert all(r["kv_bytes"] > 0 for r in records)
    assert {r["seed"] for r in records} == {0, 1} and {r["depth"] for r in records} == {0.2}
    assert (out / "tasks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.strip() in capsys.readouterr().out


def markdown_from_json(path) -> str:
    return markdown([TaskResult(**{**r, "answers": tuple(r["answers"])}) for r in json.loads(path.read_text())])


def test_markdown_means_and_dense_first():
    def result(label, task, length, score, mib):
        selector, budget = (None, None) if label == "dense" else label.split("@")
        return TaskResult(task, length, 0.5, 0, selector, budget, score, "", ("1",), length, int(mib * 2**20))

    results = [
        result("h2o@64", "passkey", 1024, 1.0, 1.0),
        result("h2o@64", "passkey", 1024, 0.0, 2.0),
        result("dense", "passkey", 1024, 1.0, 16.0),
        result("dense", "common_words", 2048, 0.25, 32.0),
    ]
    assert markdown(results).splitlines() == [
        "| setting | passkey 1024 | common_words 2048 |",
        "|---|---|---|",
        "| dense | 1.00 | 0.25 |",
        "| h2o@64 | 0.50 |  |",
        "",
        "GPU KV per example, MiB (mean over examples)",
        "",
        "| setting | passkey 1024 | common_words 2048 |",
        "|---|---|---|",
        "| dense | 16.00 | 32.00 |",
        "| h2o@64 | 1.50 |  |",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budgets": [300]}, "budget 300 keeps the whole 300-token prompt"),
        ({"budgets": [1.5]}, "bad budget 1.5"),
        ({"budgets": [1.0]}, "bad budget 1.0"),
        ({"tasks": ["needle_haystack"]}, "unknown task 'needle_haystack'; choose from: passkey"),
        ({"selectors": ["nope"]}, "unknown selector 'nope'"),
        ({"depths": [-0.1]}, "depth must be in"),
    ],
)
def test_bad_plans_are_refused_before_any_work(change, message):
    plan = dict(tasks=["passkey"], lengths=[300, 600], depths=[0.5], trials=1, selectors=["h2o"], budgets=[32])
    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate_tasks(None, **{**plan, **change})  # no model: any work would fail differently
    with pytest.raises(ValueError, match=re.escape(message)):
        tasks_command(model="/no/such/model", **{**plan, **change})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(kind="vllm"), "not 'vllm'"),
        (dict(kind=""), None),
        (dict(kind="", sparse_prefill=True), "prefills densely"),
        (dict(kind="host", sparse_prefill=True), "prefills densely"),
        (dict(kind="hook", tiering={}), "tiered runtime"),
        (dict(kind="tiered"), "needs them"),
        (dict(kind="tiered", sparse_prefill=True, tiering={}), None),
        (dict(kind="host"), "needs one"),
        (dict(kind="hook", host=object()), "host runtime"),
    ],
)
def test_a_generation_runtime_takes_only_its_own_options(settings, message):
    from atskv.eval.generation import Runtime

    if message is None:
        assert Runtime(**settings).kind == settings["kind"]
    else:
        with pytest.raises(ValueError, match=message):
            Runtime(**settings)
    assert Runtime.reference(tiering={"retrieve": 8}).kind == "tiered" and Runtime.reference(True).kind == "hook"
