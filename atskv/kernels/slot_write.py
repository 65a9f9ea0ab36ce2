"""A decode token's write into a static slot cache in one kernel: its key and value rows into the
slot each (row, KV head) chose, and the slot's position. Three `scatter_` calls did this before:
three launches for a few bytes, together longer than the step's attention at the 8B shape, 32K."""

from __future__ import annotations

from atskv.kernels.backend import dependent_launch, jit, tl, triton, use_triton, wait_for_inputs


def write_decode_token(keys, values, slot_pos, slots, new_keys, new_values, position) -> None:
    """`keys`/`values` `[B, Hkv, S, D]` get `new_keys`/`new_values` `[B, Hkv, 1, D]` at `slots`
    `[B, Hkv, 1]`, and `slot_pos` `[B, Hkv, S]` gets `position - 1` there (`position` `[1]`: the
    tokens written, this one already counted); in place."""
    if use_triton(keys) and values.shape[-1] == keys.shape[-1]:  # one kernel, one head dim
        write_decode_token_triton(keys, values, slot_pos, slots, new_keys, new_values, position)
    else:
        write_decode_token_reference(keys, values, slot_pos, slots, new_keys, new_values, position)


def write_decode_token_reference(keys, values, slot_pos, slots, new_keys, new_values, position) -> None:
    rows = slots.unsqueeze(-1)
    keys.scatter_(2, rows.expand(-1, -1, -1, keys.shape[-1]), new_keys)
    values.scatter_(2, rows.expand(-1, -1, -1, values.shape[-1]), new_values)
    slot_pos.scatter_(2, slots, (position - 1).expand(slots.shape))


@jit
def _write_kernel(
    k_ptr, v_ptr, pos_ptr, slot_ptr, nk_ptr, nv_ptr, position_ptr, n_kv_heads, head_dim,
    sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sp_b, sp_h, sp_s, ss_b, ss_h,
    snk_b, snk_h, snk_d, snv_b, snv_h, snv_d,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One (row, KV head)."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    h = bh % n_kv_heads
    slot = tl.load(slot_ptr + b * ss_b + h * ss_h).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < head_dim
    key = tl.load(nk_ptr + b * snk_b + h * snk_h + d * snk_d, mask=ok)
    value = tl.load(nv_ptr + b * snv_b + h * snv_h + d * snv_d, mask=ok)
    tl.store(k_ptr + b * sk_b + h * sk_h + slot * sk_s + d * sk_d, key, mask=ok)
    tl.store(v_ptr + b * sv_b + h * sv_h + slot * sv_s + d * sv_d, value, mask=ok)
    tl.store(pos_ptr + b * sp_b + h * sp_h + slot * sp_s, tl.load(position_ptr) - 1)


def write_decode_token_triton(keys, values, slot_pos, slots, new_keys, new_values, position) -> None:
    b, h, _, d = keys.shape
    grid = (b * h,)
    _write_kernel[grid](
        keys, values, slot_pos, slots, new_keys, new_values, position, h, d,
        *keys.stride(), *values.stride(), *slot_pos.stride(), slots.stride(0), slots.stride(1),
        new_keys.stride(0), new_keys.stride(1), new_keys.stride(3),
        new_values.stride(0), new_values.stride(1), new_values.stride(3),
        BLOCK_D=triton.next_power_of_2(d), num_warps=1, **dependent_launch(keys, grid),
    )  # fmt: skip
