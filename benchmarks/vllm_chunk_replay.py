"""Which prompts of a leaderboard's engine row vLLM's chunked prefill cut within their last
`--tail` tokens, replayed on vLLM's own scheduler on the CPU (`atskv.eval.vllm_chunks`; vLLM
installed, no GPU), beside where the row lost a prompt its comparator solved:

    python benchmarks/vllm_chunk_replay.py docs/results/vllm-quality-gemma3-h100-2026-12-07/cells.jsonl \
        --row vllm:learned --against learned --ratio 0.875

The engine ran every prompt of the row at once, in the cells' order, generating the most new tokens
any task needs (`atskv.eval.leaderboard.runs`); the replay assumes no output ended early.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from atskv.eval.rows import json_lines
from atskv.eval.vllm_chunks import prompt_chunks, ranked_short, replay_steps

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("cells", help="a leaderboard's cells.jsonl")
parser.add_argument("--row", default="vllm:learned")
parser.add_argument("--against", default="learned", help="the row whose solved prompts --row may lose")
parser.add_argument("--ratio", type=float, default=0.875)
parser.add_argument("--chunk", type=int, default=16384, help="vLLM's max_num_batched_tokens (an H100's default)")
parser.add_argument("--tail", type=int, default=64, help="the chunk reaching a prompt's last TAIL tokens ranks it")
args = parser.parse_args()

if importlib.util.find_spec("vllm") is None:
    sys.exit("the replay runs vLLM's scheduler: install atskv[vllm] (no GPU needed)")
if not Path(args.cells).is_file():
    sys.exit(f"{args.cells}: no such file")
cells = [c for c in json_lines(args.cells) if c.get("ratio") == args.ratio]
row = [c for c in cells if c["method"] == args.row]
against = {(c["task"], c["seed"]): c["scores"] for c in cells if c["method"] == args.against}
if not row or not against:
    sys.exit(f"{args.cells}: no cells of {args.row!r} and {args.against!r} at ratio {args.ratio}")
prompts = [(c["task"], c["seed"], i, n, score) for c in row
           for i, (n, score) in enumerate(zip(c["prompt_tokens"], c["scores"]))]  # fmt: skip
lengths = [p[3] for p in prompts]
steps = replay_steps(lengths, max(c["max_new_tokens"] for c in row), args.chunk, min(32, len(lengths)))
short = ranked_short(prompt_chunks(steps), lengths, args.tail)
lost = {j for j, (task, seed, i, _, score) in enumerate(prompts) if score < against[task, seed][i]}
print(
    f"{len(prompts)} prompts, {len(steps)} scheduler steps at {args.chunk} tokens; ranked short by a "
    f"{args.tail}-token tail: {len(short)}; {args.row} lost {len(lost)} that {args.against} solved, "
    f"{len(lost & set(short))} of them short"
)
print("| task | seed | prompt | tokens | ranked short by | lost |\n|---|---|---|---|---|---|")
for j in sorted(set(short) | lost):
    task, seed, i, n, _ = prompts[j]
    print(f"| {task} | {seed} | {i} | {n} | {short.get(j, '')} | {'yes' if j in lost else ''} |")
