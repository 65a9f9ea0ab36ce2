"""`atskv collect`: features and labels for the relevance predictor, one shard per corpus window.

For every window, decision time t (fractions of the window), managed layer and KV head, the
tokens 0..t get the features of `atskv.predictor.features` and three labels: the attention mass
of the next W queries, membership in its top-k, and (with `influence`) the gradient of the
future loss with respect to an additive bias on the token's attention logits.

- Features and mass come from one dense forward through the hook (`atskv.sparse`) with a
  capturing selector: its `prefill` sees one managed layer at a time, builds that layer's
  pooled probabilities `[B, Hkv, T, T]` in query chunks, keeps the sampled rows and drops the
  rest, so no two layers' T x T tensors are alive together. The same capture, keeping every
  row (`decision_features`), gives the policy-gradient rollouts (`atskv.rl`) their features.
- Influence needs gradients through attention logits, which the hook's fused paths do not give;
  a biased attention function (`INFLUENCE_ATTENTION`, also the rollouts' masking) adds zero bias tensors
  `[B, Hkv, t+1]` to the logits of queries after t, and one forward plus one backward per
  decision time read their gradients. Choice: the loss is the mean NLL of the predictions made
  by queries t+1..t+W (tokens t+2..t+W+1), the same queries the mass label averages; token
  t+1 is predicted at position t, which the bias does not reach (its gradient would be zero).
- Only the prefix 0..max(t)+W of a window is run: causality makes later tokens irrelevant.
- Rows are sampled per group (window, t, layer, head): all top-k members and as many uniformly
  drawn non-members, seeded by the key, so shards stay small and classes balanced.

Work is a list of `(key, window)` items processed by `collect_items` into one `ShardWriter`
folder; it skips finished keys, so a rerun resumes. Spreading over GPUs (a later Lightning
`Trainer.predict` loop) gives each rank its own items and its own output folder and calls
`collect_items` there.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from atskv.hook.gqa import grouped_probs
from atskv.models import model_geometry
from atskv.predictor.features import SCALAR_FEATURES, attention_so_far, future_mass, scalar_features, topk_members
from atskv.predictor.model import FeatureSpec
from atskv.predictor.shards import ShardWriter
from atskv.predictor.token_types import token_type_table
from atskv.selectors.base import LayerView, Selector

INFLUENCE_ATTENTION = "atskv_influence"
_BIAS_ATTR = "_atskv_influence_bias"


@dataclass(frozen=True)
class CollectSpec:
    """What is collected from every window; recorded in the manifest meta."""

    window_tokens: int
    decision_points: tuple[float, ...] = (0.5, 0.75)
    future_queries: int = 64
    topk: int = 128
    influence: bool = False
    dense_layers: int = 2
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "decision_points", tuple(float(f) for f in self.decision_points))
        if self.future_queries < 1 or self.topk < 1:
            raise ValueError(f"future_queries and topk must be positive, got {self.future_queries}, {self.topk}")
        if not self.decision_points:
            raise ValueError("need at least one decision point")
        t, w, n = self.decision_times, self.future_queries, self.window_tokens
        if len(set(t)) != len(t) or min(t) < 1 or max(t) + w + 2 > n:
            raise ValueError(
                f"decision points {list(self.decision_points)} give times t={list(t)} in a window of {n} tokens; "
                f"each needs 1 <= t and t + W + 2 <= {n} (W={w} future queries after t, each predicting a "
                "token inside the window), and the times must differ"
            )

    @property
    def decision_times(self) -> tuple[int, ...]:
        return tuple(int(f * self.window_tokens) for f in self.decision_points)

    @property
    def span(self) -> int:
        """Tokens of a window that are run: positions 0..max(t)+W."""
        return max(self.decision_times) + self.future_queries + 1


# Training prompts draw their seeds from here on, so they never coincide with evaluation prompts
# (`atskv eval tasks` and the demo use seeds from 0).
TASK_SEED_BASE = 1_000_000


def task_prompt(tokenizer, task: str, n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of a synthetic task prompt (at most `n_tokens`, classic filler, needle depth
    varying with the seed) and of its answer as the model should continue it (" " + answer)."""
    from atskv.data import CLASSIC_FILLER, TASKS
    from atskv.eval.generation import encode_prompt

    depth = (seed * 0.37) % 1.0
    example = TASKS[task](tokenizer, n_tokens, depth, seed, filler=CLASSIC_FILLER)
    prompt = encode_prompt(tokenizer, example.prompt, chat=False)[0]
    answer = torch.tensor(tokenizer(" " + example.answer, add_special_tokens=False)["input_ids"])
    return prompt, answer


def task_item(
    tokenizer, task: str, n_tokens: int, seed: int, spec: CollectSpec
) -> tuple[str, torch.Tensor, CollectSpec]:
    """A synthetic task prompt with its answer appended, as a work item whose decision time is
    the prompt's last token and whose future queries are the answer's: what the policy must keep
    at the end of a prompt is what the answer will read."""
    prompt, answer = task_prompt(tokenizer, task, n_tokens, seed)
    if answer.numel() < 2:
        raise ValueError(f"task {task!r}: the answer {tokenizer.decode(answer)!r} is one token; it needs two to label")
    window = torch.cat([prompt, answer])
    t = prompt.numel() - 1  # queries t+1.. are the answer's tokens after its first (predicted at t)
    item_spec = replace(
        spec, window_tokens=window.numel(), decision_points=((t + 0.5) / window.numel(),),
        future_queries=answer.numel() - 1,
    )
    return f"{task}-e{seed}", window, item_spec


def collection_meta(model, spec: CollectSpec, model_name: str) -> dict:
    """The manifest meta (contract of issue 4); a folder only accepts shards with equal meta."""
    geometry = model_geometry(model.config)
    managed = managed_layers(model, spec.dense_layers)
    feature_spec = FeatureSpec(geometry.hidden_size, SCALAR_FEATURES, len(managed), geometry.num_kv_heads)
    return {
        "model": model_name,
        "geometry": geometry.to_dict(),
        "feature_spec": feature_spec.to_dict(),
        "managed_layers": managed,
        "window_tokens": spec.window_tokens,
        "future_queries": spec.future_queries,
        "decision_points": list(spec.decision_points),
        "topk": spec.topk,
        "sampling": {"positives": "top-k members", "negatives_per_positive": 1, "seed": spec.seed},
        "influence": spec.influence,
    }


def managed_layers(model, dense_layers: int) -> list[int]:
    """The layers the hook manages with `dense_layers` (what the learned selector will score)."""
    from atskv.hook.sparse import SparseSession, SparsityConfig

    return sorted(SparseSession(model, FeatureCapture(), SparsityConfig(1.0, dense_layers)).managed_layers)


@dataclass
class FeatureCapture(Selector):
    """Keeps everything (dense prefill); in each managed layer's `prefill` it computes the
    features of tokens 0..t at every decision time and hands them to `record`, which by default
    keeps all of them in `features[layer_idx][t]` = (hidden `[t+1, d_model]`, scalars
    `[Hkv, t+1, F]`)."""

    needs_hidden = True
    keeps_all = True
    decision_times: tuple[int, ...] = ()
    query_chunk: int = 512
    prev: dict[int, torch.Tensor] = field(default_factory=dict)  # t -> previous managed layer's attention
    features: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def prefill(self, view: LayerView) -> None:
        n, c = view.query.shape[2], self.query_chunk
        in_order = torch.arange(n, device=view.slot_pos.device)
        if view.query.shape[0] != 1 or not torch.equal(view.slot_pos[0, 0], in_order):
            raise RuntimeError("collection runs one window at a time on a fresh cache")
        chunks = [
            grouped_probs(view.query[:, :, s : s + c], view.keys, view.valid[:, :, s : s + c], view.scaling).mean(2)
            for s in range(0, n, c)
        ]
        probs = torch.cat(chunks, dim=2)  # [1, Hkv, T, T], pooled over the group; freed when this returns
        del chunks
        for t in self.decision_times:
            attention = attention_so_far(probs, t)
            scalars = scalar_features(attention, self.prev.get(t), view.hidden[:, : t + 1], view.keys[:, :, : t + 1], t)
            self.prev[t] = attention.mean(1)
            self.record(view, t, probs, scalars)

    def record(self, view: LayerView, t: int, probs: torch.Tensor, scalars: torch.Tensor) -> None:
        """Keep the features of every token 0..t (`probs` `[1, Hkv, T, T]`, `scalars` `[1, Hkv, t+1, F]`)."""
        self.features.setdefault(view.layer_idx, {})[t] = (view.hidden[0, : t + 1], scalars[0])


def decision_features(
    model, ids: torch.Tensor, t: int, dense_layers: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`{managed layer: (hidden [t+1, d_model], scalars [Hkv, t+1, F])}`: the features of every
    token 0..t at decision time t, from one dense forward of `ids[:, :t+1]` (`[1, >t]`) through
    the hook. No gradients (`no_grad`, not `inference_mode`: the results may feed a trained MLP)."""
    from atskv.hook.sparse import sparse

    capture = FeatureCapture((t,))
    with sparse(model, capture, budget=1.0, dense_layers=dense_layers), torch.no_grad():
        model(ids[:, : t + 1])
    return {layer: by_time[t] for layer, by_time in capture.features.items()}


@dataclass
class _FeatureCapture(FeatureCapture):
    """The collection's capture: at every (t, KV head) it keeps the labels and features of the
    sampled rows only."""

    future_queries: int = 1
    topk: int = 1
    generator: torch.Generator | None = None
    groups: list[dict] = field(default_factory=list)

    def record(self, view: LayerView, t: int, probs: torch.Tensor, scalars: torch.Tensor) -> None:
        mass = future_mass(probs, t, self.future_queries)
        members = topk_members(mass, self.topk)
        for h in range(mass.shape[1]):
            rows = self._sample(members[0, h])
            self.groups.append(
                {
                    "layer_idx": view.layer_idx,
                    "t": t,
                    "head": h,
                    "position": rows,
                    "hidden": view.hidden[0, rows].to(torch.float16),
                    "scalars": scalars[0, h, rows],
                    "mass": mass[0, h, rows],
                    "in_topk": members[0, h, rows],
                }
            )

    def _sample(self, members: torch.Tensor) -> torch.Tensor:
        """Positions of all members plus as many uniformly drawn non-members (all if fewer), sorted."""
        positive = members.nonzero().flatten()
        negative = (~members).nonzero().flatten()
        order = torch.randperm(negative.numel(), generator=self.generator)[: positive.numel()]
        return torch.cat([positive, negative[order.to(negative.device)]]).sort().values


def _stable_int(text: str, bits: int = 63) -> int:
    """A run-independent integer hash (Python's `hash` of a str changes per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> (64 - bits)


def biased_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The biased attention function (influence labels here, policy rollouts in `atskv.rl`):
    layers carrying bias tensors attend eagerly with `bias[b, h, i]` added to the logits of
    every query after t on token i <= t (all query heads of KV head h); other layers run SDPA.
    Full-sequence forwards, or forwards continuing a plain `DynamicCache` (queries are the last
    Tq positions)."""
    biases = getattr(module, _BIAS_ATTR, None)
    if biases is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the influence collection")
    b, s = key.shape[0], key.shape[2]
    tq = query.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is None:
        mask = torch.ones(tq, s, dtype=torch.bool, device=query.device).tril(s - tq)
    else:
        mask = attention_mask[:, 0, :, :s]
        mask = mask if mask.dtype == torch.bool else mask == 0  # additive float mask: 0 where allowed
    queries = torch.arange(s - tq, s, device=query.device)
    bias = sum(
        F.pad(g, (0, s - t - 1))[:, :, None, :] * (queries > t).to(g.dtype)[:, None] for t, g in biases
    )  # [B, Hkv, Tq, S]
    probs = grouped_probs(query, key, mask.view(-1, 1, tq, s), scaling, bias=bias)
    out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))
    return out.view(b, -1, tq, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(INFLUENCE_ATTENTION, biased_attention_forward)
AttentionMaskInterface.register(INFLUENCE_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def attention_biases(model, biases: dict[int, list[tuple[int, torch.Tensor]]]) -> Iterator[None]:
    """Inside the block `model` attends through `biased_attention_forward`: layer l adds every
    `(t, bias [B, Hkv, t+1])` of `biases[l]` to the logits of its queries after t; the other
    layers run SDPA. Full-sequence forwards, or a forward continuing a plain `DynamicCache`."""
    from atskv.hook.sparse import attention_modules

    modules = [m for m in attention_modules(model) if m.layer_idx in biases]
    previous = model.config._attn_implementation
    model.set_attn_implementation(INFLUENCE_ATTENTION)
    for m in modules:
        setattr(m, _BIAS_ATTR, biases[m.layer_idx])
    try:
        yield
    finally:
        for m in modules:
            delattr(m, _BIAS_ATTR)
        model.set_attn_implementation(previous)


def influence_gradients(
    model, ids: torch.Tensor, layers: Sequence[int], spec: CollectSpec
) -> dict[tuple[int, int], torch.Tensor]:
    """`{(t, layer): d loss_t / d bias}` `[1, Hkv, t+1]` for ids `[1, span]`, where loss_t is the mean
    NLL of the predictions of queries t+1..t+W. One forward; one backward per decision time."""
    hkv = model_geometry(model.config).num_kv_heads
    times = spec.decision_times
    biases = {
        (t, layer): torch.zeros(1, hkv, t + 1, device=ids.device, requires_grad=True) for t in times for layer in layers
    }
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in params:  # no parameter gradients: saves the activations only they would need
            p.requires_grad_(False)
        with attention_biases(model, {layer: [(t, biases[t, layer]) for t in times] for layer in layers}):
            with torch.enable_grad():
                logits = model(ids[:, :-1], use_cache=False).logits[0].float()
                nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")  # nll[p]: token p+1 predicted at p
                grads = {}
                for n, t in enumerate(times):
                    wanted = [biases[t, layer] for layer in layers]
                    loss = nll[t + 1 : t + 1 + spec.future_queries].mean()
                    for layer, g in zip(layers, torch.autograd.grad(loss, wanted, retain_graph=n < len(times) - 1)):
                        grads[t, layer] = g
    finally:
        for p in params:
            p.requires_grad_(True)
    return grads


def collect_window(
    model, key: str, window: torch.Tensor, types: torch.Tensor, spec: CollectSpec
) -> dict[str, torch.Tensor]:
    """The shard columns of one window (1-D ids); `types`: the token type of every id."""
    from atskv.hook.sparse import sparse

    device = next(model.parameters()).device
    ids = window[: spec.span + 1].reshape(1, -1).to(device)
    generator = torch.Generator().manual_seed(_stable_int(f"{spec.seed}/{key}"))
    capture = _FeatureCapture(
        spec.decision_times, future_queries=spec.future_queries, topk=spec.topk, generator=generator
    )
    with sparse(model, capture, budget=1.0, dense_layers=spec.dense_layers) as session, torch.inference_mode():
        model(ids[:, :-1])
    managed = sorted(session.managed_layers)
    grads = influence_gradients(model, ids, managed, spec) if spec.influence else None
    index = {layer: i for i, layer in enumerate(managed)}
    columns: dict[str, list[torch.Tensor]] = {}
    for g in capture.groups:
        rows = g["position"]
        n, layer = rows.numel(), index[g["layer_idx"]]
        influence = grads[g["t"], g["layer_idx"]][0, g["head"], rows] if grads else torch.full((n,), float("nan"))
        group = _stable_int(f"{key}/{g['t']}/{layer}/{g['head']}")
        for name, value in {
            "hidden": g["hidden"],
            "scalars": g["scalars"],
            "token_type": types[window[rows.cpu()]],
            "layer": torch.full((n,), layer, dtype=torch.int16),
            "head": torch.full((n,), g["head"], dtype=torch.int8),
            "mass": g["mass"],
            "in_topk": g["in_topk"],
            "influence": influence.float(),
            "group": torch.full((n,), group, dtype=torch.int64),
            "position": rows.to(torch.int32),
            "decision": torch.full((n,), g["t"], dtype=torch.int32),
        }.items():
            columns.setdefault(name, []).append(value.cpu())
    return {name: torch.cat(parts) for name, parts in columns.items()}


def collect_items(
    model,
    tokenizer,
    items: Iterable[tuple],
    writer: ShardWriter,
    spec: CollectSpec,
    *,
    progress: bool = True,
) -> list[str]:
    """Process `(key, window)` work items (or `(key, window, item_spec)`, e.g. a `task_item`) into
    `writer`, skipping finished keys; returns the keys written now. Each shard is durable once
    written, so an interruption loses only the window in progress."""
    todo = [(item[0], item[1], item[2] if len(item) > 2 else spec) for item in items if not writer.has(item[0])]
    types = token_type_table(tokenizer, model.config.get_text_config(decoder=True).vocab_size)
    written = []
    for key, window, item_spec in tqdm(todo, desc="collect", unit="window", disable=not progress):
        writer.write(key, collect_window(model, key, window, types, item_spec))
        written.append(key)
    return written


def collect(
    model,
    tokenizer,
    windows: torch.Tensor,
    out_folder: str | Path,
    *,
    decision_points: Sequence[float] = (0.5, 0.75),
    future_queries: int = 64,
    topk: int = 128,
    influence: bool = False,
    dense_layers: int = 2,
    seed: int = 0,
    model_name: str | None = None,
    corpus: str = "corpus",
    tasks: Sequence[str] = (),
    task_examples: int = 0,
    task_tokens: int | None = None,
    progress: bool = True,
) -> Path:
    """Collect features and labels of `windows` `[N, T]` into `out_folder`, one shard per window
    keyed "<corpus>-w<i>", plus `task_examples` prompts of every task in `tasks` (see
    `task_item`, `task_tokens` long; keyed "<task>-e<seed>"); work already in the folder is
    skipped. Returns the folder."""
    if windows.dim() != 2:
        raise ValueError(f"windows must be [N, T] token ids, got shape {tuple(windows.shape)}")
    spec = CollectSpec(windows.shape[1], tuple(decision_points), future_queries, topk, influence, dense_layers, seed)
    name = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
    meta = collection_meta(model, spec, name)
    if tasks and task_examples:
        meta["tasks"] = {"names": list(tasks), "examples": task_examples, "tokens": task_tokens or spec.window_tokens}
    writer = ShardWriter(out_folder, meta)
    items = [(f"{corpus}-w{i}", w) for i, w in enumerate(windows)]
    for task in tasks:
        seeds = range(TASK_SEED_BASE, TASK_SEED_BASE + task_examples)
        items += [task_item(tokenizer, task, task_tokens or spec.window_tokens, s, spec) for s in seeds]
    collect_items(model, tokenizer, items, writer, spec, progress=progress)
    return writer.folder


__all__ = ["CollectSpec", "collect", "collect_items", "collection_meta", "influence_gradients"]
