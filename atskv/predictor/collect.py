"""`atskv collect`: features and labels for the relevance predictor, one shard per corpus window.

For every window, decision time t (fractions of the window), managed layer and KV head, the
tokens 0..t get the features of `atskv.predictor.features` and the labels of
`atskv.predictor.labels` (future attention mass, top-k membership, optionally influence), from
one dense forward through the hook (`atskv.predictor.capture`). Only the prefix 0..max(t)+W of
a window is run: causality makes later tokens irrelevant. With `label="kvzip"` one more forward
per decision time (tokens 0..t, an instruction, tokens 0..t again: `atskv.predictor.kvzip`) gives
the reconstruction scores that then pick the top-k.

Each group (window, t, layer, KV head) keeps a sample of its tokens (all top-k members and as
many others: `LabelCapture`). With `full_windows` N > 0 the first N corpus windows keep every
token 0..t instead (t+1 rows a group, several times a sampled window's size), and every shard of
the collection gets two more columns: `full` (the row's group is complete) and `sampled` (the
row is one the sample holds: every row of a sampled window, the same draws in a full one). Fit
trains on the `sampled` rows only, so the training data do not depend on N, and validates the
whole-window recall on the `full` groups (`atskv.predictor.training`). Task prompts are never
full. The manifest meta records `full_windows` and their keys (`full_keys`, which fit's split holds
out for validation first) only when N > 0: a default collection's manifest and shards are what
they were before, and older folders resume.

Work is a list of `(key, window)` items processed by `collect_items` into one `ShardWriter`
folder (`atskv.predictor.shards`); it skips finished keys, so a rerun resumes. A folder holding
another collection (other corpus, model or settings) is refused unless `start_over`.

Under torch.distributed (`atskv.predictor.launch.spawn`) every process builds the same work list,
takes every N-th unfinished item (round robin from its rank, so a resumed run stays balanced)
and writes its shards into the same folder, named by the item's index; the manifest is put in
work order at the end. Windows are computed alone either way, so the shards are those of one
process.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atskv.features import SCALAR_FEATURES
from atskv.models import model_geometry
from atskv.predictor.capture import managed_layers
from atskv.predictor.distributed import barrier, rank, stable_seed, world_size
from atskv.predictor.kvzip import REPEAT_PROMPT, repeat_scores
from atskv.predictor.labels import LABELS, LabelCapture, influence_gradients
from atskv.predictor.model import FeatureSpec
from atskv.predictor.shards import ShardWriter
from atskv.predictor.token_types import token_type_table


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
    label: str = "mass"  # what ranks the tokens: `LABELS` (atskv.predictor.labels)
    full_windows: int = 0  # the first N corpus windows keep every token 0..t (see the module docstring)

    def __post_init__(self):
        object.__setattr__(self, "decision_points", tuple(float(f) for f in self.decision_points))
        if self.label not in LABELS:
            raise ValueError(f"label must be one of {', '.join(LABELS)}, got {self.label!r}")
        if self.future_queries < 1 or self.topk < 1:
            raise ValueError(f"future_queries and topk must be positive, got {self.future_queries}, {self.topk}")
        if self.full_windows < 0:
            raise ValueError(f"full_windows must be >= 0, got {self.full_windows}")
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
    from atskv.data.prompts import encode_prompt

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


def collection_meta(model, spec: CollectSpec, model_name: str, corpus: str = "corpus") -> dict:
    """The manifest meta; a folder only accepts shards with equal meta."""
    geometry = model_geometry(model.config)
    managed = managed_layers(model, spec.dense_layers)
    feature_spec = FeatureSpec(geometry.hidden_size, SCALAR_FEATURES, len(managed), geometry.num_kv_heads)
    return {
        "model": model_name,
        "corpus": corpus,
        "geometry": geometry.to_dict(),
        "feature_spec": feature_spec.to_dict(),
        "managed_layers": managed,
        "window_tokens": spec.window_tokens,
        "future_queries": spec.future_queries,
        "decision_points": list(spec.decision_points),
        "topk": spec.topk,
        "sampling": {"positives": "top-k members", "negatives_per_positive": 1, "seed": spec.seed},
        "influence": spec.influence,
        "label": spec.label,
        **({"full_windows": spec.full_windows} if spec.full_windows else {}),  # absent: 0 (older collections)
    }


def collect_window(
    model, key: str, window: torch.Tensor, types: torch.Tensor, spec: CollectSpec, instruction: torch.Tensor,
    full: bool = False,
) -> dict[str, torch.Tensor]:
    """The shard columns of one window (1-D ids); `types`: the token type of every id;
    `instruction`: the ids of `REPEAT_PROMPT` (read with `label="kvzip"` only); `full`: keep every
    token 0..t of each group. With `spec.full_windows` > 0 the columns include `full` and
    `sampled` (see the module docstring), whether or not this window is full."""
    from atskv.runtime.reference.sparse import sparse

    device = next(model.parameters()).device
    ids = window[: spec.span + 1].reshape(1, -1).to(device)
    generator = torch.Generator().manual_seed(stable_seed(f"{spec.seed}/{key}"))
    kvzip = {}
    if spec.label == "kvzip":
        layers = managed_layers(model, spec.dense_layers)
        for t in spec.decision_times:
            scores = repeat_scores(model, ids[0, : t + 1], instruction, layers)
            kvzip.update({(t, layer): s for layer, s in scores.items()})
    capture = LabelCapture(
        spec.decision_times, future_queries=spec.future_queries, topk=spec.topk, generator=generator, kvzip=kvzip,
        full=full,
    )
    every_token = ids.shape[1]  # an int budget: tokens (1.0 is not a budget)
    with sparse(model, capture, budget=every_token, dense_layers=spec.dense_layers) as session, torch.inference_mode():
        model(ids[:, :-1])
    managed = sorted(session.managed_layers)
    grads = None
    if spec.influence:
        grads = influence_gradients(model, ids, managed, spec.decision_times, spec.future_queries)
    index = {layer: i for i, layer in enumerate(managed)}
    columns: dict[str, list[torch.Tensor]] = {}
    for g in capture.groups:
        rows = g["position"]
        n, layer = rows.numel(), index[g["layer_idx"]]
        influence = grads[g["t"], g["layer_idx"]][0, g["head"], rows] if grads else torch.full((n,), float("nan"))
        group = stable_seed(f"{key}/{g['t']}/{layer}/{g['head']}")
        kvzip = {"kvzip": g["kvzip"]} if "kvzip" in g else {}
        marks = {"full": torch.full((n,), full), "sampled": g["sampled"]} if spec.full_windows else {}
        for name, value in {
            "hidden": g["hidden"],
            "scalars": g["scalars"],
            "token_type": types[window[rows.cpu()]],
            "layer": torch.full((n,), layer, dtype=torch.int16),
            "head": torch.full((n,), g["head"], dtype=torch.int8),
            "mass": g["mass"],
            "in_topk": g["in_topk"],
            **kvzip,
            "influence": influence.float(),
            "group": torch.full((n,), group, dtype=torch.int64),
            "position": rows.to(torch.int32),
            "decision": torch.full((n,), g["t"], dtype=torch.int32),
            **marks,
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
    full_keys: Collection[str] = (),
    progress: bool = True,
) -> list[str]:
    """Process `(key, window)` work items (or `(key, window, item_spec)`, e.g. a `task_item`) into
    `writer`, skipping finished keys, then list the folder's shards in the items' order; returns
    the keys written now. The items keyed in `full_keys` keep every token (`collect_window`).
    Each shard is durable once written, so an interruption loses only the windows in progress.
    Under torch.distributed every process passes the same items and a writer on the same folder,
    and runs its share of them."""
    items = [(item[0], item[1], item[2] if len(item) > 2 else spec) for item in items]
    index = {item[0]: i for i, item in enumerate(items)}
    todo = [item for item in items if not writer.has(item[0])]
    barrier()  # every process has read the manifest before any adds to it
    types = token_type_table(tokenizer, model.config.get_text_config(decoder=True).vocab_size)
    instruction = torch.tensor(tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    written = []
    mine = todo[rank() :: world_size()]
    for key, window, item_spec in tqdm(mine, desc="collect", unit="window", disable=not progress or rank() > 0):
        columns = collect_window(model, key, window, types, item_spec, instruction, full=key in full_keys)
        writer.write(key, columns, index=index[key])
        written.append(key)
    barrier()
    if rank() == 0:
        writer.order(list(index))
    barrier()  # no process returns before the manifest is final
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
    label: str = "mass",
    full_windows: int = 0,
    model_name: str | None = None,
    corpus: str = "corpus",
    tasks: Sequence[str] = (),
    task_examples: int = 0,
    task_tokens: int | None = None,
    start_over: bool = False,
    progress: bool = True,
) -> Path:
    """Collect features and labels of `windows` `[N, T]` into `out_folder`, one shard per window
    keyed "<corpus>-w<i>", plus `task_examples` prompts of every task in `tasks` (see
    `task_item`, `task_tokens` long; keyed "<task>-e<seed>"); work already in the folder is
    skipped; a folder holding another collection is refused (`InputError`) unless `start_over`,
    which empties it first. `label`: what ranks the tokens (`CollectSpec.label`). `full_windows`:
    the first N windows keep every token 0..t of each group, not a sample (`CollectSpec`). Under
    torch.distributed every process calls this with the same arguments and runs its share of the
    windows (see the module docstring). Returns the folder."""
    if windows.dim() != 2:
        raise ValueError(f"windows must be [N, T] token ids, got shape {tuple(windows.shape)}")
    spec = CollectSpec(
        windows.shape[1], tuple(decision_points), future_queries, topk, influence, dense_layers, seed, label,
        full_windows,
    )
    name = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
    meta = collection_meta(model, spec, name, corpus)
    full_keys = sorted(f"{corpus}-w{i}" for i in range(min(full_windows, len(windows))))  # corpus windows only
    if full_keys:  # held out for validation first (`ShardDataset.split_by_key`)
        meta["full_keys"] = full_keys
    if tasks and task_examples:
        meta["tasks"] = {"names": list(tasks), "examples": task_examples, "tokens": task_tokens or spec.window_tokens}
    if rank() == 0:  # the first process opens the folder (clean-up, meta check), then the others join
        writer = ShardWriter(out_folder, meta, start_over=start_over)
    barrier()
    if rank() > 0:
        writer = ShardWriter(out_folder, meta, join=True)
    items = [(f"{corpus}-w{i}", w) for i, w in enumerate(windows)]
    for task in tasks:
        seeds = range(TASK_SEED_BASE, TASK_SEED_BASE + task_examples)
        items += [task_item(tokenizer, task, task_tokens or spec.window_tokens, s, spec) for s in seeds]
    collect_items(model, tokenizer, items, writer, spec, full_keys=set(full_keys), progress=progress)
    return writer.folder


__all__ = ["TASK_SEED_BASE", "CollectSpec", "collect", "collect_items", "collection_meta", "task_item", "task_prompt"]
