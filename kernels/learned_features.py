"""The learned selector's two fast-path steps (`atskv.selectors.learned`) in one kernel each.

- `write_token_features`: a decode token's fixed features into the slot each KV head wrote it
  to: its hidden state's projection (RMS norm, then a linear map), the hidden state's norm and its
  token type. In torch that was ~10 small kernels per layer and step (~25 us at the Llama-3-8B
  shape, B=1), for a GEMV of 64 outputs.
- `refresh_scores`: every slot's scalar features (`atskv.predictor.features.SCALAR_FEATURES`)
  and the `RelevanceMLP` over them, every `refresh_every` steps. In torch that was ~50 kernels
  per layer, among them a float32 GEMM of ~60 us (32K context, 5%) whose `[slots, hidden]`
  activations then went through memory twice more (ReLU, W2); here each program holds a block of
  slots' activations in registers, one chunk of hidden units at a time. The type one-hot, layer
  and head embeddings enter as columns of W1 read directly (a gather and a bias); only the
  projected hidden state goes through `tl.dot`, with W1 split into a TF32 part and its remainder
  so the products stay float32-accurate (the scores decide evictions, which must match the
  reference path's).

Per-slot state is passed as `[B, Hkv, S]` views (any strides): `kind` holds 1 + the token's type,
0 for a slot no token has entered yet. The previous managed layer's attention reaches the next by
position, as `[B, 2, positions + 1]` sums over the KV heads holding each token: the attention,
then how many heads hold it.

Each has a plain-torch reference with the same contract; tests compare them on random inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from atskv.kernels.backend import jit, tl, triton, use_triton

from atskv.predictor.features import SCALAR_FEATURES, feature_columns


# --- a decode token's fixed features ----------------------------------------------------------
def write_token_features(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind) -> None:
    """In place, for every row b and KV head h, at slot `slots[b, h]`: `projected` `[B, Hkv, S, W]`
    gets `weight @ rms_norm(hidden[b]) + bias` (`weight` `[W, d_model]` float32, `bias` `[W]` or
    None; `hidden` `[B, d_model]`), `hidden_norm` `[B, Hkv, S]` gets `||hidden[b]||` and `kind`
    `[B, Hkv, S]` gets `1 + token_types[ids[b]]` (`token_types` `[vocab]` int8, `ids` `[B]`)."""
    if use_triton(hidden) and projected.dtype == torch.bfloat16:
        write_token_features_triton(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind)
    else:
        write_token_features_reference(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind)


def write_token_features_reference(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind):
    rows = F.linear(F.rms_norm(hidden.to(weight.dtype), (hidden.shape[-1],)), weight, bias)
    norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
    scatter_token_features(rows, norm, token_types[ids].float() + 1, slots, projected, hidden_norm, kind)


def scatter_token_features(rows, norm, kinds, slots, projected, hidden_norm, kind) -> None:
    """Each row's projection `rows` `[B, W]`, norm `[B]` and kind `[B]` into slot `slots[b, h]` of
    every KV head h (the torch step, also for scorers the kernel does not compute)."""
    b, h = slots.shape
    index = slots.view(b, h, 1)
    projected.scatter_(2, index.unsqueeze(-1).expand(b, h, 1, projected.shape[-1]),
                       rows.to(projected.dtype).view(b, 1, 1, -1).expand(b, h, 1, -1))  # fmt: skip
    hidden_norm.scatter_(2, index, norm.view(b, 1, 1).expand(b, h, 1).to(hidden_norm.dtype))
    kind.scatter_(2, index, kinds.view(b, 1, 1).expand(b, h, 1).to(kind.dtype))


@jit
def _bfloat16_bits(x):
    """float32 -> bfloat16 bits rounded to nearest even, as torch rounds (Triton's interpreter
    truncates a cast; the bits are stored through an int16 view)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@jit
def _token_features_kernel(
    hidden_ptr, w_ptr, bias_ptr, types_ptr, ids_ptr, slot_ptr, proj_ptr, norm_ptr, kind_ptr,
    n_kv_heads, d_model, width, d_float, eps,
    sx_b, sx_d, sw_o, sw_i, si_b, ss_b, ss_h, sp_b, sp_h, sp_s, sp_w, sn_b, sn_h, sn_s, sk_b, sk_h, sk_s,
    HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One (row, block of projected columns): one walk over the hidden state gives its sum of
    squares and the raw products, scaled by the RMS norm at the end."""
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


def write_token_features_triton(weight, bias, hidden, token_types, ids, slots, projected, hidden_norm, kind):
    b, h = slots.shape
    width, d_model = weight.shape
    block_w = 4  # 16 programs per row at width 64: the weight's 1 MB (8B shape) is read by many SMs
    bits = projected.view(torch.int16)
    _token_features_kernel[(b, triton.cdiv(width, block_w))](
        hidden, weight, bias if bias is not None else weight, token_types, ids, slots, bits, hidden_norm, kind,
        h, d_model, width, float(d_model), torch.finfo(weight.dtype).eps,
        *hidden.stride(), *weight.stride(), ids.stride(0), *slots.stride(), *bits.stride(), *hidden_norm.stride(),
        *kind.stride(),
        HAS_BIAS=bias is not None, BLOCK_W=block_w, BLOCK_D=min(512, triton.next_power_of_2(d_model)),
        BLOCK_H=triton.next_power_of_2(h), num_warps=4,
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
    TF32 (a bfloat16 value) loses ~2^-20 of `w`, about what float32 accumulation does."""
    high = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return high, w - high


@jit
def _refresh_kernel(
    proj_ptr, norm_ptr, kind_ptr, recv_ptr, key_ptr, pos_ptr, ctx_ptr, seen_ptr, prev_ptr, sums_ptr, score_ptr,
    w1_ptr, b1_ptr, w2_ptr, b2_ptr, mean_ptr, var_ptr, layer_emb_ptr, head_emb_ptr,
    n_kv_heads, n_slots, head_dim, width, hidden, group_size, bn_eps, layer_index,
    col_attention, col_position, col_age, col_norm, col_key, col_prev, col_type, col_layer, col_head,
    sp_b, sp_h, sp_s, sp_w, sn_b, sn_h, sn_s, sk_b, sk_h, sk_s, sr_b, sr_h, sr_s,
    sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, sc_b, sv_b, sv_k, su_b, su_k, sz_b, sz_h, sz_s,
    sw1_n, sw1_k, sle_l, sle_k, she_h, she_k,
    HAS_PREVIOUS: tl.constexpr, TYPES: tl.constexpr, LAYER_DIM: tl.constexpr, HEAD_DIM_E: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One (row, KV head, block of slots): features, then the MLP one chunk of hidden units at a
    time."""
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
    d = tl.arange(0, BLOCK_D)
    key = tl.load(key_ptr + b * sx_b + h * sx_h + s[:, None] * sx_s + d[None, :] * sx_d,
                  mask=inside[:, None] & (d[None, :] < head_dim), other=0.0).to(tl.float32)  # fmt: skip
    key_norm = tl.sqrt_rn(tl.sum(key * key, 1))
    prev = tl.zeros([BLOCK_S], tl.float32)
    at = tl.maximum(raw, 0)
    if HAS_PREVIOUS:
        total = tl.load(prev_ptr + b * sv_b + at, mask=inside, other=0.0)
        heads = tl.load(prev_ptr + b * sv_b + sv_k + at, mask=inside, other=1.0)
        prev = tl.where(held, tl.div_rn(total, tl.maximum(heads, 1.0)), 0.0)
    tl.atomic_add(sums_ptr + b * su_b + at, attention, mask=held)
    tl.atomic_add(sums_ptr + b * su_b + su_k + at, tl.full([BLOCK_S], 1.0, tl.float32), mask=held)
    # standardised as `RelevanceMLP.scalar_norm` does (eval mode: its running statistics)
    attention = _standard(attention, 0, mean_ptr, var_ptr, bn_eps)
    position = _standard(position, 1, mean_ptr, var_ptr, bn_eps)
    age = _standard(age, 2, mean_ptr, var_ptr, bn_eps)
    norm = _standard(norm, 3, mean_ptr, var_ptr, bn_eps)
    key_norm = _standard(key_norm, 4, mean_ptr, var_ptr, bn_eps)
    prev = _standard(prev, 5, mean_ptr, var_ptr, bn_eps)
    # the MLP: W1 . [projected; standardised scalars; type one-hot; layer and head embeddings] + b1
    k = tl.arange(0, BLOCK_W)
    projected = tl.load(proj_ptr + b * sp_b + h * sp_h + s[:, None] * sp_s + k[None, :] * sp_w,
                        mask=inside[:, None] & (k[None, :] < width), other=0.0).to(tl.float32)  # fmt: skip
    kind = tl.load(kind_ptr + b * sk_b + h * sk_h + s * sk_s, mask=inside, other=0.0)
    type_col = col_type + tl.maximum(kind - 1.0, 0.0).to(tl.int64)
    le = tl.arange(0, BLOCK_L)
    layer_emb = tl.load(layer_emb_ptr + layer_index * sle_l + le * sle_k, mask=le < LAYER_DIM, other=0.0)
    he = tl.arange(0, BLOCK_E)
    head_emb = tl.load(head_emb_ptr + h * she_h + he * she_k, mask=he < HEAD_DIM_E, other=0.0)
    logit = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, hidden, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        row = w1_ptr + n * sw1_n
        w = tl.load(row[:, None] + k[None, :] * sw1_k, mask=n_ok[:, None] & (k[None, :] < width), other=0.0)
        high, low = _tf32_split(w)
        z = tl.dot(projected, tl.trans(low), input_precision="tf32")
        z = tl.dot(projected, tl.trans(high), z, input_precision="tf32")
        bias = tl.load(b1_ptr + n, mask=n_ok, other=0.0)
        bias += _embedded(row, n_ok, col_layer, layer_emb, le, LAYER_DIM, sw1_k)
        bias += _embedded(row, n_ok, col_head, head_emb, he, HEAD_DIM_E, sw1_k)
        z += bias[None, :]
        z = _add_column(z, attention, col_attention, row, n_ok, sw1_k)
        z = _add_column(z, position, col_position, row, n_ok, sw1_k)
        z = _add_column(z, age, col_age, row, n_ok, sw1_k)
        z = _add_column(z, norm, col_norm, row, n_ok, sw1_k)
        z = _add_column(z, key_norm, col_key, row, n_ok, sw1_k)
        z = _add_column(z, prev, col_prev, row, n_ok, sw1_k)
        if TYPES:
            z += tl.load(row[None, :] + type_col[:, None] * sw1_k, mask=inside[:, None] & n_ok[None, :], other=0.0)
        w2 = tl.load(w2_ptr + n, mask=n_ok, other=0.0)
        logit += tl.sum(tl.maximum(z, 0.0) * w2[None, :], 1)
    logit += tl.load(b2_ptr)
    tl.store(score_ptr + b * sz_b + h * sz_h + s * sz_s, tl.where(held, logit, float("-inf")), mask=inside)


@jit
def _embedded(row, n_ok, column, embedding, e, DIM: tl.constexpr, sw1_k):
    """An embedding's part of the pre-activation `[BLOCK_N]`: its W1 columns times it."""
    w = tl.load(row[:, None] + (column + e[None, :]) * sw1_k, mask=n_ok[:, None] & (e[None, :] < DIM), other=0.0)
    return tl.sum(w * embedding[None, :], 1)


@jit
def _standard(value, feature, mean_ptr, var_ptr, bn_eps):
    return (value - tl.load(mean_ptr + feature)) * tl.div_rn(1.0, tl.sqrt_rn(tl.load(var_ptr + feature) + bn_eps))


@jit
def _add_column(z, value, column, row, n_ok, sw1_k):
    """`z` plus a standardised scalar feature `[BLOCK_S]` times its W1 column (-1: not an input,
    `RelevanceMLP.without`)."""
    if column >= 0:
        z += value[:, None] * tl.load(row + column * sw1_k, mask=n_ok, other=0.0)[None, :]
    return z


def refresh_scores_triton(mlp, layer_index, projected, hidden_norm, kind, received, keys, slot_pos, context, seen,
                          group_size, previous, sums, score) -> None:  # fmt: skip
    b, h, s = slot_pos.shape
    width = projected.shape[-1]
    w1, w2 = mlp.w1.weight, mlp.w2.weight
    layers, heads = mlp.layer_embedding.weight, mlp.head_embedding.weight
    kept = [i for i, name in enumerate(mlp.spec.scalar_features) if name not in mlp.without]
    columns = [width + kept.index(i) if i in kept else -1 for i in range(len(SCALAR_FEATURES))]
    after = width + len(kept)  # the type one-hot's first column, then the embeddings'
    col_type, col_layer = after, after + (mlp.spec.num_token_types if mlp.types else 0)
    col_head = col_layer + layers.shape[1]
    norm = mlp.scalar_norm
    prev = previous if previous is not None else sums
    block_s = 64  # with 32 hidden units a chunk and 8 warps: ~190 registers, no spills (ptxas, sm_90)
    _refresh_kernel[(b * h, triton.cdiv(s, block_s))](
        projected, hidden_norm, kind, received, keys, slot_pos, context, seen, prev, sums, score,
        w1, mlp.w1.bias, w2.view(-1), mlp.w2.bias, norm.running_mean, norm.running_var, layers, heads,
        h, s, keys.shape[-1], width, w1.shape[0], float(group_size), norm.eps, layer_index,
        *columns, col_type, col_layer, col_head,
        *projected.stride(), *hidden_norm.stride(), *kind.stride(), *received.stride(), *keys.stride(),
        *slot_pos.stride(), context.stride(0), prev.stride(0), prev.stride(1), sums.stride(0), sums.stride(1),
        *score.stride(), w1.stride(0), w1.stride(1), *layers.stride(), *heads.stride(),
        HAS_PREVIOUS=previous is not None, TYPES=mlp.types, LAYER_DIM=layers.shape[1], HEAD_DIM_E=heads.shape[1],
        BLOCK_S=block_s, BLOCK_W=max(16, triton.next_power_of_2(width)),
        BLOCK_D=triton.next_power_of_2(keys.shape[-1]), BLOCK_N=32,
        BLOCK_L=max(2, triton.next_power_of_2(layers.shape[1])), BLOCK_E=max(2, triton.next_power_of_2(heads.shape[1])),
        num_warps=8,
    )  # fmt: skip
