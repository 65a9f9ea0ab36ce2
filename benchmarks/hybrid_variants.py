"""Ways for the learned part of `learned+sparq` to add information to the per-query pick (issue 16,
item 1), all measured as attention recall on the same trajectory.

    python benchmarks/hybrid_variants.py --corpus sotu --window_tokens 4096 --windows 2 \
        --budget 128 --residencies 512 2048 --out results/hybrid-variants

One probe run per residency budget runs the plain `learned+sparq` composition (which decides what
the cache holds: what it evicts is lost to every variant) and at every decode step of every managed
layer also scores, on the same view, each per-query pick below; each is recorded as its own row:

- `sparq`, `sparq-r1/4`: SparQ alone over the whole cache (rank 1/8 and 1/4 of the head dimension);
  `sparq+recent-R`: SparQ alone with its R newest tokens always attended (the control for `recent-R`);
- `oracle`: the per-query top-k over the whole cache; `resident-oracle`: the same among residents
  (the limit of any pick the composition can make at that residency);
- `hybrid`: SparQ among the residents (recomputed; must equal the probe's own `learned+sparq` row);
- `reserve-R`: the R residents the learned predictor scores highest, plus SparQ's top k - R of the
  others (the newest tokens, not scored since the last refresh, rank above every scored one;
  `recent-R`: the R newest tokens instead, a control without the predictor);
- `prior-W`: residents ranked by SparQ's pooled probability (normalised to sum 1) plus W times the
  softmax of the learned logits over the residents; `logprior-W`: log SparQ probability plus W
  times the learned log-sigmoid; `sigprior-W`: SparQ's probability plus W times the learned
  sigmoid normalised to sum 1 over the residents;
- `recent-R+reserve-N`: the R newest, then the N the predictor scores highest among the other
  residents, then SparQ (beside `recent-(R+N)`); `recent-R+logprior-W`: the R newest, then `logprior-W`;
- `hybrid-r1/4`, `reserve-R-r1/4`: the same picks with SparQ at rank 1/4.

Beside them a plain harness run (`attention_recall`) measures `learned` alone and `sparq` at the
same budget (the second a check that the probe's `sparq` row is the harness's; `--no-baselines`
skips it). Writes DIR/variants.json and DIR/table.md. Results: docs/results.md, "Learned +
query-aware: can the learned part improve the per-query pick?".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from atskv.attention import sdpa_attention
from atskv.data import corpus_windows
from atskv.eval.recall import RecallProbe, attention_recall, pooled_probs, topk_mass
from atskv.kernels.sparq_decode import sparq_probs
from atskv.models import load_model
from atskv.runtime.reference.sparse import SparsityConfig, attach
from atskv.selectors import selectors_for_model
from atskv.selectors.base import select_top_budget

LEARNED_SCORE = "learned_score"  # the learned selector's slot tensor of logits (+inf: not scored yet)


def top_k(scores, valid, k, view) -> torch.Tensor:
    """Keep-mask `[B, Hkv, S]` of the k best valid slots of the decode query (ties: newest first)."""
    keep = select_top_budget(scores.unsqueeze(2), valid.unsqueeze(2), k, view.slot_pos, view.context[:, :, -1:])
    return keep[:, :, 0]


class VariantProbe(RecallProbe):
    """Runs the hybrid like `RecallProbe` and records every variant's recall on the same step."""

    def __init__(self, model, selector, config, reserves, prior_weights, recent_first):
        super().__init__(model, selector, config)
        self.reserves, self.prior_weights, self.recent_first = reserves, prior_weights, recent_first
        self.rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def attend(self, module, query, keys, values, attention_mask, scaling):
        layer = self.cache.layers[module.layer_idx]
        full = self.view(module.layer_idx, layer, query, keys, attention_mask, scaling)
        selectable = layer.slot_tensor("recall_selectable", init=1.0) > 0
        view = dataclasses.replace(full, visible=full.valid & selectable.unsqueeze(2))
        sparse = self.is_sparse_step(query)
        keep = self.keep(view, sparse)
        if self.selector.needs_attention:
            self.attend_kept(view, values, keep)
        if query.shape[2] == 1 and sparse:
            self.variants(full, view, keep[:, :, -1])
        retained = self.finish(view, keep, sparse)
        if retained is not None:
            layer.slot_tensor("recall_selectable").masked_fill_(~retained, 0.0)
        return sdpa_attention(query, keys, values, full.valid, scaling)

    def add(self, name, mass, kept):
        row = self.rows[name]
        row[0] += float((mass * kept).sum())
        row[1] += mass.shape[0] * mass.shape[1]

    def variants(self, full, view, probe_keep):
        k = self.config.budget
        all_valid, res = full.valid[:, :, -1], view.valid[:, :, -1]
        mass = pooled_probs(full.query, full.keys, full.valid, full.scaling)
        self.add("probe:learned+sparq", mass, probe_keep)
        self.add("oracle", mass, topk_mass(mass, all_valid, k)[1])
        self.add("resident-oracle", mass, topk_mass(mass, res, k)[1])
        learned = view.layer.slot_tensor(LEARNED_SCORE, init=math.inf)  # [B, Hkv, S]
        finite = learned.masked_fill(~res | learned.isinf(), -math.inf).amax(-1, keepdim=True)
        learned = torch.where(learned.isinf(), finite + 10.0, learned)  # the unscored newest: above every scored one
        newest = view.slot_pos.float()
        group = full.group_size
        for tag, fraction in (("", 1 / 8), ("-r1/4", 1 / 4)):
            rank = max(1, round(full.query.shape[-1] * fraction))
            alone = sparq_probs(full.query, full.keys, full.valid, full.scaling, rank)[:, :, -1]
            self.add(f"sparq{tag}", mass, top_k(alone, all_valid, k, full))
            for r in self.reserves if not tag else ():  # SparQ alone with the same recent window
                held = top_k(full.slot_pos.float(), all_valid, r, full)
                self.add(f"sparq+recent-{r}", mass, top_k(alone.masked_fill(held, math.inf), all_valid, k, full))
            among = sparq_probs(view.query, view.keys, view.valid, view.scaling, rank)[:, :, -1]  # [B, Hkv, S]
            self.add(f"hybrid{tag}", mass, top_k(among, res, k, view))
            for r in self.reserves:
                for name, prior in (("reserve", learned), ("recent", newest)):
                    held = top_k(prior, res, r, view)
                    self.add(f"{name}-{r}{tag}", mass, top_k(among.masked_fill(held, math.inf), res, k, view))
            if tag:
                continue
            soft = learned.masked_fill(~res, -math.inf).softmax(-1)
            for w in self.prior_weights:
                self.add(f"prior-{w}", mass, top_k(among / group + w * soft, res, k, view))
                sig = learned.sigmoid().masked_fill(~res, 0.0)
                sig = sig / sig.sum(-1, keepdim=True)
                self.add(f"sigprior-{w}", mass, top_k(among / group + w * sig, res, k, view))
                logp = among.clamp(min=1e-30).log() + w * F.logsigmoid(learned)
                self.add(f"logprior-{w}", mass, top_k(logp, res, k, view))
            for r in self.recent_first:  # the learned part's information beyond a recent window
                recent = top_k(newest, res, r, view)
                rest = res & ~recent
                for n in self.reserves:
                    held = recent | top_k(learned, rest, n, view)
                    self.add(f"recent-{r}+reserve-{n}", mass, top_k(among.masked_fill(held, math.inf), res, k, view))
                    held = top_k(newest, res, r + n, view)
                    self.add(f"recent-{r + n}", mass, top_k(among.masked_fill(held, math.inf), res, k, view))
                for w in self.prior_weights:
                    logp = among.clamp(min=1e-30).log() + w * F.logsigmoid(learned)
                    self.add(f"recent-{r}+logprior-{w}", mass, top_k(logp.masked_fill(recent, math.inf), res, k, view))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="sotu")
    p.add_argument("--window_tokens", type=int, default=4096)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--n_queries", type=int, default=16)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--residencies", type=int, nargs="+", default=[512])
    p.add_argument("--reserves", type=int, nargs="*", default=[8, 16, 32, 64])
    p.add_argument("--prior_weights", type=float, nargs="*", default=[0.1, 0.3, 1.0, 3.0])
    p.add_argument("--recent_first", type=int, nargs="*", default=[16, 32])
    p.add_argument("--dense_layers", type=int, default=2)
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, default=Path("results/hybrid-variants"))
    a = p.parse_args()
    torch.manual_seed(0)
    loaded = load_model(a.model, dtype=torch.float32, device="cpu")
    windows = corpus_windows(loaded.tokenizer, a.corpus, a.window_tokens, a.windows)
    context = windows.shape[1] - a.n_queries
    results: dict[str, dict] = {"settings": vars(a) | {"out": str(a.out)}, "residency": {}, "baselines": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    for residency in a.residencies:
        opts = {"learned+sparq": {"residency_budget": min(residency, context)}}
        selector = selectors_for_model(["learned+sparq"], loaded.name, opts)[0]
        probe = VariantProbe(loaded.model, selector, SparsityConfig(a.budget, a.dense_layers), a.reserves,
                             a.prior_weights, a.recent_first)
        start = time.time()
        with attach(loaded.model, probe), torch.no_grad():
            for w in range(len(windows)):
                batch = windows[w : w + 1]
                cache = probe.new_cache()
                loaded.model(batch[:, :context], past_key_values=cache, use_cache=True)
                for t in range(context, batch.shape[1]):
                    loaded.model(batch[:, t : t + 1], past_key_values=cache, use_cache=True)
                print(f"  window {w + 1}/{len(windows)}: {time.time() - start:.0f} s", flush=True)
        rows = {name: acc[0] / acc[1] for name, acc in probe.rows.items()}
        results["residency"][residency] = rows
        print(f"residency {residency}: {time.time() - start:.0f} s", flush=True)
        for name, value in rows.items():
            print(f"  {name:24s} {value:.4f}", flush=True)
        (a.out / "variants.json").write_text(json.dumps(results, indent=1))
    if a.baselines:
        start = time.time()
        chosen = selectors_for_model(["learned", "sparq"], loaded.name)
        report = attention_recall(loaded.model, windows, chosen, [a.budget], n_queries=a.n_queries,
                                  dense_layers=a.dense_layers, batch_size=1, model_name=loaded.name, progress=False)
        results["baselines"] = {f"{s}": v for (s, _), v in report.mean_over_layers().items()}
        print(f"baselines: {time.time() - start:.0f} s", results["baselines"], flush=True)
    (a.out / "variants.json").write_text(json.dumps(results, indent=1))
    write_table(results, a.out / "table.md")


def write_table(results: dict, path: Path) -> None:
    """Rows: variants (then the harness's baselines); columns: residencies."""
    residencies = list(results["residency"])
    names = list(dict.fromkeys(n for rows in results["residency"].values() for n in rows))
    lines = ["| pick | " + " | ".join(f"residency {r}" for r in residencies) + " |",
             "|---" * (len(residencies) + 1) + "|"]
    for name in names:
        cells = [f"{results['residency'][r].get(name, float('nan')):.4f}" for r in residencies]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, value in results["baselines"].items():
        lines.append(f"| harness: {name} | {value:.4f} |" + " |" * (len(residencies) - 1))
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
