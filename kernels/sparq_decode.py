"""SparQ's decode step in three kernels, for the fast path's static cache (`atskv.hook.decode`).

The unfused step ran ~15 torch kernels per layer: |q| top-r, `partial_scores` gathering r channels
per query head from row-major keys `[B, Hkv, S, D]` (16 random channels of 128 touch ~7 of every 8
32-byte sectors: most of K crosses the bus), softmax, and `torch.topk` over every slot (~20 us per
call at 32K on an H200). Here the selector keeps a channel-major copy of the keys, `keys_t`
`[B, Hkv, D, S]`, as the paper does: a chosen channel is one contiguous row, so a query head reads
r / D of its KV head's keys (a KV head at most the union of its group's channels).

- `_logits_kernel` (row x span of slots, ~2 programs per SM): the group's r largest |q| channels
  per query head, chosen once per program; then, BLOCK_S slots at a time, their rows of `keys_t`
  and one `tl.dot` with a block-diagonal matrix of the chosen q components give every head's
  approximate logits (SparQ's temperature-corrected scale), and a running max and sum of exps.
  The program whose span holds `write_slot` first copies the new token's key into `keys_t` (the
  copy costs no kernel of its own).
- `_probs_kernel` (row x block): each head's log-sum-exp from the spans' partials, then each
  slot's probability summed over the GQA group as an order-preserving int32 key (-1: free slot),
  and a per-row histogram of the keys' top 12 bits (atomics).
- `_select_kernel` (one program per row): the histogram names the bin holding the budget's last
  slot; one scan of the row lists the slots of higher bins and collects those of that bin; two
  more histogram levels over the collected ones (a few hundred at 32K) give the exact threshold.
  A radix select: three passes whatever the scores, where a bit-by-bit search takes ~30
  dependent reductions over the row and Triton's sort of 32K slots is far slower.

Per step at the Llama-3-8B shape (32 query / 8 KV heads, D = 128, r = 16, 32K slots, B = 1) this
reads 32 x 16 channel rows of 64 KB (34 MB requested; the union of a group's channels, ~27 MB for
random queries, from DRAM), writes and rereads 4 MB of logits and 1 MB of keys.

The choice is `SparQSelector.scores` ranked as `select_top_indices` ranks it: the `lengths`
highest pooled probabilities among held slots (`slot_pos >= 0`); exactly equal probabilities go
to the higher slot (the newer token, where slots are filled in position order). The kernel and
the reference round `exp` and divisions differently, so the two lists can differ only between
slots whose probabilities agree to rounding. The list holds the chosen slots first, in no
particular order (attention over them does not depend on it), then in-range filler up to `k`.
"""

from __future__ import annotations

import math

import torch
from atskv.kernels.backend import jit, tl, triton, use_triton
from atskv.kernels.budget import budget_limit, kept_tokens

from atskv.kernels.partial_scores import partial_scores, partial_scores_reference

_TINY = torch.finfo(torch.float32).tiny
_MIN = torch.finfo(torch.float32).min
# the select's radix: 12 bits from the histogram the probabilities kernel builds (a bin spans 1/16
# of an octave of probability), then 10 and 9 bits over the slots of the chosen bin
_BINS_BITS, _MID_BITS, _LOW_BITS = 12, 10, 9
LOGITS_WAVES = 2  # programs per SM the logits kernel aims at: sm_90 fits two (120 registers, 8 warps)


def top_channels(query: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparQ's step 1 for `query` `[..., D]`: the `rank` channels of largest |q| (equal magnitudes:
    the lower channel first, on every device), and the share of the query's L1 mass they keep
    (clamped away from 0), whose square root divides the softmax temperature."""
    magnitude = query.abs().float()
    top = magnitude.sort(dim=-1, descending=True, stable=True)
    kept = top.values[..., :rank].sum(-1) / magnitude.sum(-1).clamp(min=_TINY)
    return top.indices[..., :rank], kept.clamp(min=_TINY)


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


def sparq_decode(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                 budget: int | float, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step: first the new token's key (`keys[b, h, write_slot[b, h]]`) is copied into
    `keys_t` `[B, Hkv, D, S]` in place; then slot ids `[B, Hkv, k]` (int32) whose first `lengths`
    `[B, Hkv]` (int32) are the held slots of highest pooled SparQ probability for `query` `[B, Hq, D]`
    (see the module docstring), the rest in-range filler. `lengths`: the row's budget (`budget` of
    `context` `[B]` tokens, `resolve_budget`'s rule), at most its held slots and `k`."""
    if use_triton(query):
        return sparq_decode_triton(query, keys, keys_t, slot_pos, write_slot, context, scaling, rank, budget, k)
    return sparq_decode_reference(query, keys, keys_t, slot_pos, write_slot, context, scaling, rank, budget, k)


def sparq_decode_reference(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                           budget: int | float, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, hkv, d, s = keys_t.shape
    at = write_slot.view(b, hkv, 1, 1)
    keys_t.scatter_(3, at.expand(b, hkv, d, 1), keys.gather(2, at.expand(b, hkv, 1, d)).transpose(2, 3))
    held = slot_pos >= 0
    probs = sparq_probs(query.unsqueeze(2), keys_t.transpose(2, 3), held.unsqueeze(2), scaling, rank,
                        partial_scores_reference)[:, :, 0]  # fmt: skip
    newest_first = probs.masked_fill(~held, -math.inf).flip(-1)  # a stable sort then ranks equals by slot, high first
    best = s - 1 - newest_first.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    lengths = kept_tokens(budget, context.view(-1, 1)).minimum(held.sum(-1)).clamp(max=k)
    return best.int(), lengths.int()


@jit
def _logits_kernel(
    q_ptr, k_ptr, kt_ptr, pos_ptr, w_ptr, logit_ptr, stat_ptr, hist_ptr,
    n_kv_heads, n_slots, span, head_dim, scaling,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    st_b, st_h, st_d, st_s,
    sp_b, sp_h, sp_s,
    sw_b, sw_h,
    GROUP: tl.constexpr, RANK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, N_BINS: tl.constexpr,
    PLACE_STEP: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and `span` slots, BLOCK_S at a time. The group's channels are chosen once;
    each step reads their rows of `keys_t` (BLOCK_G x BLOCK_R rows, head-major, unused ones masked)
    and one product with a block-diagonal matrix of the chosen q components (BLOCK_M rows, row g
    for head g) gives every head's logits: a loop whose only load feeds `tl.dot`, which Triton
    pipelines. Logits go to `[rows, GROUP, S]` (-inf: free slot), each head's max and sum of exp
    over the span to `[rows, GROUP, parts, 2]`; part 0 zeroes the row's histogram."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    b = (row // n_kv_heads).to(tl.int64)
    h = row % n_kv_heads
    new = tl.load(w_ptr + b * sw_b + h * sw_h)  # the slot the decode token was written to
    k_new = k_ptr + b * sk_b + h * sk_h + new * sk_s
    kt_head = kt_ptr + b * st_b + h * st_h
    first = part * span
    last = tl.minimum(first + span, n_slots)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if (new >= first) & (new < last):
        tl.store(kt_head + d * st_d + new * st_s, tl.load(k_new + d * sk_d, mask=d_ok), mask=d_ok)
    if part == 0:
        tl.store(hist_ptr + row.to(tl.int64) * N_BINS + tl.arange(0, N_BINS), tl.zeros([N_BINS], tl.int32))
    gi = tl.arange(0, BLOCK_G)
    i = tl.arange(0, BLOCK_R)
    m = tl.arange(0, BLOCK_M)
    dims = tl.zeros([BLOCK_G, BLOCK_R], tl.int32)
    q_sel = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
    scale = tl.zeros([BLOCK_M], tl.float32)
    for g in tl.static_range(GROUP):
        q_at = q_ptr + b * sq_b + (h * GROUP + g) * sq_h
        q = tl.load(q_at + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        mag = tl.where(d_ok, tl.abs(q), -1.0)
        # a channel's place in |q| order, larger first, the lower channel first among equals
        place = tl.zeros([BLOCK_D], tl.int32)
        for lo in tl.static_range(0, BLOCK_D, PLACE_STEP):
            e = lo + tl.arange(0, PLACE_STEP)
            other = tl.load(q_at + e * sq_d, mask=e < head_dim, other=0.0).to(tl.float32)
            other = tl.where(e < head_dim, tl.abs(other), -1.0)[None, :]
            ahead = (other > mag[:, None]) | ((other == mag[:, None]) & (e[None, :] < d[:, None]))
            place += tl.sum(ahead.to(tl.int32), 1)
        kept = tl.sum(tl.where(place < RANK, mag, 0.0), 0)
        total = tl.maximum(tl.sum(tl.where(d_ok, mag, 0.0), 0), 1.1754943508222875e-38)  # float32's tiny
        share = tl.maximum(tl.div_rn(kept, total), 1.1754943508222875e-38)
        scale = tl.where(m == g, tl.div_rn(scaling, tl.sqrt_rn(share)), scale)
        pick = (place[None, :] == i[:, None]) & (i < RANK)[:, None]  # [BLOCK_R, BLOCK_D]: row i, the i-th channel
        mine = (gi == g)[:, None]
        dims = tl.where(mine, tl.sum(tl.where(pick, d[None, :], 0), 1)[None, :], dims)
        q_sel = tl.where(mine, tl.sum(tl.where(pick, q[None, :], 0.0), 1)[None, :], q_sel)
    # tile row j: head j // BLOCK_R, its (j % BLOCK_R)-th channel
    head_of, nth = tl.arange(0, BLOCK_G * BLOCK_R) // BLOCK_R, tl.arange(0, BLOCK_G * BLOCK_R) % BLOCK_R
    used = (head_of < GROUP) & (nth < RANK)
    dims = tl.reshape(dims, [BLOCK_G * BLOCK_R])
    q_sel = tl.reshape(q_sel, [BLOCK_G * BLOCK_R])
    mix = tl.where(head_of[None, :] == m[:, None], q_sel[None, :], 0.0)  # [BLOCK_M, rows], block-diagonal
    # the new token's logits from the row-major keys: its column of `keys_t` is written above, and
    # that store is not ordered before this program's reads
    at_new = tl.sum(mix * tl.load(k_new + dims * sk_d, mask=used, other=0.0).to(tl.float32)[None, :], 1)
    mix = mix.to(kt_ptr.dtype.element_ty)  # exact: the components of q, in its dtype
    if UPCAST_DOT:
        mix = mix.to(tl.float32)
    top = tl.full([BLOCK_M], -3.4028234663852886e38, tl.float32)  # float32's min, as the reference's mask
    exps = tl.zeros([BLOCK_M], tl.float32)
    out_at = logit_ptr + (row.to(tl.int64) * GROUP + m)[:, None] * n_slots
    for start in range(first, last, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        ok = s < last
        tile = tl.load(kt_head + dims[:, None] * st_d + s[None, :] * st_s, mask=used[:, None] & ok[None, :], other=0.0)
        if UPCAST_DOT:
            tile = tile.to(tl.float32)
        logit = tl.dot(mix, tile, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_S]
        logit = tl.where(s[None, :] == new, at_new[:, None], logit) * scale[:, None]
        held = (tl.load(pos_ptr + b * sp_b + h * sp_h + s * sp_s, mask=ok, other=-1) >= 0)[None, :]
        step_top = tl.maximum(top, tl.max(tl.where(held, logit, -3.4028234663852886e38), 1))
        exps = exps * tl.exp(top - step_top) + tl.sum(tl.where(held, tl.exp(logit - step_top[:, None]), 0.0), 1)
        top = step_top
        tl.store(out_at + s[None, :], tl.where(held, logit, float("-inf")), mask=(m < GROUP)[:, None] & ok[None, :])
    at = (row.to(tl.int64) * GROUP + m) * n_parts + part
    tl.store(stat_ptr + at * 2, top, mask=m < GROUP)
    tl.store(stat_ptr + at * 2 + 1, exps, mask=m < GROUP)


@jit
def _probs_kernel(
    logit_ptr, stat_ptr, key_ptr, hist_ptr, n_slots, n_parts,
    GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, N_BINS: tl.constexpr, SHIFT: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) and BLOCK_S slots (`n_parts`: the logits kernel's spans, whose partials
    give each head's log-sum-exp): pooled probabilities as int32 keys (a non-negative
    float's bits keep its order; free slots -1, below all) and their top bits' histogram."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = s < n_slots
    j = tl.arange(0, BLOCK_B)
    prob = tl.zeros([BLOCK_S], tl.float32)
    held = in_range
    for g in tl.static_range(GROUP):
        at = row * GROUP + g
        part = stat_ptr + (at * n_parts + j) * 2
        peak = tl.load(part, mask=j < n_parts, other=-3.4028234663852886e38)
        top = tl.max(peak, 0)
        norm = tl.sum(tl.load(part + 1, mask=j < n_parts, other=0.0) * tl.exp(peak - top), 0)
        logit = tl.load(logit_ptr + at * n_slots + s, mask=in_range, other=float("-inf"))
        held = held & (logit > float("-inf"))
        prob += tl.div_rn(tl.exp(logit - top), norm)
    key = tl.where(held, prob.to(tl.int32, bitcast=True), -1)
    tl.store(key_ptr + row * n_slots + s, key, mask=in_range)
    bins = tl.where(held, key >> SHIFT, 0)
    count = tl.histogram(bins, N_BINS)
    count -= tl.where(tl.arange(0, N_BINS) == 0, tl.sum((~held).to(tl.int32), 0), 0)  # the free slots put in bin 0
    hist = hist_ptr + row * N_BINS + tl.arange(0, N_BINS)
    tl.atomic_add(hist, count, mask=count > 0, sem="relaxed")


@jit
def _cut(count, need, N: tl.constexpr):
    """The highest bin whose keys and those of the bins above reach `need` (N - 1 for need <= 0),
    and how many keys lie above it."""
    bins = tl.arange(0, N)
    at_least = tl.sum(count, 0) - tl.cumsum(count, 0) + count
    cut = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    return cut, tl.sum(tl.where(bins > cut, count, 0), 0)


@jit
def _candidate_histogram(key_row, cand_row, n_cand, prefix, PREFIX_SHIFT: tl.constexpr, SHIFT: tl.constexpr,
                         N: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Histogram of key bits [SHIFT, SHIFT + log2 N) over the collected slots whose key >> PREFIX_SHIFT is `prefix`."""
    count = tl.zeros([N], tl.int32)
    for start in range(0, n_cand, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        ok = c < n_cand
        key = tl.load(key_row + tl.load(cand_row + c, mask=ok, other=0), mask=ok, other=0)
        ok = ok & ((key >> PREFIX_SHIFT) == prefix)
        count += tl.histogram(tl.where(ok, (key >> SHIFT) & (N - 1), 0), N)
        count -= tl.where(tl.arange(0, N) == 0, tl.sum((~ok).to(tl.int32), 0), 0)
    return count


@jit
def _select_kernel(
    key_ptr, hist_ptr, cand_ptr, ctx_ptr, idx_ptr, len_ptr, n_kv_heads, n_slots, n_out, budget,
    FRACTION: tl.constexpr, N_BINS: tl.constexpr, SHIFT: tl.constexpr, MID: tl.constexpr, LOW: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One (row, KV head): the index list and its length (see the module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // n_kv_heads
    key_row = key_ptr + row * n_slots
    cand_row = cand_ptr + row * n_slots
    out_row = idx_ptr + row * n_out
    count = tl.load(hist_ptr + row * N_BINS + tl.arange(0, N_BINS))
    length = tl.minimum(budget_limit(tl.load(ctx_ptr + b), budget, FRACTION), tl.sum(count, 0))
    length = tl.minimum(length, n_out).to(tl.int32)
    cut, above = _cut(count, length, N_BINS)
    # one scan: slots of higher bins to the list, those of bin `cut` to the candidates; the next
    # chunk is loaded before this one is placed, and one scan of packed flags places both kinds
    n_hi = tl.zeros([], tl.int32)
    n_tie = tl.zeros([], tl.int32)
    c = tl.arange(0, CHUNK)
    key = tl.load(key_row + c, mask=c < n_slots, other=-1)
    for start in range(0, n_slots, CHUNK):
        s = start + c
        following = tl.load(key_row + s + CHUNK, mask=s + CHUNK < n_slots, other=-1)
        hi = (key >> SHIFT) > cut
        tie = ((key >> SHIFT) == cut) & (key >= 0)
        flags = hi.to(tl.int32) + (tie.to(tl.int32) << 16)
        placed = tl.cumsum(flags, 0) - flags
        tl.store(out_row + n_hi + (placed & 0xFFFF), s, mask=hi)
        tl.store(cand_row + n_tie + (placed >> 16), s, mask=tie)
        both = tl.sum(flags, 0)
        n_hi += both & 0xFFFF
        n_tie += both >> 16
        key = following
    # the exact threshold among the candidates: two more radix levels
    need = length - above
    mid = _candidate_histogram(key_row, cand_row, n_tie, cut, SHIFT, LOW, 1 << MID, BLOCK_C)
    cut_mid, above_mid = _cut(mid, need, 1 << MID)
    need -= above_mid
    low = _candidate_histogram(key_row, cand_row, n_tie, (cut << MID) | cut_mid, LOW, 0, 1 << LOW, BLOCK_C)
    cut_low, above_low = _cut(low, need, 1 << LOW)
    need -= above_low
    threshold = (cut << SHIFT) | (cut_mid << LOW) | cut_low
    skipped = tl.sum(tl.where(tl.arange(0, 1 << LOW) == cut_low, low, 0), 0) - need  # equals not taken: the lower slots
    taken = above
    equals = tl.zeros([], tl.int32)
    for start in range(0, n_tie, BLOCK_C):
        j = start + tl.arange(0, BLOCK_C)
        ok = j < n_tie
        slot = tl.load(cand_row + j, mask=ok, other=0)
        cand_key = tl.load(key_row + slot, mask=ok, other=-1)
        equal = ok & (cand_key == threshold)
        take = ok & ((cand_key > threshold) | (equal & (equals + tl.cumsum(equal.to(tl.int32), 0) > skipped)))
        tl.store(out_row + taken + tl.cumsum(take.to(tl.int32), 0) - 1, slot, mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        equals += tl.sum(equal.to(tl.int32), 0)
    for start in range(0, n_out, CHUNK):  # in-range filler after the counted slots
        i = start + c
        tl.store(out_row + i, i, mask=(i >= length) & (i < n_out))
    tl.store(len_ptr + row, length)


def sparq_decode_triton(query, keys, keys_t, slot_pos, write_slot, context, scaling: float, rank: int,
                        budget: int | float, k: int, block_s: int = 256, parts: int | None = None,
                        probs_block: int = 2048, chunk: int = 4096, block_c: int = 1024,
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The three kernels. `block_s`: slots per step of the logits kernel; `parts`: its programs per
    KV head (None: about LOGITS_WAVES per SM over the grid, each at least two steps long; two off
    CUDA); `probs_block`: slots per program of the probabilities (each adds its histogram to the
    row's by atomics); `chunk`: slots per step of the select's scan; `block_c`: candidates per step
    of its refinement. Smaller values cover the loops in tests."""
    if chunk >= 1 << 15:
        raise ValueError(f"chunk must be below 32768 (two counts share one int32 in the scan), got {chunk}")
    b, hq, d = query.shape
    hkv, slots = keys_t.shape[1], keys_t.shape[3]
    rows, group, block_g = b * hkv, hq // hkv, triton.next_power_of_2(hq // hkv)
    steps = triton.cdiv(slots, block_s)
    if parts is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 0
        wanted = math.ceil(LOGITS_WAVES * sms / rows) if query.is_cuda else 2
        parts = max(1, min(wanted, steps // 2))
    span = triton.cdiv(steps, parts) * block_s
    parts = triton.cdiv(slots, span)
    device = query.device
    logits = torch.empty(rows, group, slots, dtype=torch.float32, device=device)
    stats = torch.empty(rows, group, parts, 2, dtype=torch.float32, device=device)
    hist = torch.empty(rows, 1 << _BINS_BITS, dtype=torch.int32, device=device)
    keys32 = torch.empty(rows, slots, dtype=torch.int32, device=device)
    candidates = torch.empty(rows, slots, dtype=torch.int32, device=device)
    indices = torch.empty(b, hkv, k, dtype=torch.int32, device=device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=device)
    _logits_kernel[(rows, parts)](
        query, keys, keys_t, slot_pos, write_slot, logits, stats, hist, hkv, slots, span, d, scaling,
        *query.stride(), *keys.stride(), *keys_t.stride(), *slot_pos.stride(), *write_slot.stride(),
        GROUP=group, RANK=rank, BLOCK_G=block_g, BLOCK_R=max(triton.next_power_of_2(rank), 16 // block_g),
        BLOCK_M=max(16, block_g), BLOCK_D=triton.next_power_of_2(d), BLOCK_S=block_s, N_BINS=1 << _BINS_BITS,
        PLACE_STEP=min(16, triton.next_power_of_2(d)), DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        UPCAST_DOT=not query.is_cuda, num_warps=8,
    )  # fmt: skip
    shift = 31 - _BINS_BITS
    _probs_kernel[(rows, triton.cdiv(slots, probs_block))](
        logits, stats, keys32, hist, slots, parts, GROUP=group, BLOCK_S=probs_block,
        BLOCK_B=triton.next_power_of_2(parts), N_BINS=1 << _BINS_BITS, SHIFT=shift, num_warps=8,
    )  # fmt: skip
    _select_kernel[(rows,)](
        keys32, hist, candidates, context.reshape(-1).contiguous(), indices, lengths, hkv, slots, k, budget,
        FRACTION=isinstance(budget, float), N_BINS=1 << _BINS_BITS, SHIFT=shift, MID=_MID_BITS, LOW=_LOW_BITS,
        CHUNK=chunk, BLOCK_C=block_c, num_warps=8,
    )  # fmt: skip
    return indices, lengths
