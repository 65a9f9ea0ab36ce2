"""`benchmarks/vllm_identity.py`: the jobs it runs (vanilla, then each method at budget 1.0 on
the same prompts) and how it counts the prompts that match vanilla's tokens (engines faked)."""

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from atskv.eval.vllm_generate import GenerationJob

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "vllm_identity.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("vllm_identity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_method_runs_at_budget_one_on_vanilla_prompts_and_is_counted_against_them(script, tmp_path, monkeypatch,
                                                                                       capsys):  # fmt: skip
    requests = [{"id": f"r{i}", "prompt_token_ids": [1, 2, i]} for i in range(5)]
    base = GenerationJob("vllm", "/models/m", None, 2, 64, requests, options={"x": 1})
    (tmp_path / "job.json").write_text(json.dumps(asdict(base)))
    seen = []

    def fake_generate(jobs, rows):
        seen.extend(jobs)
        tokens = {job.label: {r["id"]: [7, 7] for r in job.requests} for job in jobs}
        tokens["vllm:learned@1"]["r1"] = [7, 8]  # one prompt differs
        return tokens, ["vllm:quest@1 (exit 1)"]

    monkeypatch.setattr(script, "generate", fake_generate)
    argv = ["vllm_identity.py", str(tmp_path / "job.json"), str(tmp_path / "rows.jsonl"), "--prompts", "3",
            "--methods", "vllm:streaming_llm", "vllm:learned", "--options", '{"learned": {"predictor": "/p"}}']
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="quest"):
        script.main()
    assert [(j.method, j.budget, j.options, len(j.requests), j.max_new_tokens) for j in seen] == [
        ("vllm", None, {}, 3, 32), ("vllm:streaming_llm", 1.0, {}, 3, 32),
        ("vllm:learned", 1.0, {"predictor": "/p"}, 3, 32)]  # fmt: skip
    assert {j.model_dir for j in seen} == {"/models/m"}
    out = capsys.readouterr().out
    assert "vllm:streaming_llm@1: 3/3 prompts" in out and "vllm:learned@1: 2/3 prompts" in out


@pytest.mark.parametrize("content", [None, "{not json", '{"method": "vllm"}'])
def test_a_missing_or_wrong_job_file_is_a_one_line_error(script, tmp_path, monkeypatch, content):
    job = tmp_path / "job.json"
    if content is not None:
        job.write_text(content)
    monkeypatch.setattr(script, "generate", lambda *a: pytest.fail("no engine for a bad job file"))
    monkeypatch.setattr(sys, "argv", ["vllm_identity.py", str(job), str(tmp_path / "o.jsonl"), "--methods", "vllm:x"])
    with pytest.raises(SystemExit) as stop:
        script.main()
    assert str(stop.value).startswith(f"{job}: not a readable GenerationJob file") and "\n" not in str(stop.value)
