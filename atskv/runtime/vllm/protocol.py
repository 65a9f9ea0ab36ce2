"""What a paged selector declares (`atskv.runtime.vllm.selection` describes the protocol): the
base class's defaults are a selector that keeps no state, scores no prompt, reads no mass, frees
no block, reads no keys to choose and keeps one set of tokens whatever the query; a selector's
class names only where it differs, as vLLM's attention backends declare what they support on
their own class. The plugin's budget rule (`check_plugin_budget`) lives here too: the settings
and the compositions both read it."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

from atskv.errors import InputError

T = TypeVar("T")

BUDGET_RULE = (
    "an int is tokens per KV head (>= 1), a float in (0, 1] a fraction of each request's context "
    "(1.0: vLLM's own attention)"
)


def check_plugin_budget(budget, name: str) -> None:
    """An `InputError` naming `name` unless `budget` follows `BUDGET_RULE`."""
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float))
        or (isinstance(budget, int) and budget < 1)
        or (isinstance(budget, float) and not 0.0 < budget <= 1.0)
    ):
        raise InputError(f"atskv: bad {name} {budget!r}: {BUDGET_RULE}")


def shard_kv_heads(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(the first KV head, `total`) of the KV heads rank `tp_rank` of `tp_size` holds, as vLLM's
    QKV projection splits them: `total / tp_size` each, or one replicated over `tp_size / total`
    ranks where there are fewer heads than ranks."""
    local, replicas = max(1, total // tp_size), max(1, tp_size // total)
    return (tp_rank // replicas) * local, total


def once_a_forward(step: dict, key, reader, make: Callable[[], T]) -> T:
    """`make()` once a forward, a plan step as FlashInfer's: made by the first `reader` (a layer's
    object) to ask and found in the forward's `step` (the dict its layers share) by the rest. The
    one that made it makes it anew when it asks again: a forward's metadata, and `step` with it,
    may be an earlier forward's (as in CUDA graph capture, where only work done in the captured
    forward replays)."""
    made = step.get(key)
    if made is None or made[0] is reader:
        made = step[key] = (reader, make())
    return made[1]


class PagedSelector:
    name: ClassVar[str] = ""
    keeps_state: ClassVar[bool] = False  # state beside the cache (`new_state`), kept by `after_write`
    scores_prompt: ClassVar[bool] = False  # `observe_prompt` after each prefill chunk
    takes_prompt_lse: ClassVar[bool] = False  # that chunk with FlashAttention's log-sum-exps (`PromptChunk.lse`)
    reads_mass: ClassVar[bool] = False  # `observe_read` with the mass each decode read gives
    frees_blocks: ClassVar[bool] = False  # `unread_blocks` go back to vLLM's pool (`freeing_rule`)
    reads_keys: ClassVar[bool] = False  # `pick` gets `keys` (the cache's `[Hkv, num_slots, D]`) and `scaling`
    query_aware: ClassVar[bool] = False  # chooses per query (else: a kept set, a composition's residency part)
    picks_among: ClassVar[bool] = False  # `pick_among` given positions: a composition's attention part
    picks_in_order: ClassVar[bool] = False  # `pick` moves the state a token on (a kept list's step)
    layer: int | None = None  # the model's layer index, set by the backend (each layer builds its own selector)
    # (the first of the model's KV heads this GPU holds, how many the model has): set by the backend
    # under tensor parallelism, which shards the KV heads (`shard_kv_heads`); None on one GPU
    kv_shard: tuple[int, int] | None = None
    # the states of the engine's sparse layers from this one on, in layer order (None until each is
    # made): set by the backend, for a selector that reads every layer's at the forward's first
    later_states: Callable[[], list | None] | None = None

    @classmethod
    def freeing_rule(cls, options: dict) -> Callable[[int, int, int | float, int], range]:
        """`unread_blocks(processed, prompt, budget, block_size)` of the selector with `options`,
        for vLLM's scheduler (`frees_blocks`), which runs in a process of its own."""
        return cls(**options).unread_blocks

    def after_write(self, state, key, slot_mapping, block_size: int) -> None:
        """The keys a forward just wrote, `[N, Hkv, D]` at physical `slot_mapping` (nothing by default:
        state that tokens enter at their prefill chunk or decode step)."""
