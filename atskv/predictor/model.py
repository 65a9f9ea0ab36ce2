"""The relevance predictor: `r = sigmoid(W2 · ReLU(W1 · [h; a; f] + b1) + b2)` (the ATSKV
proposal, "Adaptive Token-Relevance Sparse KV-Cache for Efficient Long Context Understanding").

One MLP serves every managed layer and KV head, told which one it scores by small learned layer
and head embeddings in its input. Separate MLPs per (layer, head) would multiply the parameters
by layers x heads (84 for SmolLM2) and split the training data as many ways, although most cues
(token type, accumulated attention, age) mean the same in every layer; the embeddings shift the
hidden units per layer and head, which lets ReLU units switch on or off where a cue matters.

Choices where the proposal leaves one:
- W1's block for the hidden state is factorised through a `reduced_width` projection (d_r), so
  the projection can be computed once when a token enters the cache and reused by every head
  and every refresh (`project_hidden`, then `score`). Hidden states are RMS-normalised first:
  their scale grows along the residual stream and is given separately as the norm feature.
- Scalar features are standardised by a non-affine batch norm whose running statistics travel
  with the weights, so callers pass raw values (counts, norms, log ages).
- Token types enter one-hot: with eight types that is a learned column of W1 per type.
- Default `hidden` 768 puts SmolLM2-135M and Gemma 3 270M at about 110K parameters, the low end
  of the proposal's 100K-500K, keeping the cost of a refresh small.
- Any input can be left out, for ablations: the hidden state with `reduced_width` 0, scalar
  features and the token type by name in `without` (W1 then reads only the rest).

`RelevanceScorer` is what the learned selector, export and evaluation rely on; the MLP is one
kind, the closed-form ridge scorer (`atskv.predictor.ridge`) another.
"""

import itertools
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from atskv.predictor.token_types import TOKEN_TYPES


@dataclass(frozen=True)
class FeatureSpec:
    """What a predictor reads; saved with it so it is never fed another model's features."""

    d_model: int
    scalar_features: tuple[str, ...]
    num_layers: int  # managed (sparse) layers, indexed 0..num_layers-1
    num_kv_heads: int
    token_types: tuple[str, ...] = TOKEN_TYPES

    def __post_init__(self):
        object.__setattr__(self, "scalar_features", tuple(self.scalar_features))
        object.__setattr__(self, "token_types", tuple(self.token_types))
        for name in ("d_model", "num_layers", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"FeatureSpec.{name} must be positive, got {getattr(self, name)}")
        if not self.scalar_features or len(set(self.scalar_features)) != len(self.scalar_features):
            raise ValueError(f"FeatureSpec.scalar_features must be non-empty and unique, got {self.scalar_features}")

    @property
    def num_token_types(self) -> int:
        return len(self.token_types)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "FeatureSpec":
        names = {f.name for f in fields(cls)}
        if unknown := set(data) - names:
            raise ValueError(f"unknown FeatureSpec fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**data)


class RelevanceScorer(nn.Module):
    """Relevance logits for (token, managed layer, KV head) rows, in two steps so the learned
    selector can store a token's hidden-state part once, when it enters the cache:
    `project_hidden` (per token, shared by the KV heads; `projected_width` wide) and `score`.
    `kind` names the class in a predictor file and `arguments()` rebuilds it with the spec."""

    kind: ClassVar[str] = ""
    spec: FeatureSpec

    @property
    def projected_width(self) -> int:
        raise NotImplementedError

    def arguments(self) -> dict:
        """Constructor arguments besides the spec, read off the scorer (what an export records)."""
        raise NotImplementedError

    def inputs(self) -> set[str]:
        """What the scores depend on: "hidden" (the projected hidden state), "token_type" and the
        scalar features by name; a runtime that cannot compute some of them (an attention backend
        sees no hidden state or token ids) refuses a scorer that reads them. By default all."""
        return {"hidden", "token_type", *self.spec.scalar_features}

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, d_model]` layer-input hidden states -> `[N, projected_width]`."""
        raise NotImplementedError

    def score(self, projected, scalars, token_types, layer, head) -> torch.Tensor:
        """Logits `[N]` from projected hidden states `[N, projected_width]`, raw scalar features
        `[N, F]` (in `spec.scalar_features` order), and type / managed-layer / KV-head indices `[N]`."""
        raise NotImplementedError

    def forward(self, hidden, scalars, token_types, layer, head) -> torch.Tensor:
        """Logits `[N]` for hidden states `[N, d_model]` and the `score` inputs."""
        return self.score(self.project_hidden(hidden), scalars, token_types, layer, head)

    @property
    def device(self) -> torch.device:
        return self._any_tensor().device

    @property
    def dtype(self) -> torch.dtype:
        return self._any_tensor().dtype

    def _any_tensor(self) -> torch.Tensor:
        return next(itertools.chain(self.parameters(), self.buffers()))

    def normalised(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states RMS-normalised in the scorer's dtype: their scale grows along the residual
        stream and is a scalar feature of its own (`hidden_norm`)."""
        if hidden.shape[-1] != self.spec.d_model:
            raise ValueError(f"hidden states have width {hidden.shape[-1]}, the predictor expects {self.spec.d_model}")
        hidden = hidden.to(self.dtype)
        return F.rms_norm(hidden, (hidden.shape[-1],))

    def check_rows(self, n: int, scalars, token_types, layer, head) -> None:
        if scalars.shape != (n, len(self.spec.scalar_features)):
            raise ValueError(
                f"scalar features have shape {tuple(scalars.shape)}, expected ({n}, {len(self.spec.scalar_features)}) "
                f"for {self.spec.scalar_features}"
            )
        if token_types.shape != (n,) or layer.shape != (n,) or head.shape != (n,):
            raise ValueError(
                f"token types, layers and heads must have shape ({n},), got "
                f"{tuple(token_types.shape)}, {tuple(layer.shape)}, {tuple(head.shape)}"
            )


class RelevanceMLP(RelevanceScorer):
    """Relevance logits for (token, managed layer, KV head) rows; sigmoid gives r in (0, 1)."""

    kind = "mlp"

    def __init__(
        self,
        spec: FeatureSpec,
        reduced_width: int = 64,
        hidden: int = 768,
        layer_embedding: int = 8,
        head_embedding: int = 4,
        without: tuple[str, ...] | list[str] = (),
    ):
        super().__init__()
        self.spec = spec
        self.without = tuple(without)
        if unknown := set(self.without) - {*spec.scalar_features, "token_type"}:
            raise ValueError(f"without names {sorted(unknown)}; it takes scalar features {spec.scalar_features} "
                             "and token_type")
        kept = [i for i, name in enumerate(spec.scalar_features) if name not in self.without]
        # a buffer, not a list: it moves with the module, so indexing never copies from the host (a
        # CUDA graph capturing the fast path's refresh step refuses that copy)
        self.register_buffer("kept", torch.tensor(kept, dtype=torch.long), persistent=False)
        self.types = "token_type" not in self.without
        self.project = nn.Linear(spec.d_model, reduced_width)
        self.scalar_norm = nn.BatchNorm1d(len(spec.scalar_features), affine=False)
        self.layer_embedding = nn.Embedding(spec.num_layers, layer_embedding)
        self.head_embedding = nn.Embedding(spec.num_kv_heads, head_embedding)
        types = spec.num_token_types if self.types else 0
        width = reduced_width + len(self.kept) + types + layer_embedding + head_embedding
        self.w1 = nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, 1)

    @property
    def projected_width(self) -> int:
        return self.project.out_features

    def arguments(self) -> dict:
        widths = {
            "reduced_width": self.project.out_features,
            "hidden": self.w1.out_features,
            "layer_embedding": self.layer_embedding.embedding_dim,
            "head_embedding": self.head_embedding.embedding_dim,
        }
        return {**widths, "without": list(self.without)} if self.without else widths

    def inputs(self) -> set[str]:
        read = {name for name in self.spec.scalar_features if name not in self.without}
        if self.projected_width > 0:
            read.add("hidden")
        if self.types:
            read.add("token_type")
        return read

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(self.normalised(hidden))

    def score(
        self,
        projected: torch.Tensor,
        scalars: torch.Tensor,
        token_types: torch.Tensor,
        layer: torch.Tensor,
        head: torch.Tensor,
    ) -> torch.Tensor:
        self.check_rows(projected.shape[0], scalars, token_types, layer, head)
        parts = [projected, self.scalar_norm(scalars.to(projected.dtype))[:, self.kept]]
        if self.types:
            parts.append(F.one_hot(token_types.long(), self.spec.num_token_types).to(projected.dtype))
        x = torch.cat([*parts, self.layer_embedding(layer.long()), self.head_embedding(head.long())], dim=-1)
        return self.w2(F.relu(self.w1(x))).squeeze(-1)
