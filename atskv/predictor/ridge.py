"""A linear relevance scorer per managed layer and KV head, fitted in closed form (`atskv ridge`).

kvpress's KVzap keeps a per-layer ridge regression beside its MLP (`kvpress/presses/kvzap/train.py`):
a baseline that says what the MLP's non-linearity buys, fitted in seconds with no training loop.
Here it reads the MLP's inputs: the RMS-normalised hidden state, the scalar features
(standardised by the training rows' mean and deviation, stored with the weights) and the token
type one-hot, with its own weights and intercept for every (managed layer, KV head), regressing
log(label score) as KVzap regresses log KVzip+ scores (the score floored at `LOG_FLOOR`).

The fit accumulates, per (layer, KV head), the sums and the Gram matrix of the design over the
training windows in float64 (memory: layers x KV heads x (d_model + F + types)^2 x 8 bytes,
0.24 GB for SmolLM2-135M), then solves the centred normal equations for every penalty in
`alphas` from one eigendecomposition each, and keeps the penalty with the best validation recall
(the MLP's checkpoint metric, on the same validation windows as `atskv fit`). The penalty
is per row: the Gram matrix is divided by the rows, so `alpha` means the same for any amount of data.

At run time `project_hidden` gives every (layer, KV head)'s hidden-state term at once, so the
learned selector stores layers x KV heads numbers per token and KV head (84 for SmolLM2, the MLP
64) and `score` picks its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from atskv.predictor.model import FeatureSpec, RelevanceScorer

LOG_FLOOR = 1e-8  # scores below it regress as it: log(0) has no value, and far tails would dominate the loss
ALPHAS = (0.01, 0.1, 1.0, 10.0)


class RidgeScorer(RelevanceScorer):
    """`score = w_h . rms(h) + w_s . standardised scalars + w_type + b`, weights per (layer, KV head)."""

    kind = "ridge"

    def __init__(self, spec: FeatureSpec):
        super().__init__()
        self.spec = spec
        units, f = spec.num_layers * spec.num_kv_heads, len(spec.scalar_features)
        self.register_buffer("hidden_weight", torch.zeros(units, spec.d_model))
        self.register_buffer("scalar_weight", torch.zeros(units, f))
        self.register_buffer("type_weight", torch.zeros(units, spec.num_token_types))
        self.register_buffer("bias", torch.zeros(units))
        self.register_buffer("scalar_mean", torch.zeros(f))
        self.register_buffer("scalar_std", torch.ones(f))

    @property
    def projected_width(self) -> int:
        return self.hidden_weight.shape[0]

    def arguments(self) -> dict:
        return {}

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.normalised(hidden) @ self.hidden_weight.T

    def standardised(self, scalars: torch.Tensor) -> torch.Tensor:
        return (scalars.to(self.dtype) - self.scalar_mean) / self.scalar_std

    def score(self, projected, scalars, token_types, layer, head) -> torch.Tensor:
        self.check_rows(projected.shape[0], scalars, token_types, layer, head)
        unit = layer.long() * self.spec.num_kv_heads + head.long()
        return (
            projected.to(self.dtype).gather(1, unit[:, None]).squeeze(1)
            + (self.standardised(scalars) * self.scalar_weight[unit]).sum(-1)
            + self.type_weight[unit, token_types.long()]
            + self.bias[unit]
        )

    def design(self, hidden, scalars, token_types) -> torch.Tensor:
        """The regression's inputs `[N, d_model + F + types]`, in the order of the weights."""
        one_hot = F.one_hot(token_types.long(), self.spec.num_token_types).to(self.dtype)
        return torch.cat([self.normalised(hidden), self.standardised(scalars), one_hot], dim=-1)

    def set_weights(self, weights: torch.Tensor, bias: torch.Tensor) -> None:
        """Load `weights` `[units, d_model + F + types]` (in `design` order) and `bias` `[units]`."""
        d, f = self.spec.d_model, len(self.spec.scalar_features)
        weights = weights.to(self.dtype)
        self.hidden_weight.copy_(weights[:, :d])
        self.scalar_weight.copy_(weights[:, d : d + f])
        self.type_weight.copy_(weights[:, d + f :])
        self.bias.copy_(bias.to(self.dtype))


def log_target(score: torch.Tensor) -> torch.Tensor:
    return score.double().clamp(min=LOG_FLOOR).log()


@dataclass
class RidgeFit:
    """A fitted scorer, its penalty and every penalty's validation recall (`metric`: the window
    recall over held-out full windows, else the mass recall over the sampled rows, as `atskv fit`
    checkpoints)."""

    scorer: RidgeScorer
    alpha: float
    validation: dict[float, float]
    collection: dict  # the collection's manifest meta
    metric: str = "mass_recall"


@dataclass
class _Moments:
    """Per (layer, KV head): rows, sums of x and y, x^T x and x^T y (float64)."""

    rows: torch.Tensor
    sum_x: torch.Tensor
    sum_y: torch.Tensor
    xx: torch.Tensor
    xy: torch.Tensor

    @classmethod
    def zeros(cls, units: int, p: int) -> _Moments:
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
        return cls(z(units), z(units, p), z(units), z(units, p, p), z(units, p))

    def add(self, unit: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        for u in unit.unique().tolist():
            rows = unit == u
            xu, yu = x[rows].double(), y[rows]
            self.rows[u] += rows.sum()
            self.sum_x[u] += xu.sum(0)
            self.sum_y[u] += yu.sum()
            self.xx[u] += xu.T @ xu
            self.xy[u] += xu.T @ yu

    def solutions(self, alphas: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weights `[units, p]`, bias `[units]`) for every penalty: ridge on the centred design,
        the intercept unpenalised; units without rows keep zero weights."""
        n = self.rows.clamp(min=1)[:, None]
        mean_x, mean_y = self.sum_x / n, self.sum_y / n[:, 0]
        covariance = self.xx / n[..., None] - mean_x[:, :, None] * mean_x[:, None, :]
        cross = self.xy / n - mean_x * mean_y[:, None]
        values, vectors = torch.linalg.eigh(covariance)
        projected = (vectors.transpose(1, 2) @ cross[..., None])[..., 0]
        solutions = []
        for alpha in alphas:
            weights = (vectors @ (projected / (values.clamp(min=0) + alpha))[..., None])[..., 0]
            solutions.append((weights, mean_y - (weights * mean_x).sum(-1)))
        return solutions


def fit_ridge(
    folder: str | Path,
    alphas: Sequence[float] = ALPHAS,
    validation_fraction: float = 0.1,
    seed: int = 0,
    batch_rows: int = 32768,
) -> RidgeFit:
    """Fit a `RidgeScorer` on the collection in `folder` for every penalty in `alphas` and keep the
    one with the best validation recall (windows split as `atskv fit` splits them with `data.seed`
    = `seed`, full windows held out first; their window recall where some are, else the sampled
    rows' mass recall). Of a collection with full windows only the `sampled` rows are trained on,
    as `atskv fit` trains on them."""
    from atskv.predictor.shards import ShardDataset, label_column
    from atskv.predictor.training import mass_recall, training_columns

    if not alphas or min(alphas) <= 0:
        raise ValueError(f"alphas must be positive penalties, got {list(alphas)}")
    meta = ShardDataset(folder, []).meta
    if "feature_spec" not in meta:
        raise ValueError(f"{folder}'s manifest has no feature_spec: not a predictor collection")
    train, held_out = ShardDataset(folder, training_columns(meta)).split_by_key(
        validation_fraction, seed, meta.get("full_keys", ())
    )
    windows = held_out.has_full_groups()
    label = label_column(meta)
    scorer = RidgeScorer(FeatureSpec.from_dict(meta["feature_spec"]))
    scalars = train.column("scalars").double()
    if "sampled" in train.columns:
        scalars = scalars[train.column("sampled")]
    scorer.scalar_mean.copy_(scalars.mean(0))
    scorer.scalar_std.copy_(scalars.std(0).clamp(min=1e-6))

    def batches(data: ShardDataset, rows: str = "sampled"):
        for start in range(0, len(data), batch_rows):
            b = data.__getitems__(list(range(start, min(start + batch_rows, len(data)))))
            yield {c: v[b[rows]] for c, v in b.items()} if rows in b else b

    spec = scorer.spec
    moments = _Moments.zeros(scorer.projected_width, spec.d_model + len(spec.scalar_features) + spec.num_token_types)
    with torch.no_grad():
        for b in batches(train):
            unit = b["layer"].long() * spec.num_kv_heads + b["head"].long()
            moments.add(unit, scorer.design(b["hidden"], b["scalars"], b["token_type"]), log_target(b[label]))
        validation = list(batches(held_out, "full" if windows else "sampled"))
        truth = [torch.cat([b[c] for b in validation]) for c in (label, "in_topk", "group")]
        recalls = {}
        for alpha, (weights, bias) in zip(alphas, moments.solutions(alphas)):
            scorer.set_weights(weights, bias)
            preds = [scorer(b["hidden"], b["scalars"], b["token_type"], b["layer"], b["head"]) for b in validation]
            recalls[float(alpha)] = float(mass_recall(torch.cat(preds), *truth))
        best = max(recalls, key=lambda a: (recalls[a], a))  # ties: the stronger penalty
        scorer.set_weights(*moments.solutions([best])[0])
    return RidgeFit(scorer.eval(), best, recalls, meta, "window_recall" if windows else "mass_recall")
