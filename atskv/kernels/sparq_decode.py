"""SparQ's decode step in four kernels, for the fast path's static cache (`atskv.generate`).

The unfused step ran ~15 torch kernels per layer: |q| top-r, `partial_scores` gathering r channels
per query head from row-major keys `[B, Hkv, S, D]` (16 random channels of 128 touch ~7 of every 8
32-byte sectors: most of K crosses the bus), softmax, and `torch.topk` over every slot (a launch whose
cost grows with the context). Here the selector keeps a channel-major copy of the keys, `keys_t`
`[B, Hkv, D, S]` (`channel_major`), as the paper does: a chosen channel is one contiguous row, so a
query head reads r / D of its KV head's keys (a KV head at most the union of its group's channels).

- `_channels_kernel` (one program per query head): its r largest |q| channels and their scaled
  q components, once; a row's head 0 also writes the new token's key into `keys_t` and zeroes
  the row's histogram and counters.
- `_logits_kernel` (query head x span of slots, ~4 programs per SM): those channels' rows of
  `keys_t`, a tile at a time, give the head's approximate logits and a running max and sum of
  exps per span (over vLLM's paged, row-major cache: whole key rows against the query with only
  those channels kept).
- `_probs_kernel` (row x block): each head's log-sum-exp from the spans' partials, each slot's
  probability summed over the GQA group as an order-preserving int32 key (-1: free slot; the
  `recent` newest positions: keys above every probability's), and a per-row histogram of the
  keys' top 12 bits; the row's last program finds the bin holding the budget's last slot.
- `_collect_kernel` (row x block): slots above that bin go to the list, those in it to the
  candidates, at places reserved by atomics, their next 12 bits counted into a second histogram;
  the row's last program picks the candidates the budget still needs by a radix search over
  (key, slot) in registers, after narrowing them to the second level's cut bin when more wait
  than its registers hold (nearly flat attention: random or dummy weights put most slots in one
  first-level bin, and the search reads every candidate again each pass).

Every stage runs many programs per row (the earlier three-kernel step selected in one program
per row, a handful of programs at small batches, and counted all 4096 bins with `tl.histogram`,
whose cost grows with its bins: several times this step's time, docs/results/kernel-notes.md).
Per step at the Llama-3-8B shape (32 query / 8 KV heads, D = 128, r = 16, 32K slots, B = 1) this
reads 32 x 16 channel rows of 64 KB (34 MB requested; the union of a group's channels, ~27 MB for
random queries, from DRAM), writes and rereads 4 MB of logits and 1 MB of keys.

The choice is `SparQSelector.scores` ranked as `select_top_indices` ranks it: the `lengths`
highest pooled probabilities among held slots (`slot_pos >= 0`), after the newest `recent`
positions, newest first (`recent_first`); exactly equal probabilities go to the higher slot (the
newer token, where slots are filled in position order). The kernel and the reference round `exp`
and divisions differently, so the two lists can differ only between slots whose probabilities
agree to rounding. The list holds the chosen slots first, in no particular order (attention over
them does not depend on it), then in-range filler up to `k`.
"""

from __future__ import annotations

import math

import torch

from atskv.kernels.backend import aligned_slots, dependent_launch, jit, tl, triton, use_triton, wait_for_inputs
from atskv.kernels.budget import budget_limit, kept_tokens
from atskv.kernels.evict import newest_share
from atskv.kernels.paged import physical_slots
from atskv.kernels.partial_scores import partial_scores, partial_scores_reference

_TINY = torch.finfo(torch.float32).tiny
_MIN = torch.finfo(torch.float32).min
# the top bits of a probability counted by the probabilities kernel: a bin spans 1/16 of an octave
_BINS_BITS = 12
LOGITS_WAVES = 4  # programs per SM the logits kernel aims at
# slots a step of the logits kernel over a paged cache, whole key rows: the fastest of 32-256 on the H100
# (`vllm_step_profile.py --tune`, 2026-12-06: 261 us a layer at 32K B=1 against 597 at 64)
PAGED_BLOCK_S = 256


def channel_rank(head_dim: int, fraction: float) -> int:
    """SparQ's r: `fraction` of the head dimension, rounded, at least 1 (the selector's and the plugin's)."""
    return max(1, min(head_dim, round(head_dim * fraction)))


def top_channels(query: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparQ's step 1 for `query` `[..., D]`: the `rank` channels of largest |q| (equal magnitudes:
    the lower channel first, on every device), and the share of the query's L1 mass they keep
    (clamped away from 0), whose square root divides the softmax temperature."""
    magnitude = query.abs().float()
    top = magnitude.sort(dim=-1, descending=True, stable=True)
    kept = top.values[..., :rank].sum(-1) / magnitude.sum(-1).clamp(min=_TINY)
    return top.indices[..., :rank], kept.clamp(min=_TINY)


def channel_major(keys: torch.Tensor) -> torch.Tensor:
    """The channel-major copy `[B, Hkv, D, S]` of `keys` `[B, Hkv, S, D]` that `sparq_decode` reads,
    its rows `aligned_slots` apart (with an odd slot count the kernels' loads do not vectorise)."""
    b, h, s, d = keys.shape
    copy = keys.new_zeros(b, h, d, aligned_slots(s))[..., :s]  # zeros: finite logits past the slots
    return copy.copy_(keys.transpose(2, 3))


def pooled_probs(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax of per-query-head logits `[B, Hq, Tq, S]` over the slots `valid` (`[B, Hkv, Tq, S]`)
    allows, summed over each GQA group: `[B, Hkv, Tq, S]`."""
    b, hkv, tq, s = valid.shape
    grouped = logits.view(b, hkv, -1, tq, s).masked_fill(~valid.unsqueeze(2), _MIN)
    return torch.softmax(grouped, dim=-1).sum(dim=2)


def sparq_probs(query, keys, valid, scaling: float, rank: int, partial=partial_scores) -> torch.Tensor:
    """SparQ's approximate attention, pooled over each GQA group, `[B, Hkv, Tq, S]`: logits over the
    top `rank` channels of each query head (`partial`: `partial_scores` or its reference), scaled by
    `scaling / sqrt(kept share)`. `keys` `[B, Hkv, S, D]` (any strides: a transposed `keys_t` too)."""
    dims, share = top_channels(query, rank)
    logits = partial(query, keys, dims)
    return pooled_probs(logits * (scaling / share.sqrt()).unsqueeze(-1), valid)


def recent_first(probs: torch.Tensor, slot_pos: torch.Tensor, usable: torch.Tensor, recent: int,
                 group: int) -> torch.Tensor:  # fmt: skip
    """`probs` pooled over groups of `group` query heads (so at most `group`), with each row's
    newest `recent` usable positions (`newest_share`) raised above them all in position order: a
    ranking takes those first, the newest first, within its budget. `slot_pos` broadcasts
    against `usable`."""
    if not recent:
        return probs
    fresh = newest_share(slot_pos, usable, torch.tensor(recent), 1.0)
    return torch.where(fresh, slot_pos + (group + 1.0), probs)


def sparq_decode(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                 budget: int | float, k: int, channels=None,
                 recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step: first the new token's key (`keys[b, h, write_slot[b, h]]`) is copied into
    `keys_t` `[B, Hkv, D, S]` in place; then slot ids `[B, Hkv, k]` (int32) whose first `lengths`
    `[B, Hkv]` (int32) are the held slots of highest pooled SparQ probability for `query` `[B, Hq, D]`
    (see the module docstring), the rest in-range filler. `lengths`: the row's budget (`budget` of
    `context` `[B]` tokens, `resolve_budget`'s rule), at most its held slots and `k`.

    With `channels` `[B, Hkv, R]` (SparCas: channels fixed per KV head, `rank` = R), `keys_t` is the
    compact copy `[B, Hkv, R, S]` (any strides) whose row i holds channel `channels[..., i]`, the
    new token's entry already written by the caller, and the logits are those channels' partial
    sums times `scaling` (no temperature correction); the rest is the same.

    `recent`: the row's newest `recent` positions, up to the token at `write_slot` (the newest),
    count first (`recent_first`)."""
    args = (query, keys, keys_t, slot_pos, write_slot, context, scaling, rank, budget, k)
    if use_triton(query):
        return sparq_decode_triton(*args, channels=channels, recent=recent)
    return sparq_decode_reference(*args, channels=channels, recent=recent)


def sparq_decode_paged(query, key_slots, block_table, block_size: int, slot_pos, context, scaling: float,
                       rank: int, budget: int | float, k: int, recent: int = 0,
                       **tuning) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`sparq_decode` over a paged cache read in place (vLLM's), with no channel-major copy: slot s
    of a row holds logical position `slot_pos[b, h, s]` (-1: none; `[B, 1 or Hkv, S]`), read through
    `block_table` `[B, W]` from `key_slots` `[Hkv, num_slots, D]`, the cache's keys by physical
    slot. Every position a request holds (`slot_pos` = the slot itself below its length), or a
    kept list's (a composition's residents). `context` `[B]` is each request's length (the budget's
    base); `recent` needs the first layout (its newest position, `context - 1`, at that slot).
    Returns slots, as `sparq_decode`. Keys are row-major here, so the logits kernel reads each held
    token's whole key row, coalesced (its chosen channels would touch nearly every sector of it):
    a step reads all of K, as dense attention does (the fast path's channel-major copy is what
    saves that). `tuning`: the Triton path's block sizes and warps (`sparq_decode_triton`'s
    keywords; `block_s` defaults to PAGED_BLOCK_S), for a benchmark's sweep."""
    b, hkv = query.shape[0], key_slots.shape[0]
    slot_pos = slot_pos.expand(b, hkv, -1)
    newest = (context.long() - 1).clamp(min=0, max=slot_pos.shape[-1] - 1).view(b, 1).expand(b, hkv)  # its slot
    if use_triton(query):
        keys_t = key_slots.transpose(1, 2).unsqueeze(0).expand(b, -1, -1, -1)  # [B, Hkv, D, num_slots], a view
        return sparq_decode_triton(query, keys_t, keys_t, slot_pos, newest, context, scaling, rank, budget, k,
                                   recent=recent, block_table=block_table, block_size=block_size,
                                   **{"block_s": PAGED_BLOCK_S} | tuning)  # fmt: skip
    physical = physical_slots(slot_pos.clamp(min=0), block_table, block_size).long()  # [B, Hkv, S]
    keys = key_slots[torch.arange(hkv, device=query.device).view(1, -1, 1), physical]  # [B, Hkv, S, D]
    return sparq_decode_reference(query, keys, keys.transpose(2, 3).clone(), slot_pos, newest, context, scaling,
                                  rank, budget, k, recent=recent)  # fmt: skip


def sparq_decode_reference(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                           budget: int | float, k: int, channels=None,
                           recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, hkv, d, s = keys_t.shape
    held = slot_pos >= 0
    if channels is None:
        at = write_slot.view(b, hkv, 1, 1)
        keys_t.scatter_(3, at.expand(b, hkv, d, 1), keys.gather(2, at.expand(b, hkv, 1, d)).transpose(2, 3))
        probs = sparq_probs(query.unsqueeze(2), keys_t.transpose(2, 3), held.unsqueeze(2), scaling, rank,
                            partial_scores_reference)[:, :, 0]  # fmt: skip
    else:
        dims = channels.long().repeat_interleave(query.shape[1] // hkv, dim=1).unsqueeze(2)  # [B, Hq, 1, R]
        logits = partial_scores_reference(query.unsqueeze(2), keys_t.transpose(2, 3), dims, compact=True)
        probs = pooled_probs(logits * scaling, held.unsqueeze(2))[:, :, 0]
    probs = recent_first(probs, slot_pos, held, recent, query.shape[1] // hkv)
    newest_first = probs.masked_fill(~held, -math.inf).flip(-1)  # a stable sort then ranks equals by slot, high first
    best = s - 1 - newest_first.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    lengths = kept_tokens(budget, context.view(-1, 1)).minimum(held.sum(-1)).clamp(max=k)
    return best.int(), lengths.int()


@jit
def _channels_kernel(
    q_ptr, k_ptr, kt_ptr, w_ptr, fix_ptr, dims_ptr, coef_ptr, hist_ptr, count_ptr, n_kv_heads, head_dim, scaling,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    st_b, st_h, st_d, st_s,
    sw_b, sw_h,
    sf_b, sf_h, sf_r,
    GROUP: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    N_BINS: tl.constexpr, FIXED: tl.constexpr, WRITE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One query head: its r channels of largest |q| (`dims` `[heads, BLOCK_R]`) and their q
    components times SparQ's temperature-corrected scale (`coef`). A row's head 0 also copies the
    new token's key into `keys_t` (WRITE) and zeroes the row's histograms and counters for the
    kernels after it. Done once per head here, so the logits kernel's many programs only stream
    keys. FIXED (SparCas): the channels come from `fix` `[B, Hkv, RANK]`, the compact copy's rows
    0 .. RANK - 1 hold them, the scale is `scaling`, and the caller has written the new token's entry."""
    wait_for_inputs(PDL)
    head = tl.program_id(0)
    row = head // GROUP
    g = head % GROUP
    b = (row // n_kv_heads).to(tl.int64)
    h = row % n_kv_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if g == 0:
        if WRITE:
            new = tl.load(w_ptr + b * sw_b + h * sw_h)  # the slot the decode token was written to
            k_new = tl.load(k_ptr + b * sk_b + h * sk_h + new * sk_s + d * sk_d, mask=d_ok)
            tl.store(kt_ptr + b * st_b + h * st_h + d * st_d + new * st_s, k_new, mask=d_ok)
        both = tl.arange(0, 2 * N_BINS)  # the row's two histogram levels
        tl.store(hist_ptr + row.to(tl.int64) * 2 * N_BINS + both, tl.zeros([2 * N_BINS], tl.int32))
        tl.store(count_ptr + row * 8 + tl.arange(0, 8), tl.zeros([8], tl.int64))
    q_at = q_ptr + b * sq_b + (h * GROUP + g) * sq_h
    if FIXED:
        i = tl.arange(0, BLOCK_R)
        used = i < RANK
        fixed = tl.load(fix_ptr + b * sf_b + h * sf_h + i * sf_r, mask=used, other=0)
        tl.store(dims_ptr + head * BLOCK_R + i, i)
        coef = tl.load(q_at + fixed * sq_d, mask=used, other=0.0).to(tl.float32)
        tl.store(coef_ptr + head * (BLOCK_R + 1) + i, coef)
        tl.store(coef_ptr + head * (BLOCK_R + 1) + BLOCK_R, scaling)
    else:
        q = tl.load(q_at + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        mag = tl.abs(q)
        # channels in |q| order, larger first, the lower channel first among equals: one sort of
        # (|q| bits, channel) keys (ranking by a [D, D] comparison was this kernel's largest cost)
        order = tl.sort(tl.where(d_ok, (mag.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (65535 - d), -1),
                        descending=True)  # fmt: skip
        first = d < RANK
        channel = tl.where(first, 65535 - (order & 65535), 0).to(tl.int32)
        kept = tl.sum(tl.where(first, (order >> 16).to(tl.int32).to(tl.float32, bitcast=True), 0.0), 0)
        total = tl.maximum(tl.sum(mag, 0), 1.1754943508222875e-38)  # float32's tiny
        share = tl.maximum(tl.div_rn(kept, total), 1.1754943508222875e-38)
        rows = d < BLOCK_R  # rows RANK .. BLOCK_R - 1: channel 0, coefficient 0
        tl.store(dims_ptr + head * BLOCK_R + d, channel, mask=rows)
        coef = tl.load(q_at + channel * sq_d, mask=first, other=0.0).to(tl.float32)
        tl.store(coef_ptr + head * (BLOCK_R + 1) + d, coef, mask=rows)
        tl.store(coef_ptr + head * (BLOCK_R + 1) + BLOCK_R, tl.div_rn(scaling, tl.sqrt_rn(share)))


@jit
def _logits_kernel(
    kt_ptr, pos_ptr, dims_ptr, coef_ptr, logit_ptr, stat_ptr, table_ptr, n_kv_heads, n_slots, width, kt_cols,
    span,
    st_b, st_h, st_d, st_s,
    sp_b, sp_h, sp_s,
    stb_b,
    GROUP: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, FIXED: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One query head and `span` slots, BLOCK_S at a time: each step reads the head's r rows of
    `keys_t` (a [BLOCK_R, BLOCK_S] tile whose channel sum stays inside each thread) and keeps a
    running max and sum of exps. Logits go to `[rows, GROUP, width]` (-inf: free slot or past the
    slots), the max and sum over the span to `[rows, GROUP, parts, 2]`. Loops and masks run to
    `width` and `kt_cols` (multiples of 64 when `keys_t` is `channel_major`'s), so that a mask is the
    same over each vector of a load: bounded by an odd slot count, the loads do not vectorise
    and this step runs over twice as long (`SLOT_ALIGN`). PAGE > 0: a slot holds the logical
    position in `pos` (pages of PAGE positions), read through the block table `table` `[B, W]`
    from a row-major cache (vLLM's) by physical slot; only held slots are read, each as its whole
    key row (a [BLOCK_S, BLOCK_D] tile, coalesced) against the head's query with only its r
    channels kept. The chosen channels would touch nearly every 32-byte sector of a row anyway,
    one scattered 2-byte load each (2.8 ms a layer at 32K B=1 on an H100, the pick's whole cost)."""
    wait_for_inputs(PDL)
    head = tl.program_id(0)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    row = head // GROUP
    b = (row // n_kv_heads).to(tl.int64)
    h = row % n_kv_heads
    first = part * span
    last = tl.minimum(first + span, width)
    i = tl.arange(0, BLOCK_R)
    used = i < RANK
    q_sel = tl.load(coef_ptr + head * (BLOCK_R + 1) + i)
    scale = tl.load(coef_ptr + head * (BLOCK_R + 1) + BLOCK_R)
    picked = tl.load(dims_ptr + head * BLOCK_R + i)
    keys_at = kt_ptr + b * st_b + h * st_h
    if FIXED:  # rows 0 .. RANK - 1 of a compact copy: a row-major one then reads in whole slots
        rows_at = keys_at + i[:, None] * st_d
    else:
        rows_at = keys_at + picked[:, None] * st_d
    d = tl.arange(0, BLOCK_D)  # paged: whole key rows against the query with only its r channels
    q_full = tl.sum(tl.where(used[:, None] & (picked[:, None] == d[None, :]), q_sel[:, None], 0.0), 0)
    top = tl.full([], -3.4028234663852886e38, tl.float32)  # float32's min, as the reference's mask
    exps = tl.zeros([], tl.float32)
    out_at = logit_ptr + head.to(tl.int64) * width
    for start in range(first, last, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        ok = s < last
        pos = tl.load(pos_ptr + b * sp_b + h * sp_h + s * sp_s, mask=s < n_slots, other=-1)
        held = pos >= 0
        if PAGE > 0:
            page = tl.load(table_ptr + b * stb_b + pos // PAGE, mask=held, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
            tile = tl.load(keys_at + slot[:, None] * st_s + d[None, :] * st_d,
                           mask=held[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
            logit = tl.sum(tile.to(tl.float32) * q_full[None, :], 1) * scale
        else:
            tile = tl.load(rows_at + s[None, :] * st_s, mask=used[:, None] & (s < kt_cols)[None, :], other=0.0)
            logit = tl.sum(tile.to(tl.float32) * q_sel[:, None], 0) * scale
        step_top = tl.maximum(top, tl.max(tl.where(held, logit, -3.4028234663852886e38), 0))
        exps = exps * tl.exp(top - step_top) + tl.sum(tl.where(held, tl.exp(logit - step_top), 0.0), 0)
        top = step_top
        tl.store(out_at + s, tl.where(held, logit, float("-inf")), mask=ok)
    at = head.to(tl.int64) * n_parts + part
    tl.store(stat_ptr + at * 2, top)
    tl.store(stat_ptr + at * 2 + 1, exps)


@jit
def _cut(count, need, N: tl.constexpr):
    """The highest bin whose keys and those of the bins above reach `need` (N - 1 for need <= 0),
    and how many keys lie above it."""
    bins = tl.arange(0, N)
    at_least = tl.sum(count, 0) - tl.cumsum(count, 0) + count
    cut = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    return cut, tl.sum(tl.where(bins > cut, count, 0), 0)


@jit
def _probs_kernel(
    logit_ptr, stat_ptr, key_ptr, hist_ptr, count_ptr, ctx_ptr, len_ptr, pos_ptr, w_ptr, n_kv_heads, n_read, width,
    n_out, budget, n_parts, recent,
    sp_b, sp_h, sp_s,
    sw_b, sw_h,
    FRACTION: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr,
    N_BINS: tl.constexpr, SHIFT: tl.constexpr, WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and BLOCK_S slots (`n_parts`: the logits kernel's spans, whose partials
    give each head's log-sum-exp): pooled probabilities as int32 keys (a non-negative float's bits
    keep its order; free slots -1, below all; the `recent` newest positions, up to the one at the
    write slot, keys above every finite float's, newer higher) and their top bits counted into the
    row's histogram. `recent` is a runtime argument: at 0 its loads are masked off (the caller
    passes `n_read`, the slots whose positions are read, as 0). The bins within WINDOW of the
    block's highest probability are counted here (`tl.histogram`, whose cost grows with its bins:
    over all 4096 it cost more than the whole kernel does now) and added by one atomic per bin; the slots below
    them and the recent ones, a tail, by one atomic each (per-slot atomics on the crowded bins
    contend with each other). The row's last program to finish (a counter with release / acquire order)
    reads the histogram: the row's length (its budget, at most its held slots and `n_out`), the
    bin holding its last slot and how many lie above that bin, for the collection."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = s < width
    j = tl.arange(0, BLOCK_B)
    prob = tl.zeros([BLOCK_S], tl.float32)
    held = in_range
    for g in tl.static_range(GROUP):
        at = row * GROUP + g
        part = stat_ptr + (at * n_parts + j) * 2
        peak = tl.load(part, mask=j < n_parts, other=-3.4028234663852886e38)
        top = tl.max(peak, 0)
        norm = tl.sum(tl.load(part + 1, mask=j < n_parts, other=0.0) * tl.exp(peak - top), 0)
        logit = tl.load(logit_ptr + at * width + s, mask=in_range, other=float("-inf"))
        held = held & (logit > float("-inf"))
        prob += tl.div_rn(tl.exp(logit - top), norm)
    key = tl.where(held, prob.to(tl.int32, bitcast=True), -1)
    wanted = recent > 0
    pos_row = pos_ptr + (row // n_kv_heads) * sp_b + (row % n_kv_heads) * sp_h
    newest = tl.load(pos_row + tl.load(w_ptr + (row // n_kv_heads) * sw_b + (row % n_kv_heads) * sw_h,
                                       mask=wanted, other=0) * sp_s, mask=wanted, other=0)  # fmt: skip
    pos = tl.load(pos_row + s * sp_s, mask=s < n_read, other=-1)
    fresh = held & (pos > newest - recent) & (pos <= newest)
    age = tl.minimum(tl.where(fresh, newest - pos, 0), 8388607).to(tl.int32)
    key = tl.where(fresh, 2147483647 - age, key)  # +inf's bits and up
    tl.store(key_ptr + row * width + s, key, mask=in_range)
    bins = key >> SHIFT
    low = tl.max(tl.where(held & ~fresh, bins, 0), 0) - (WINDOW - 1)
    inside = held & ~fresh & (bins >= low)
    count = tl.histogram(tl.where(inside, bins - low, 0), WINDOW)
    w = tl.arange(0, WINDOW)
    count -= tl.where(w == 0, tl.sum((~inside).to(tl.int32), 0), 0)  # the others were put in bin 0
    hist = hist_ptr + row * 2 * N_BINS  # the first level (the second: the collection's)
    tl.atomic_add(hist + low + w, count, mask=count > 0, sem="relaxed")
    tl.atomic_add(hist + bins, tl.full([BLOCK_S], 1, tl.int32), mask=held & ~inside, sem="relaxed")
    tl.debug_barrier()
    counters = count_ptr + row * 8
    if tl.atomic_add(counters + 2, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        row_count = tl.load(hist + tl.arange(0, N_BINS), cache_modifier=".cg")
        length = tl.minimum(budget_limit(tl.load(ctx_ptr + row // n_kv_heads), budget, FRACTION), tl.sum(row_count, 0))
        length = tl.minimum(length, n_out)
        cut, above = _cut(row_count, length, N_BINS)
        tl.store(counters + 3, length)
        tl.store(counters + 4, cut)
        tl.store(counters + 5, above)
        tl.store(len_ptr + row, length.to(tl.int32))


@jit
def _relative(key_row, cand_row, c, n_cand, SHIFT: tl.constexpr, slot_bits):
    """Candidates c's slots and their order inside the cut bin as unique int64s: the key's bits
    below the bin's, then the slot (equal probabilities: the higher slot first); -1 past n_cand."""
    ok = c < n_cand
    slot = tl.load(cand_row + c, mask=ok, other=0, cache_modifier=".cg")
    key = tl.load(key_row + slot, mask=ok, other=0)
    rel = ((key & ((1 << SHIFT) - 1)).to(tl.int64) << slot_bits) | slot.to(tl.int64)
    return slot, tl.where(ok, rel, -1)


@jit
def _collect_kernel(
    key_ptr, count_ptr, cand_ptr, idx_ptr, hist_ptr, width, n_out, slot_bits,
    SHIFT: tl.constexpr, SHIFT_2: tl.constexpr, N_BINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    RADIX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and BLOCK slots: this block's slots of bins above the cut (from the
    probabilities kernel) go to the index list, those of the cut bin to the row's candidates, both
    at places reserved by one packed atomic add per program (the list is unordered), and the
    places after the row's length get in-range filler; the candidates' next bits below the bin's
    (from SHIFT_2 up) are counted into the row's second histogram level. The row's last program to
    finish (a counter with release / acquire order) picks the candidates the budget still needs: the n-th
    largest of their unique `_relative` keys, RADIX bits per pass, in registers (a few hundred
    candidates at 32K slots with peaked attention). When more than BLOCK_C wait (flat
    attention: nearly every slot in the cut bin), the second level's cut first takes the
    candidates above it and keeps those in it, in one pass, so that the search, whose every pass
    reads its candidates again, runs over that bin's alone."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    key_row = key_ptr + row * width
    cand_row = cand_ptr + row * width
    out_row = idx_ptr + row * n_out
    # (candidates << 32) + slots listed, programs done, probabilities' programs done, length, cut, above
    counters = count_ptr + row * 8
    length = tl.load(counters + 3).to(tl.int32)
    cut = tl.load(counters + 4).to(tl.int32)
    above = tl.load(counters + 5).to(tl.int32)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(key_row + s, mask=s < width, other=-1)
    hi = (key >> SHIFT) > cut
    tie = ((key >> SHIFT) == cut) & (key >= 0)
    packed = (tl.sum(tie.to(tl.int64), 0) << 32) + tl.sum(hi.to(tl.int64), 0)
    packed = tl.atomic_add(counters, packed, sem="relaxed")
    n_hi = (packed & 0xFFFFFFFF).to(tl.int32)
    n_tie = (packed >> 32).to(tl.int32)
    tl.store(out_row + n_hi + tl.cumsum(hi.to(tl.int32), 0) - 1, s, mask=hi)
    tl.store(cand_row + n_tie + tl.cumsum(tie.to(tl.int32), 0) - 1, s, mask=tie)
    tl.store(out_row + s, s, mask=(s >= length) & (s < n_out))
    second = hist_ptr + row * 2 * N_BINS + N_BINS
    tl.atomic_add(second + ((key >> SHIFT_2) & (N_BINS - 1)), tl.full([BLOCK], 1, tl.int32), mask=tie, sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(counters + 1, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        n_cand = (tl.load(counters, volatile=True) >> 32).to(tl.int32)
        need = length - above
        c = tl.arange(0, BLOCK_C)
        lo = tl.zeros([], tl.int64)
        shift = (SHIFT + slot_bits).to(tl.int64)
        if (n_cand > BLOCK_C) & (need > 0):  # many candidates: narrowed to the second level's cut bin
            cut_2, _ = _cut(tl.load(second + tl.arange(0, N_BINS), cache_modifier=".cg"), need, N_BINS)
            placed = tl.zeros([], tl.int32)
            kept = tl.zeros([], tl.int32)
            for start in range(0, n_cand, BLOCK_C):  # in place: a chunk's keepers land at or before it
                ok = start + c < n_cand
                slot = tl.load(cand_row + start + c, mask=ok, other=0, cache_modifier=".cg")
                sub = (tl.load(key_row + slot, mask=ok, other=0) >> SHIFT_2) & (N_BINS - 1)
                tl.debug_barrier()  # the chunk is read before any of it is overwritten
                up, stay = ok & (sub > cut_2), ok & (sub == cut_2)
                tl.store(out_row + above + placed + tl.cumsum(up.to(tl.int32), 0) - 1, slot, mask=up)
                tl.store(cand_row + kept + tl.cumsum(stay.to(tl.int32), 0) - 1, slot, mask=stay)
                placed += tl.sum(up.to(tl.int32), 0)
                kept += tl.sum(stay.to(tl.int32), 0)
            tl.debug_barrier()
            above += placed
            need -= placed
            n_cand = kept
            shift = (SHIFT_2 + slot_bits).to(tl.int64)  # the keepers share every bit above these
            lo = cut_2.to(tl.int64) << shift
        slot, rel = _relative(key_row, cand_row, c, n_cand, SHIFT, slot_bits)  # the first BLOCK_C stay
        jj = tl.arange(0, 1 << RADIX).to(tl.int64)
        at_lo = n_cand  # candidates at or above lo
        while (shift > 0) & (at_lo > need):  # stops once exactly `need` are at or above lo
            shift = tl.maximum(shift - RADIX, 0)
            trial = lo + (jj << shift)
            at_least = tl.sum((rel[:, None] >= trial[None, :]).to(tl.int32), 0)
            for more in range(BLOCK_C, n_cand, BLOCK_C):
                _, rel_more = _relative(key_row, cand_row, more + c, n_cand, SHIFT, slot_bits)
                at_least += tl.sum((rel_more[:, None] >= trial[None, :]).to(tl.int32), 0)
            # counts fall with the trial; trials past the interval count fewer than `need`
            best = tl.sum((at_least >= need).to(tl.int32), 0) - 1
            lo += best.to(tl.int64) << shift
            at_lo = tl.sum(tl.where(jj == best, at_least, 0), 0)
        lo = tl.where(need > 0, lo, 9223372036854775807)  # none needed: none taken
        take = rel >= lo
        tl.store(out_row + above + tl.cumsum(take.to(tl.int32), 0) - 1, slot, mask=take)
        taken = above + tl.sum(take.to(tl.int32), 0)
        for more in range(BLOCK_C, n_cand, BLOCK_C):
            slot_more, rel_more = _relative(key_row, cand_row, more + c, n_cand, SHIFT, slot_bits)
            take = rel_more >= lo
            tl.store(out_row + taken + tl.cumsum(take.to(tl.int32), 0) - 1, slot_more, mask=take)
            taken += tl.sum(take.to(tl.int32), 0)


def sparq_decode_triton(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                        budget: int | float, k: int, block_s: int = 2048, parts: int | None = None,
                        probs_block: int = 1024, window: int = 128, collect_block: int = 2048, block_c: int = 256,
                        radix: int = 3, warps: tuple[int, int, int, int] = (8, 4, 8, 8), channels=None,
                        recent: int = 0, block_table=None,
                        block_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The four kernels (`channels`, `recent`: see `sparq_decode`; `block_table`, `block_size`:
    `sparq_decode_paged`'s, whose `keys_t` is the cache by physical slot and writes nothing).
    `block_s`: slots per step of the logits kernel; `parts`: its programs per query head (None:
    about LOGITS_WAVES per SM over the grid; two off CUDA); `probs_block`: slots per program of
    the probabilities, `window` the bins each counts before adding them; `collect_block`: slots
    per program of the collection; `block_c`: candidates held in registers by its last one,
    `radix` bits per pass of its search; `warps`: each kernel's warps, in launch order.
    Smaller values cover the loops in tests."""
    b, hq, d = query.shape
    paged = block_table is not None
    hkv, slots = keys_t.shape[1], slot_pos.shape[-1] if paged else keys_t.shape[3]
    rows, group, block_r = b * hkv, hq // hkv, triton.next_power_of_2(rank)
    width = aligned_slots(slots)  # rows start aligned: the kernels' loads vectorise
    kt_cols = width if keys_t.stride(3) == 1 and keys_t.stride(2) >= width and not paged else slots  # readable
    steps = triton.cdiv(width, block_s)
    if parts is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 0
        parts = min(math.ceil(LOGITS_WAVES * sms / (rows * group)), steps) if query.is_cuda else 2
    span = triton.cdiv(steps, parts) * block_s
    parts = triton.cdiv(width, span)
    device = query.device
    dims = torch.empty(rows * group, block_r, dtype=torch.int32, device=device)
    coef = torch.empty(rows * group, block_r + 1, dtype=torch.float32, device=device)
    logits = torch.empty(rows, group, width, dtype=torch.float32, device=device)
    stats = torch.empty(rows, group, parts, 2, dtype=torch.float32, device=device)
    hist = torch.empty(rows, 2, 1 << _BINS_BITS, dtype=torch.int32, device=device)  # two levels a row
    counters = torch.empty(rows, 8, dtype=torch.int64, device=device)
    keys32 = torch.empty(rows, width, dtype=torch.int32, device=device)
    candidates = torch.empty(rows, width, dtype=torch.int32, device=device)
    indices = torch.empty(b, hkv, k, dtype=torch.int32, device=device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=device)
    fixed = channels if channels is not None else write_slot.unsqueeze(-1)  # unused without channels
    grid = (rows * group,)
    _channels_kernel[grid](
        query, keys, keys_t, write_slot, fixed, dims, coef, hist, counters, hkv, d, scaling,
        *query.stride(), *keys.stride(), *keys_t.stride(), *write_slot.stride(), *fixed.stride(),
        GROUP=group, RANK=rank, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), N_BINS=1 << _BINS_BITS,
        FIXED=channels is not None, WRITE=channels is None and not paged, num_warps=warps[0],
        **dependent_launch(query, grid),
    )  # fmt: skip
    grid = (rows * group, parts)
    table = block_table if paged else slot_pos  # unread without pages
    _logits_kernel[grid](
        keys_t, slot_pos, dims, coef, logits, stats, table, hkv, slots, width, kt_cols, span, *keys_t.stride(),
        *slot_pos.stride(), table.stride(0), GROUP=group, RANK=rank, BLOCK_R=block_r, BLOCK_S=block_s,
        FIXED=channels is not None, PAGE=block_size if paged else 0, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        num_warps=warps[1],
        **dependent_launch(query, grid),
    )  # fmt: skip
    shift = 31 - _BINS_BITS
    grid = (rows, triton.cdiv(width, probs_block))
    _probs_kernel[grid](
        logits, stats, keys32, hist, counters, context.reshape(-1).contiguous(), lengths, slot_pos, write_slot, hkv,
        slots if recent > 0 else 0, width, k, budget, parts, recent, *slot_pos.stride(), *write_slot.stride(),
        FRACTION=isinstance(budget, float), GROUP=group, BLOCK_S=probs_block, BLOCK_B=triton.next_power_of_2(parts),
        N_BINS=1 << _BINS_BITS, SHIFT=shift, WINDOW=window, num_warps=warps[2],
        **dependent_launch(query, grid),
    )  # fmt: skip
    grid = (rows, triton.cdiv(width, collect_block))
    _collect_kernel[grid](
        keys32, counters, candidates, indices, hist, width, k, max(1, (slots - 1).bit_length()), SHIFT=shift,
        SHIFT_2=shift - _BINS_BITS, N_BINS=1 << _BINS_BITS, BLOCK=collect_block, BLOCK_C=block_c, RADIX=radix,
        num_warps=warps[3],
        **dependent_launch(query, grid),
    )  # fmt: skip
    return indices, lengths
