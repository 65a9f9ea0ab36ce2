"""Threshold retention at run time: `LearnedSelector(threshold=c)` under `atskv.sparse` keeps the
tokens each layer and KV head rates above c (the budget a cap), so a policy-gradient fine-tuned
predictor's allocation is used while decoding, not only in the held-out rollouts. Perplexity of
the last `n_eval` tokens of held-out windows (decoded one at a time, the selector refreshing as it
goes) and the retained fraction of the managed layers' KV at the end, per predictor and threshold,
beside dense and the supervised predictor's top-b.

    python benchmarks/threshold_retention.py --model smollm2-135m --predictors SUP FT \
        --thresholds 0 1 1.5 2 --budgets 0.1 0.2 --windows 8 --context 2048 --out DIR
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

import atskv
from atskv.data import corpus_windows
from atskv.eval.perplexity import decode_nll
from atskv.eval.report import write_report
from atskv.models import load_model, resolve_device
from atskv.selectors.learned import LearnedSelector


def run(model, windows, n_eval, selector=None, budget=None) -> dict:
    """Mean NLL per token and the retained fraction (managed layers, at the end) over the windows."""
    nll, kept = 0.0, []
    for window in windows:
        ids = window[None].to(next(model.parameters()).device)
        with torch.no_grad():
            if selector is None:
                nll += float(decode_nll(model, ids, n_eval))
                continue
            with atskv.sparse(model, selector, budget=budget) as session:
                nll += float(decode_nll(model, ids, n_eval))
                layers = [session.cache.layers[i] for i in session.managed_layers]
                fractions = [float(layer.occupied.sum(-1).float().mean()) / layer.seen for layer in layers]
                kept.append(sum(fractions) / len(fractions))
    tokens = n_eval * len(windows)
    return {"nll": nll / tokens, "ppl": math.exp(nll / tokens), "memory": sum(kept) / len(kept) if kept else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--predictors", nargs="+", required=True, help="exported predictors (the first: supervised)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0])
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.2], help="top-b of the first predictor")
    parser.add_argument("--corpus", default="moby-dick")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--n_eval", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device, dtype = resolve_device("auto", "auto")
    lm = load_model(args.model, dtype=dtype, device=device)
    windows = corpus_windows(lm.tokenizer, args.corpus, args.context + args.n_eval, args.windows)
    whole = args.context + args.n_eval  # an int budget of the whole window: no cap, the threshold decides
    runs = [("dense", None, None, None)]
    runs += [(p, c, LearnedSelector(predictor=p, threshold=c), whole) for p in args.predictors for c in args.thresholds]
    runs += [(args.predictors[0], f"top{b:g}", LearnedSelector(predictor=args.predictors[0]), b) for b in args.budgets]
    rows = []
    for name, setting, selector, budget in tqdm(runs, desc="settings"):
        row = {"predictor": name, "setting": setting, **run(lm.model, windows, args.n_eval, selector, budget)}
        rows.append(row)
        print(row, flush=True)
    lines = ["| predictor | retention | retained fraction | NLL | ppl |", "|---|---|---|---|---|"]
    for r in rows:
        retention = (
            "dense"
            if r["setting"] is None
            else (r["setting"] if isinstance(r["setting"], str) else f"logit > {r['setting']:g}")
        )
        lines.append(f"| {r['predictor']} | {retention} | {r['memory']:.3f} | {r['nll']:.4f} | {r['ppl']:.3f} |")
    write_report(args.out, "\n".join(lines), rows, json_name="results.json")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
