"""Kascade's per-model profile (Deshmukh et al., 2025, arXiv:2512.16391): which managed layers compute
their own top-k (*anchors*) and, for every other (*reuse*) layer, which KV head of its anchor each
of its KV heads borrows the top-k from.

It is measured once per model on development text, as the paper does:
- attention of the last `queries` queries of each window, post-softmax and pooled over each KV
  group's query heads (the paper's GQA pooling), per managed layer and KV head;
- head similarity `sim(a, h' -> b, h)`: the share of head (b, h)'s own top-k attention mass that
  the top-k tokens of head (a, h') recover (the paper's Eq. 3 at head level), taken as the
  *minimum* over the queries of a window (the paper's conservative choice) and averaged over
  windows; top-k 64 as in the paper;
- head remapping: each reuse head takes the anchor head that recovers most of its mass (many to
  one allowed); the layer similarity is the mean over the reuse layer's heads under that map;
- layer importance `w_b = 1 - cos(attention input, attention output)` averaged over the same
  queries, and anchors chosen by the paper's dynamic program on `w_b * sim(a, b)`.
Layers the hook keeps dense (`dense_layers`, the paper's dense layer 0) are outside the profile;
the first managed layer is always an anchor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.attention import grouped_probs
from atskv.models import ModelGeometry, attention_modules, model_geometry
from atskv.paths import default_cache_dir
from atskv.selectors.base import LayerView, Selector

PROFILE_FORMAT = 1


def default_profile_path(model_name: str) -> Path:
    """Where `atskv profile kascade` saves the profile of a model by default."""
    return default_cache_dir() / "profiles" / model_name / "kascade.json"


@dataclass
class KascadeProfile:
    """Anchors and head map of one model; `similarity` is indexed by position in `managed_layers`."""

    model: str
    geometry: ModelGeometry
    managed_layers: list[int]
    anchors: list[int]
    head_map: dict[int, list[int]]  # reuse layer -> the anchor KV head each of its KV heads reuses
    similarity: list[list[float]]  # sim(a, b) with head remapping, before importance weighting
    importance: list[float]  # w_b per managed layer
    topk: int
    queries: int  # queries per window the similarity was measured on
    dev_set: str

    def __post_init__(self):
        managed = self.managed_layers
        if not managed or managed != sorted(set(managed)):
            raise ValueError(f"managed_layers must be increasing and non-empty, got {managed}")
        if not self.anchors or not set(self.anchors) <= set(managed) or self.anchors != sorted(set(self.anchors)):
            raise ValueError(f"anchors {self.anchors} must be increasing and among the managed layers {managed}")
        if self.anchors[0] != managed[0]:
            raise ValueError(f"the first managed layer ({managed[0]}) must be an anchor, got anchors {self.anchors}")
        reuse = sorted(set(managed) - set(self.anchors))
        self.head_map = {int(k): [int(h) for h in v] for k, v in self.head_map.items()}
        if sorted(self.head_map) != reuse:
            raise ValueError(f"head_map must cover exactly the reuse layers {reuse}, got {sorted(self.head_map)}")
        hkv = self.geometry.num_kv_heads
        for layer, heads in self.head_map.items():
            if len(heads) != hkv or not all(0 <= h < hkv for h in heads):
                raise ValueError(f"head_map[{layer}] must name one of {hkv} anchor KV heads per KV head, got {heads}")

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    def anchor_of(self, layer: int) -> int:
        """The nearest anchor at or before `layer` (a managed layer)."""
        return max(a for a in self.anchors if a <= layer)

    def check_model(self, model_or_config) -> None:
        """Refuse a model whose attention geometry differs from the one the profile was measured on."""
        self.geometry.require_same(
            model_or_config,
            f"this Kascade profile was computed for {self.model!r}",
            "compute a profile for this model with `atskv profile kascade --model MODEL`",
        )

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (parent folders created), whole or not at all: a process loading it
        while another rewrites it (parallel leaderboard workers) reads the old file or the new one."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": PROFILE_FORMAT, **asdict(self), "geometry": self.geometry.to_dict()}
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | Path, model=None) -> KascadeProfile:
        """Read a profile written by `save`; with `model`, also check it fits that model."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no Kascade profile at {path}; {HOW_TO_COMPUTE}")
        data = json.loads(path.read_text())
        if data.pop("format", None) != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a Kascade profile of format {PROFILE_FORMAT}")
        profile = cls(**{**data, "geometry": ModelGeometry.from_dict(data["geometry"])})
        if model is not None:
            profile.check_model(model)
        return profile


HOW_TO_COMPUTE = (
    "compute one per model with `atskv profile kascade --model MODEL` "
    f"(saved to {default_profile_path('<model name>')}; in Python: KascadeSelector(profile=PATH))"
)


PAPER_ANCHORS = 5  # anchor layers the Kascade paper chooses


def choose_anchors(weighted: torch.Tensor, n_anchors: int) -> list[int]:
    """The paper's dynamic program (Algorithm 1): `n_anchors` indices, the first being 0, that
    maximise `sum_b weighted[anchor(b), b]`, where anchor(b) is the nearest anchor at or before b.

    `weighted[a, b]` is the importance-weighted similarity of reuse layer b to anchor a (a <= b;
    its diagonal is what an anchor scores for itself)."""
    n = weighted.shape[0]
    if not 1 <= n_anchors <= n:
        raise ValueError(f"n_anchors must lie between 1 and the {n} managed layers, got {n_anchors}")
    w = weighted.double().cpu()
    cum = torch.cat([torch.zeros(n, 1, dtype=w.dtype), w.cumsum(1)], 1)  # cum[a, j] = sum_{l<j} w[a, l]

    def segment(a: int, end: int) -> float:  # value of layers a..end-1, all reusing anchor a
        return float(cum[a, end] - cum[a, a])

    # best[m][j]: best value of layers 0..j-1 with m anchors (the first at 0) when j starts the next
    # segment (j = n closes the last one); back[m][j]: the m-th anchor achieving it
    best = [[-float("inf")] * (n + 1) for _ in range(n_anchors + 1)]
    back = [[0] * (n + 1) for _ in range(n_anchors + 1)]
    for j in range(1, n + 1):
        best[1][j] = segment(0, j)
    for m in range(2, n_anchors + 1):
        for j in range(m, n + 1):
            for a in range(m - 1, j):
                value = best[m - 1][a] + segment(a, j)
                if value > best[m][j]:
                    best[m][j], back[m][j] = value, a
    anchors, j = [], n
    for m in range(n_anchors, 1, -1):
        j = back[m][j]
        anchors.append(j)
    return [0, *reversed(anchors)]


def head_similarity(probs: torch.Tensor, topk: int) -> torch.Tensor:
    """`sim[a, h', b, h]` for one window: the minimum over queries of the share of head (b, h)'s
    own top-k mass recovered by the top-k tokens of head (a, h').

    `probs` `[L, Hkv, Q, S]`: GQA-pooled attention probabilities of Q queries in L layers."""
    layers, heads, _, s = probs.shape
    k = min(topk, s)
    top = probs.topk(k, dim=-1).indices  # [L, H, Q, k]
    own = probs.gather(-1, top).sum(-1)  # [L, H, Q]
    out = probs.new_empty(layers, heads, layers, heads)
    every = probs.unsqueeze(0).expand(heads, *probs.shape)  # [H', L, H, Q, S]
    for a in range(layers):
        idx = top[a][:, None, None].expand(heads, layers, heads, -1, k)
        recovered = every.gather(-1, idx).sum(-1)  # [H', L, H, Q]
        out[a] = (recovered / own).amin(-1)
    return out


@dataclass
class AttentionCapture(Selector):
    """Keeps nothing out (keeps_all): after each dense prefill it records the GQA-pooled attention
    of the last `queries` queries of every managed layer."""

    keeps_all = True

    queries: int = 64
    probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def prefill(self, view: LayerView) -> None:
        n = min(self.queries, view.query.shape[2])
        probs = grouped_probs(view.query[:, :, -n:], view.keys, view.valid[:, :, -n:], view.scaling)
        self.probs[view.layer_idx] = probs.mean(2)  # [B, Hkv, Q, S]


def compute_kascade_profile(
    model,
    windows: Sequence[torch.Tensor],
    n_anchors: int | None = None,
    topk: int = 64,
    *,
    sparse: Callable[..., AbstractContextManager],
    queries: int = 64,
    dense_layers: int = 2,
    model_name: str | None = None,
    dev_set: str = "",
) -> KascadeProfile:
    """Run `model` densely over token `windows` (1-D id tensors) and derive its Kascade profile
    (see the module docstring). `dense_layers` must match the hook's setting at run time.
    `n_anchors`: None takes the paper's `PAPER_ANCHORS`, or every managed layer where a model has
    fewer (Gemma 3 270M manages only its 3 global layers).

    `sparse` runs the model with a selector and gives the session: pass `atskv.sparse` (it is
    passed in, not imported, because the hook imports the selector registry, which imports this)."""
    if not windows:
        raise ValueError("need at least one development window")
    capture = AttentionCapture(queries)
    device = next(model.parameters()).device
    cosines: dict[int, torch.Tensor] = {}
    head_sum, importance_sum = 0.0, 0.0
    longest = max(int(w.numel()) for w in windows)  # every token kept (dense prefill: no budget applies)
    with sparse(model, capture, budget=longest, dense_layers=dense_layers) as session:
        managed = sorted(session.managed_layers)
        if not managed:
            raise ValueError(f"no layer is managed with dense_layers={dense_layers}")
        record = cosine_recorder(cosines, queries)
        modules = [m for m in attention_modules(model) if m.layer_idx in session.managed_layers]
        hooks = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
        try:
            for window in tqdm(windows, desc="kascade profile", unit="window"):
                with torch.inference_mode():
                    model(window.reshape(1, -1).to(device))
                probs = torch.stack([capture.probs[i][0] for i in managed])  # [L, H, Q, S]
                head_sum = head_sum + head_similarity(probs, topk)
                importance_sum = importance_sum + 1 - torch.stack([cosines[i] for i in managed])
        finally:
            for hook in hooks:
                hook.remove()
    heads = (head_sum / len(windows)).float().cpu()  # [L, H', L, H]
    importance = (importance_sum / len(windows)).float().cpu()
    best, best_head = heads.max(dim=1)  # over the anchor's heads: [L, L, H]
    similarity = best.mean(-1)  # [a, b]
    n_anchors = min(PAPER_ANCHORS, len(managed)) if n_anchors is None else n_anchors
    chosen = choose_anchors(similarity * importance[None, :], n_anchors)
    anchor_index = {b: max(a for a in chosen if a <= b) for b in range(len(managed))}
    head_map = {managed[b]: best_head[anchor_index[b], b].tolist() for b in range(len(managed)) if b not in chosen}
    return KascadeProfile(
        model=model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type,
        geometry=model_geometry(model.config),
        managed_layers=managed,
        anchors=[managed[a] for a in chosen],
        head_map=head_map,
        similarity=similarity.tolist(),
        importance=importance.tolist(),
        topk=topk,
        queries=queries,
        dev_set=dev_set or f"{len(windows)} windows of {windows[0].numel()} tokens",
    )


def cosine_recorder(out: dict[int, torch.Tensor], queries: int):
    """Forward hook of an attention module: mean cosine between its input and output over the
    last `queries` positions (the paper's layer importance is one minus it)."""

    def hook(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        y = output[0] if isinstance(output, tuple) else output
        cos = torch.nn.functional.cosine_similarity(x[:, -queries:].float(), y[:, -queries:].float(), dim=-1)
        out[module.layer_idx] = cos.mean()

    return hook
