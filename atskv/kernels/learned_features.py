"""The learned selector's two fast-path steps (`atskv.selectors.learned`) in one kernel each.

- `write_token_features`: a decode token's fixed features into the slot each KV head wrote it
  to: its hidden state's projection (RMS norm, then a linear map), the hidden state's norm and its
  token type; the slot's received attention and score restart there too (the cache leaves them to
  this write: `StaticSlotLayer.reset_by_selector`). In torch that was ~10 small kernels per layer
  and step, launch-bound for a GEMV of 64 outputs, and the cache's reset of the slot two more.
- `refresh_scores`: every slot's scalar features (`atskv.features.SCALAR_FEATURES`) and the
  `RelevanceMLP` over them, every `refresh_every` steps. In torch that was ~50 kernels per layer,
  among them a float32 GEMM whose `[slots, hidden]` activations then went through memory twice
  more (ReLU, W2). The first kernel gathered W1's type, scalar and embedding columns and reduced
  the W2 products across lanes for every chunk of 32 hidden units, on 208 serial programs; now
  (`_pack`) the embeddings fold into a bias per layer and head, and every other input meets W1's
  TF32 part and remainder (split once, not per program) through `tl.dot`: the projected hidden
  state (bfloat16, exact in TF32), the standardised scalars (themselves split in two) and the type
  one-hot, so the products stay float32-accurate (the scores decide evictions, which must match
  the reference path's); the W2 products are summed once per slot (timings:
  docs/results/kernel-notes.md).

Per-slot state is passed as `[B, Hkv, S]` views (any strides): `kind` holds 1 + the token's type,
0 for a slot no token has entered yet. The previous managed layer's attention reaches the next by
position, as `[B, 2, positions + 1]` sums over the KV heads holding each token: the attention,
then how many heads hold it.

Each has a plain-torch reference with the same contract; tests compare them on random inputs.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from atskv.features import SCALAR_FEATURES, feature_columns
from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs


# --- a decode token's fixed features ----------------------------------------------------------
def write_token_features(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind, received,
                         score) -> None:  # fmt: skip
    """In place, for every row b and KV head h, at slot `slots[b, h]`: `projected` `[B, Hkv, S, W]`
    gets `weight @ rms_norm(hidden[b]) + bias` (`weight` `[W, d_model]` float32, `bias` `[W]` or
    None; `hidden` `[B, d_model]`), `hidden_norm` `[B, Hkv, S]` gets `||hidden[b]||`, `kind`
    `[B, Hkv, S]` gets `1 + token_types[ids[b]]` (`token_types` `[vocab]` int8, `ids` `[B]`), and
    `received` and `score` `[B, Hkv, S]` restart at 0 and +inf (a new token's, until a refresh)."""
    state = (slots, projected, hidden_norm, kind, received, score)
    if use_triton(hidden) and projected.dtype == torch.bfloat16:
        write_token_features_triton(weight, bias, hidden, token_types, ids, *state)
    else:
        write_token_features_reference(weight, bias, hidden, token_types, ids, *state)


def write_token_features_reference(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind,
                                   received, score):  # fmt: skip
    rows = F.linear(F.rms_norm(hidden.to(weight.dtype), (hidden.shape[-1],)), weight, bias)
    norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
    scatter_token_features(rows, norm, token_types[ids].float() + 1, slots, projected, hidden_norm, kind, received,
                           score)  # fmt: skip


def scatter_token_features(rows, norm, kinds, slots, projected, hidden_norm, kind, received, score) -> None:
    """Each row's projection `rows` `[B, W]`, norm `[B]` and kind `[B]` into slot `slots[b, h]` of
    every KV head h, whose `received` and `score` restart (the torch step, also for scorers the
    kernel does not compute)."""
    b, h = slots.shape
    index = slots.view(b, h, 1)
    projected.scatter_(2, index.unsqueeze(-1).expand(b, h, 1, projected.shape[-1]),
                       rows.to(projected.dtype).view(b, 1, 1, -1).expand(b, h, 1, -1))  # fmt: skip
    hidden_norm.scatter_(2, index, norm.view(b, 1, 1).expand(b, h, 1).to(hidden_norm.dtype))
    kind.scatter_(2, index, kinds.view(b, 1, 1).expand(b, h, 1).to(kind.dtype))
    received.scatter_(2, index, 0.0)
    score.scatter_(2, index, torch.inf)


@jit
def _bfloat16_bits(x):
    """float32 -> bfloat16 bits rounded to nearest even, as torch rounds (Triton's interpreter
    truncates a cast; the bits are stored through an int16 view)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@jit
def _token_features_kernel(
    hidden_ptr, w_ptr, bias_ptr, types_ptr, ids_ptr, slot_ptr, proj_ptr, norm_ptr, kind_ptr, recv_ptr, score_ptr,
    n_kv_heads, d_model, width, d_float, eps,
    sx_b, sx_d, sw_o, sw_i, si_b, ss_b, ss_h, sp_b, sp_h, sp_s, sp_w, sn_b, sn_h, sn_s, sk_b, sk_h, sk_s,
    sr_b, sr_h, sr_s, sz_b, sz_h, sz_s,
    HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, block of projected columns): one walk over the hidden state gives its sum of
    squares and the raw products, scaled by the RMS norm at the end. The first block also writes
    the slot's scalars."""
    wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    j = part * BLOCK_W + tl.arange(0, BLOCK_W)
    j_ok = j < width
    squares = tl.zeros([BLOCK_D], tl.float32)
    products = tl.zeros([BLOCK_W, BLOCK_D], tl.float32)
    for start in range(0, d_model, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        d_ok = d < d_model
        x = tl.load(hidden_ptr + b * sx_b + d * sx_d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + j[:, None] * sw_o + d[None, :] * sw_i, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        squares += x * x
        products += w.to(tl.float32) * x[None, :]
    total = tl.sum(squares, 0)
    row = tl.div_rn(tl.sum(products, 1), tl.sqrt_rn(tl.div_rn(total, d_float) + eps))
    if HAS_BIAS:
        row += tl.load(bias_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < n_kv_heads
    slot = tl.load(slot_ptr + b * ss_b + heads * ss_h, mask=h_ok, other=0).to(tl.int64)
    bits = tl.broadcast_to(_bfloat16_bits(row)[None, :], (BLOCK_H, BLOCK_W))
    tl.store(proj_ptr + b * sp_b + heads[:, None] * sp_h + slot[:, None] * sp_s + j[None, :] * sp_w, bits,
             mask=h_ok[:, None] & j_ok[None, :])  # fmt: skip
    if part == 0:
        kind = tl.load(types_ptr + tl.load(ids_ptr + b * si_b)).to(tl.float32) + 1.0
        norm = tl.broadcast_to(tl.sqrt_rn(total), (BLOCK_H,))
        tl.store(norm_ptr + b * sn_b + heads * sn_h + slot * sn_s, norm, mask=h_ok)
        tl.store(kind_ptr + b * sk_b + heads * sk_h + slot * sk_s, tl.broadcast_to(kind, (BLOCK_H,)), mask=h_ok)
        tl.store(recv_ptr + b * sr_b + heads * sr_h + slot * sr_s, tl.zeros([BLOCK_H], tl.float32), mask=h_ok)
        tl.store(score_ptr + b * sz_b + heads * sz_h + slot * sz_s, tl.full([BLOCK_H], float("inf"), tl.float32),
                 mask=h_ok)  # fmt: skip


# the token kernel's tiles, tuned on an H200 at the 8B shape: 32 programs a row, two weight rows each
_TOKEN_CONFIG = {"BLOCK_W": 2, "BLOCK_D": 1024, "num_warps": 4}


def write_token_features_triton(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind, received,
                                score):  # fmt: skip
    b, h = slots.shape
    width, d_model = weight.shape
    config = dict(_TOKEN_CONFIG)
    block_w, block_d = config.pop("BLOCK_W"), min(config.pop("BLOCK_D"), triton.next_power_of_2(d_model))
    bits = projected.view(torch.int16)
    grid = (b, max(1, triton.cdiv(width, block_w)))  # a predictor without the hidden state (width 0) still
    _token_features_kernel[grid](  # restarts the slot's norm, kind, attention received and score (part 0)
        hidden, weight, bias if bias is not None else weight, token_types, ids, slots, bits, hidden_norm, kind,
        received, score, h, d_model, width, float(d_model), torch.finfo(weight.dtype).eps,
        *hidden.stride(), *weight.stride(), ids.stride(0), *slots.stride(), *bits.stride(), *hidden_norm.stride(),
        *kind.stride(), *received.stride(), *score.stride(),
        HAS_BIAS=bias is not None, BLOCK_W=block_w, BLOCK_D=block_d, BLOCK_H=triton.next_power_of_2(h), **config,
        **dependent_launch(hidden, grid),
    )  # fmt: skip


# --- the refresh: every slot's features and score ------------------------------------------
def slot_scalars(received, hidden_norm, keys, slot_pos, context, seen, group_size: int, previous) -> torch.Tensor:
    """`[B, Hkv, S, F]` scalar features of every slot, in `SCALAR_FEATURES` order. `received`
    `[B, Hkv, S]`: the attention each slot's token received, summed over the group's query heads;
    `context` `[B]`: each row's real tokens; `seen`: tokens written, padding included (an int or a
    `[1]` tensor); `previous`: the previous managed layer's sums by position, or None (zeros)."""
    # positions within each row's own text: left padding shifts a row's slots, not its features
    padding = (seen - context).view(-1, 1, 1)
    pos = (slot_pos - padding).clamp(min=0).float()
    newest = (context - 1).float().view(-1, 1, 1)
    seen_by = (newest - pos + 1).clamp(min=1)  # queries that could attend to the token so far
    attention = received / group_size / seen_by
    if previous is None:
        prev = torch.zeros_like(attention)
    else:
        b, h, s = slot_pos.shape
        at = slot_pos.clamp(min=0).view(b, 1, h * s).expand(b, 2, h * s)
        total, heads = previous.gather(-1, at).view(b, 2, h, s).unbind(1)
        prev = (total / heads.clamp(min=1)).masked_fill(slot_pos < 0, 0.0)
    return feature_columns(attention, pos, newest, hidden_norm, keys.float().norm(dim=-1), prev)


def attention_by_position(attention, slot_pos, positions: int) -> torch.Tensor:
    """`[B, 2, positions + 1]`: the per-slot `attention` `[B, Hkv, S]` summed by position over the
    KV heads holding the token, and the count of those heads (each head has its own slot layout
    once it has evicted); the last column is spare."""
    b = slot_pos.shape[0]
    held = slot_pos >= 0
    index = slot_pos.masked_fill(~held, positions).view(b, -1)
    sums = torch.zeros(b, 2, positions + 1, device=attention.device)
    sums[:, 0].scatter_add_(-1, index, attention.float().masked_fill(~held, 0.0).view(b, -1))
    sums[:, 1].scatter_add_(-1, index, held.float().view(b, -1))
    return sums


def score_slots(mlp, layer_index: int, scalars, projected, kind, slot_pos, score) -> None:
    """`score` `[B, Hkv, S]` gets the scorer's logits for every slot (-inf where free) from the
    `[B, Hkv, S, F]` `scalars`, the projected hidden states and token kinds: the MLP runs on every
    slot, so the shapes are fixed and nothing is read back."""
    b, h, s = slot_pos.shape
    n = b * h * s
    heads = torch.arange(h, device=slot_pos.device).view(1, h, 1).expand(b, h, s)
    with torch.no_grad():
        logits = mlp.score(
            projected.reshape(n, -1).to(mlp.dtype),
            scalars.reshape(n, -1),
            (kind - 1).clamp(min=0).reshape(-1).long(),
            torch.full((n,), layer_index, device=slot_pos.device),
            heads.reshape(-1),
        )
    score.copy_(logits.float().view(b, h, s).masked_fill(slot_pos < 0, -torch.inf))


def refresh_scores(mlp, layer_index: int, projected, hidden_norm, kind, received, keys, slot_pos, context, seen,
                   group_size: int, previous, sums, score) -> None:  # fmt: skip
    """In place: `score` `[B, Hkv, S]` gets every slot's logit (-inf where free) by the float32
    `RelevanceMLP` `mlp` in eval mode, for managed layer `layer_index`, from the features
    `slot_scalars` computes (the same arguments; `seen` a `[1]` tensor); `sums` (zeros
    `[B, 2, P + 1]`, P above every slot position) gets this layer's `attention_by_position`."""
    if use_triton(keys):
        refresh_scores_triton(mlp, layer_index, projected, hidden_norm, kind, received, keys, slot_pos, context,
                              seen, group_size, previous, sums, score)  # fmt: skip
    else:
        refresh_scores_reference(mlp, layer_index, projected, hidden_norm, kind, received, keys, slot_pos, context,
                                 seen, group_size, previous, sums, score)  # fmt: skip


def refresh_scores_reference(mlp, layer_index, projected, hidden_norm, kind, received, keys, slot_pos, context, seen,
                             group_size, previous, sums, score) -> None:  # fmt: skip
    scalars = slot_scalars(received, hidden_norm, keys, slot_pos, context, seen, group_size, previous)
    sums += attention_by_position(scalars[..., 0], slot_pos, sums.shape[-1] - 1)
    score_slots(mlp, layer_index, scalars, projected, kind, slot_pos, score)


@jit
def _tf32_split(w):
    """`w` as a TF32-exact part and its remainder: a TF32 product of each with an operand exact in
    TF32 loses ~2^-20 of `w`, about what float32 accumulation does."""
    high = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return high, w - high


def _tf32_split_host(w: torch.Tensor) -> torch.Tensor:
    """`_tf32_split` of a float32 tensor, stacked `[2, ...]`."""
    high = (w.view(torch.int32) & -0x2000).view(torch.float32)
    return torch.stack([high, w - high])


# RelevanceMLP -> (its weights' versions, `_pack(mlp)`)
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HIDDEN_MULTIPLE = 128  # the packed hidden units are padded to a multiple of every BLOCK_N (zero weights)


def _packed(mlp) -> dict:
    """`_pack(mlp)`, built once per set of weights (in place updates and moves rebuild it; never
    kept from inside a CUDA graph capture, whose tensors are filled only by its replays)."""
    params = (mlp.w1.weight, mlp.w1.bias, mlp.w2.weight, mlp.w2.bias, mlp.layer_embedding.weight,
              mlp.head_embedding.weight)  # fmt: skip
    versions = tuple((p._version, p.data_ptr()) for p in params)
    hit = _PACKED.get(mlp)
    if hit is not None and hit[0] == versions:
        return hit[1]
    packed = _pack(mlp)
    if not (packed["w2"].is_cuda and torch.cuda.is_current_stream_capturing()):
        _PACKED[mlp] = versions, packed
    return packed


@torch.no_grad()
def _pack(mlp) -> dict:
    """W1 as the refresh kernel reads it, every input through `tl.dot`: `projected` `[2, N, KP]`
    (TF32 part and remainder of the projected hidden state's columns) and `extra` `[2, N, KX]` (of
    the scalar features' columns, twice: they meet the TF32 part and the remainder of each scalar;
    then the type one-hot's), N the hidden units padded with zeros. The embeddings of a layer and
    head are constant inputs, so they fold into `bias` `[layers, heads, N]` with b1."""
    w1, width, kept = mlp.w1.weight.float(), mlp.projected_width, mlp.kept.tolist()
    hidden, features = w1.shape[0], len(SCALAR_FEATURES)
    padded = triton.cdiv(hidden, _HIDDEN_MULTIPLE) * _HIDDEN_MULTIPLE
    types = mlp.spec.num_token_types if mlp.types else 0
    projected = w1.new_zeros(padded, max(16, triton.next_power_of_2(width)))
    projected[:hidden, :width] = w1[:, :width]
    extra = w1.new_zeros(padded, max(16, triton.next_power_of_2(2 * features + types)))
    for column, feature in enumerate(kept):
        extra[:hidden, feature] = extra[:hidden, features + feature] = w1[:, width + column]
    after = width + len(kept)
    extra[:hidden, 2 * features : 2 * features + types] = w1[:, after : after + types]
    layers, heads = mlp.layer_embedding.weight.float(), mlp.head_embedding.weight.float()
    after += types
    by_layer = (w1[:, after : after + layers.shape[1]] * layers[:, None]).sum(-1)  # elementwise: no TF32 GEMM
    after += layers.shape[1]
    by_head = (w1[:, after : after + heads.shape[1]] * heads[:, None]).sum(-1)
    bias = w1.new_zeros(layers.shape[0], heads.shape[0], padded)
    bias[..., :hidden] = mlp.w1.bias.float() + by_layer[:, None] + by_head[None]
    w2 = w1.new_zeros(padded)
    w2[:hidden] = mlp.w2.weight.float().view(-1)
    return {"projected": _tf32_split_host(projected), "extra": _tf32_split_host(extra),
            "bias": bias, "w2": w2}  # fmt: skip


@jit
def _refresh_kernel(
    proj_ptr, norm_ptr, kind_ptr, recv_ptr, key_ptr, pos_ptr, ctx_ptr, seen_ptr, prev_ptr, sums_ptr, score_ptr,
    wp_ptr, wx_ptr, bias_ptr, w2_ptr, b2_ptr, mean_ptr, var_ptr,
    n_kv_heads, n_slots, head_dim, width, hidden, group_size, bn_eps, layer_index,
    sp_b, sp_h, sp_s, sp_w, sn_b, sn_h, sn_s, sk_b, sk_h, sk_s, sr_b, sr_h, sr_s,
    sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, sc_b, sv_b, sv_k, su_b, su_k, sz_b, sz_h, sz_s,
    HAS_PREVIOUS: tl.constexpr, TYPES: tl.constexpr, FEATURES: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head, block of slots): features, then the MLP one chunk of hidden units at a
    time, all of W1 through four `tl.dot`s a chunk (`_pack`); the W2 products add up elementwise
    and are summed once at the end."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = bh % n_kv_heads
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    inside = s < n_slots
    raw = tl.load(pos_ptr + b * so_b + h * so_h + s * so_s, mask=inside, other=-1).to(tl.int64)
    held = raw >= 0
    # the features, as `slot_scalars`
    context = tl.load(ctx_ptr + b * sc_b).to(tl.int64)
    padding = tl.load(seen_ptr).to(tl.int64) - context
    pos = tl.maximum(raw - padding, 0).to(tl.float32)
    newest = (context - 1).to(tl.float32)
    seen_by = tl.maximum(newest - pos + 1.0, 1.0)
    received = tl.load(recv_ptr + b * sr_b + h * sr_h + s * sr_s, mask=inside, other=0.0)
    attention = tl.div_rn(tl.div_rn(received, group_size), seen_by)
    position = tl.div_rn(pos, tl.maximum(newest, 1.0))
    age = tl.log(1.0 + tl.maximum(newest - pos, 0.0))  # log1p of a whole number: 1 + it is exact
    norm = tl.load(norm_ptr + b * sn_b + h * sn_h + s * sn_s, mask=inside, other=0.0)
    squares = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, head_dim, BLOCK_D):  # a block of channels at a time: fewer registers
        d = start + tl.arange(0, BLOCK_D)
        key = tl.load(key_ptr + b * sx_b + h * sx_h + s[:, None] * sx_s + d[None, :] * sx_d,
                      mask=inside[:, None] & (d[None, :] < head_dim), other=0.0).to(tl.float32)  # fmt: skip
        squares += tl.sum(key * key, 1)
    key_norm = tl.sqrt_rn(squares)
    prev = tl.zeros([BLOCK_S], tl.float32)
    at = tl.maximum(raw, 0)
    if HAS_PREVIOUS:
        total = tl.load(prev_ptr + b * sv_b + at, mask=inside, other=0.0)
        heads = tl.load(prev_ptr + b * sv_b + sv_k + at, mask=inside, other=1.0)
        prev = tl.where(held, tl.div_rn(total, tl.maximum(heads, 1.0)), 0.0)
    # relaxed: only the sums matter, not the order the heads add them in
    tl.atomic_add(sums_ptr + b * su_b + at, attention, mask=held, sem="relaxed")
    tl.atomic_add(sums_ptr + b * su_b + su_k + at, tl.full([BLOCK_S], 1.0, tl.float32), mask=held, sem="relaxed")
    # the MLP's other inputs as one tile: each standardised scalar (as `RelevanceMLP.scalar_norm` in
    # eval mode) split in two, then the type one-hot
    c = tl.arange(0, BLOCK_X)[None, :]
    x = tl.zeros([BLOCK_S, BLOCK_X], tl.float32)
    x = _put(x, c, attention, 0, FEATURES, mean_ptr, var_ptr, bn_eps)
    x = _put(x, c, position, 1, FEATURES, mean_ptr, var_ptr, bn_eps)
    x = _put(x, c, age, 2, FEATURES, mean_ptr, var_ptr, bn_eps)
    x = _put(x, c, norm, 3, FEATURES, mean_ptr, var_ptr, bn_eps)
    x = _put(x, c, key_norm, 4, FEATURES, mean_ptr, var_ptr, bn_eps)
    x = _put(x, c, prev, 5, FEATURES, mean_ptr, var_ptr, bn_eps)
    if TYPES:
        kind = tl.load(kind_ptr + b * sk_b + h * sk_h + s * sk_s, mask=inside, other=0.0)
        x = tl.where(c == 2 * FEATURES + tl.maximum(kind - 1.0, 0.0).to(tl.int32)[:, None], 1.0, x)
    k = tl.arange(0, BLOCK_P)
    projected = tl.load(proj_ptr + b * sp_b + h * sp_h + s[:, None] * sp_s + k[None, :] * sp_w,
                        mask=inside[:, None] & (k[None, :] < width), other=0.0).to(tl.float32)  # fmt: skip
    kx = tl.arange(0, BLOCK_X)
    bias_row = bias_ptr + (layer_index * n_kv_heads + h) * hidden
    products = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)
    for start in range(0, hidden, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        wp = wp_ptr + n[:, None] * BLOCK_P + k[None, :]
        wx = wx_ptr + n[:, None] * BLOCK_X + kx[None, :]
        z = tl.zeros([BLOCK_S, BLOCK_N], tl.float32) + tl.load(bias_row + n)[None, :]
        z = tl.dot(x, tl.trans(tl.load(wx + hidden * BLOCK_X)), z, input_precision="tf32")  # remainders first
        z = tl.dot(projected, tl.trans(tl.load(wp + hidden * BLOCK_P)), z, input_precision="tf32")
        z = tl.dot(x, tl.trans(tl.load(wx)), z, input_precision="tf32")
        z = tl.dot(projected, tl.trans(tl.load(wp)), z, input_precision="tf32")
        products += tl.maximum(z, 0.0) * tl.load(w2_ptr + n)[None, :]
    logit = tl.sum(products, 1) + tl.load(b2_ptr)
    tl.store(score_ptr + b * sz_b + h * sz_h + s * sz_s, tl.where(held, logit, float("-inf")), mask=inside)


@jit
def _put(x, c, value, feature: tl.constexpr, FEATURES: tl.constexpr, mean_ptr, var_ptr, bn_eps):
    """`x` with a scalar feature `[BLOCK_S]`, standardised, at columns `feature` (its TF32 part) and
    `FEATURES + feature` (the remainder)."""
    scale = tl.div_rn(1.0, tl.sqrt_rn(tl.load(var_ptr + feature) + bn_eps))
    high, low = _tf32_split((value - tl.load(mean_ptr + feature)) * scale)
    return tl.where(c == feature, high[:, None], tl.where(c == FEATURES + feature, low[:, None], x))


# the refresh kernel's tiles, tuned on an H200 at the 8B shape, see docs/results/kernel-notes.md
_REFRESH_CONFIG = {"BLOCK_S": 128, "BLOCK_N": 64, "num_warps": 8}


def refresh_scores_triton(mlp, layer_index, projected, hidden_norm, kind, received, keys, slot_pos, context, seen,
                          group_size, previous, sums, score) -> None:  # fmt: skip
    b, h, s = slot_pos.shape
    packed, norm = _packed(mlp), mlp.scalar_norm
    prev = previous if previous is not None else sums
    config = dict(_REFRESH_CONFIG)
    block_s = config.pop("BLOCK_S")
    grid = (b * h, triton.cdiv(s, block_s))
    _refresh_kernel[grid](
        projected, hidden_norm, kind, received, keys, slot_pos, context, seen, prev, sums, score,
        packed["projected"], packed["extra"], packed["bias"], packed["w2"], mlp.w2.bias, norm.running_mean,
        norm.running_var, h, s, keys.shape[-1], projected.shape[-1], packed["w2"].shape[0], float(group_size),
        norm.eps, layer_index,
        *projected.stride(), *hidden_norm.stride(), *kind.stride(), *received.stride(), *keys.stride(),
        *slot_pos.stride(), context.stride(0), prev.stride(0), prev.stride(1), sums.stride(0), sums.stride(1),
        *score.stride(),
        HAS_PREVIOUS=previous is not None, TYPES=mlp.types, FEATURES=len(SCALAR_FEATURES), BLOCK_S=block_s,
        BLOCK_P=packed["projected"].shape[-1], BLOCK_X=packed["extra"].shape[-1],
        BLOCK_D=min(32, triton.next_power_of_2(keys.shape[-1])), **config,
        **dependent_launch(keys, grid),
    )  # fmt: skip
