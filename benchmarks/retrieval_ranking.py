"""How a retrieval should rank parked keys for a GQA group, measured as perplexity under
`atskv.sparse` with each ranking used as a query-aware selector (the whole KV on the device,
attention reads the top of each ranking):
- `maxlogit`: max over the group's query heads of q·k (what an inner-product index returns);
- `maxlogprob`: max over heads of the log-probability, q·k scaled minus the head's log-sum-exp
  (`KeyIndex.search` with offsets; what `atskv.tiered` does by default);
- `oracle`: the attention mass the group puts on each token (the ceiling).

    python benchmarks/retrieval_ranking.py --model gemma3-270m --context 4096 --budgets 0.05 0.1
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from atskv.attention import grouped_queries
from atskv.data import corpus_windows
from atskv.eval.perplexity import evaluate_perplexity
from atskv.models import load_model, resolve_device
from atskv.selectors.base import LayerView, Selector


@dataclass
class HeadMaxSelector(Selector):
    """Scores a token by the max over the group's query heads of its logit, or of its log-probability."""

    normalise: bool = False
    query_aware = True

    @property
    def name(self) -> str:
        return "maxlogprob" if self.normalise else "maxlogit"

    def scores(self, view: LayerView) -> torch.Tensor:
        q = grouped_queries(view.query, view.keys.shape[1])
        logits = (q @ view.keys.unsqueeze(2).transpose(-1, -2)).float() * view.scaling
        logits = logits.masked_fill(~view.valid.unsqueeze(2), -torch.inf)
        if self.normalise:
            logits = logits - logits.logsumexp(-1, keepdim=True)
        return logits.amax(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--n_eval", type=int, default=32)
    args = parser.parse_args()
    device, dtype = resolve_device("auto", "auto")
    loaded = load_model(args.model, dtype=dtype, device=device)
    windows = corpus_windows(loaded.tokenizer, "moby-dick", args.context, args.windows)
    selectors = ["oracle", HeadMaxSelector(), HeadMaxSelector(normalise=True)]
    records = evaluate_perplexity(
        loaded.model, {args.context: windows}, selectors, args.budgets, n_eval=args.n_eval, batch_size=2
    )
    print("| ranking | budget | ppl |\n|---|---|---|")
    for r in records:
        print(f"| {r.selector} | {r.budget} | {r.perplexity:.3f} |")


if __name__ == "__main__":
    main()
