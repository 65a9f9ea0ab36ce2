"""Quality of the fast path on a real model: greedy tokens of `atskv.generate` against the reference
session (`atskv.sparse` + `model.generate`), per selector and budget; prints a markdown table.

    python benchmarks/fast_vs_reference.py --model smollm2-135m --context 768 --steps 64
"""

import argparse
from pathlib import Path

import torch

import atskv
from atskv.models import load_model
from atskv.selectors import resolve_selector
from atskv.selectors.learned import LearnedSelector

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--context", type=int, default=768)
parser.add_argument("--steps", type=int, default=64)
parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.5])
parser.add_argument("--selectors", nargs="+", default=["learned", "quest", "h2o", "snapkv"])
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="auto: bf16 on CUDA")
parser.add_argument("--compile", action="store_true", help="the fast path through torch.compile'd decoder layers")
parser.add_argument("--predictor", help="the learned selector's exported predictor (a GGUF path has no name)")
args = parser.parse_args()


def selector(name: str):
    if name == "learned" and args.predictor:
        return LearnedSelector(predictor=args.predictor)
    return resolve_selector(name, lm.model)


dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
dtype = getattr(torch, args.dtype) if args.dtype != "auto" else dtype
lm = load_model(args.model, device=args.device, dtype=dtype)
lm.model.generation_config.eos_token_id = None  # both loops run the full number of steps
text = (Path(__file__).resolve().parent.parent / "README.md").read_text() * 4  # any real text
ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, : args.context].to(args.device)
print(f"{args.model}, {ids.shape[1]}-token prompt, {args.steps} greedy steps, {args.device} {dtype}"
      f"{', compiled layers' if args.compile else ''}\n")
print("| selector | budget | same tokens | first difference |\n|---|---|---|---|")
for budget in args.budgets:
    for name in args.selectors:
        fast = atskv.generate(lm.model, ids, selector(name), budget, max_new_tokens=args.steps,
                              prefill_chunk=256, compile=args.compile)  # fmt: skip
        with torch.no_grad(), atskv.sparse(lm.model, selector(name), budget):
            reference = lm.model.generate(ids, max_new_tokens=args.steps, do_sample=False)
        same = fast[0, ids.shape[1] :] == reference[0, ids.shape[1] :]
        first = "-" if bool(same.all()) else int((~same).nonzero()[0])
        print(f"| {name} | {budget} | {int(same.sum())}/{args.steps} | {first} |", flush=True)
