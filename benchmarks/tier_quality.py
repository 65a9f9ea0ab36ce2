"""Does reading parked tokens back help? Greedy tokens of the fast path with an evicting selector
alone and with the host tier (`HostRetrieval`), each against dense's, on a real model and real text
(windows of a local text file); prints a markdown table of the share of the first `--steps` tokens
that equal dense's, the mean step of the first difference, and the share of the pages read back
that the GPU page cache already held (counted at the copy kernel's call).

    python benchmarks/tier_quality.py --model smollm2-135m --text ~/.cache/atskv/corpora/austen/emma.txt \
        --context 2048 --budget 64 --retrieve 64
"""

import argparse
from pathlib import Path

import torch

import atskv
from atskv.models import load_model
from atskv.runtime.fast import host_pages
from atskv.selectors import resolve_selector

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--text", type=Path, required=True)
parser.add_argument("--context", type=int, default=2048)
parser.add_argument("--budget", type=int, default=64)
parser.add_argument("--retrieve", type=int, default=64)
parser.add_argument("--windows", type=int, default=3)
parser.add_argument("--steps", type=int, default=32)
parser.add_argument("--selectors", nargs="+", default=["snapkv", "h2o", "streaming_llm"])
parser.add_argument("--device", default="cpu")
args = parser.parse_args()

dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
lm = load_model(args.model, device=args.device, dtype=dtype)
lm.model.generation_config.eos_token_id = None
text = args.text.expanduser().read_text()[: 40 * args.context * args.windows]  # enough characters for the windows
tokens = lm.tokenizer(text, return_tensors="pt").input_ids
stride = (tokens.shape[1] - args.context) // max(1, args.windows)
prompts = [tokens[:, i * stride : i * stride + args.context].to(args.device) for i in range(args.windows)]


pages_read = {"needed": 0, "listed": 0}
_copy = host_pages.page_copy


def _counted_copy(source, target, pages, slots, need):
    pages_read["needed"] += int(need.sum())
    pages_read["listed"] += need.numel()
    _copy(source, target, pages, slots, need)


host_pages.page_copy = _counted_copy


def run(selector, tier) -> list[torch.Tensor]:
    return [atskv.generate(lm.model, ids, resolve_selector(selector, lm.model), args.budget, max_new_tokens=args.steps,
                           prefill_chunk=512, tier=tier)[0, ids.shape[1] :] for ids in prompts]  # fmt: skip


dense = run("dense", None)


def agreement(outs: list[torch.Tensor]) -> str:
    same = [(o == d).float() for o, d in zip(outs, dense)]
    first = [int((s == 0).nonzero()[0]) if bool((s == 0).any()) else args.steps for s in same]
    return f"{torch.stack(same).mean():.2f} | {sum(first) / len(first):.1f}"


print(f"{args.model}, {args.windows} windows of {args.context} tokens of {args.text.name}, {args.steps} greedy steps; "
      f"GPU budget {args.budget} tokens, {args.retrieve} read back per step; {args.device} {dtype}\n")  # fmt: skip
print("| selector | alone: same as dense | first difference | with the host tier: same as dense | first difference "
      "| page-cache hits |\n|---|---|---|---|---|---|")  # fmt: skip
for name in args.selectors:
    alone = agreement(run(name, None))
    pages_read.update(needed=0, listed=0)
    tiered = agreement(run(name, atskv.HostRetrieval(args.retrieve)))
    hits = 1 - pages_read["needed"] / max(1, pages_read["listed"])
    print(f"| {name} | {alone} | {tiered} | {hits:.2f} |", flush=True)
