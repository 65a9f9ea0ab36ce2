"""The plugin at budget 1.0 against vanilla vLLM on a real model: each method reads every token,
so its greedy tokens must be vanilla's. The prompts and the model are a leaderboard's vLLM run's
(its `vllm/outputs.vllm.job.json`: the saved model directory, the task prompts as token ids); one
engine a method, in its own process (`atskv.eval.vllm_generate`), rows in OUT.jsonl, resumable.

    python benchmarks/vllm_identity.py LB/vllm/outputs.vllm.job.json OUT.jsonl \
        --methods vllm:streaming_llm vllm:learned --options '{"learned": {"predictor": DIR}}' \
        [--prompts 24 --new_tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from atskv.eval.method import Method
from atskv.eval.vllm_generate import GenerationJob, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", type=Path, help="a vanilla GenerationJob file (a leaderboard's vLLM run writes one)")
    parser.add_argument("rows", type=Path)
    parser.add_argument("--methods", nargs="+", required=True, help="vllm:<selector>, each run at budget 1.0")
    parser.add_argument("--options", type=json.loads, default={}, help="JSON: options per selector name")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        base = GenerationJob(**json.loads(args.job.read_text()))
    except (OSError, ValueError, TypeError) as error:
        sys.exit(f"{args.job}: not a readable GenerationJob file ({type(error).__name__}: {error})")
    vanilla = replace(base, method="vllm", budget=None, options={}, host_tier=None,
                      requests=base.requests[: args.prompts], max_new_tokens=args.new_tokens)  # fmt: skip
    jobs = [vanilla] + [replace(vanilla, method=m, budget=1.0, options=args.options.get(Method.parse(m).name, {}))
                        for m in args.methods]  # fmt: skip
    outputs, failed = generate(jobs, args.rows)
    expected = outputs.get(vanilla.label, {})
    for job in jobs[1:]:
        got = outputs.get(job.label, {})
        same = sum(tokens == expected.get(i) for i, tokens in got.items())
        print(f"{job.label}: {same}/{len(got)} prompts give vanilla vLLM's {args.new_tokens} greedy tokens")
    if failed:
        sys.exit(f"engines that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
