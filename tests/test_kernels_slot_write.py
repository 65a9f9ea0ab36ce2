"""The decode write kernel (`atskv.kernels.slot_write`, Triton's interpreter on CPU) against its
torch reference, and the reference against what it promises."""

from __future__ import annotations

import pytest
import torch

from atskv.kernels.slot_write import write_decode_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_matches_reference_and_touches_only_the_chosen_slots(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 10, 16
    keys = torch.randn(b, h, s, d, generator=g).to(dtype)
    values = torch.randn(b, h, s, d, generator=g).to(dtype)
    slot_pos = torch.randint(-1, 50, (b, h, s), generator=g)
    slots = torch.randint(0, s, (b, h, 1), generator=g)
    new = torch.randn(b, h, 2, d, generator=g).to(dtype)[:, :, :1]  # a strided view, as a projection's
    new_values = torch.randn(b, h, 1, d, generator=g).to(dtype)
    position = torch.tensor([77])
    out = {}
    for choice in ("reference", "triton"):
        monkeypatch.setenv("ATSKV_KERNELS", choice)
        state = [t.clone() for t in (keys, values, slot_pos)]
        write_decode_token(*state, slots, new, new_values, position)
        out[choice] = state
    for r, t in zip(out["reference"], out["triton"]):
        assert torch.equal(r, t)
    k, v, pos = out["reference"]
    chosen = torch.zeros(b, h, s, dtype=torch.bool).scatter_(2, slots, True)
    assert torch.equal(k[chosen], new[:, :, 0].reshape(-1, d)) and torch.equal(v[chosen], new_values.reshape(-1, d))
    assert (pos[chosen] == 76).all() and torch.equal(pos[~chosen], slot_pos[~chosen])  # the counter counts it already
    assert torch.equal(k[~chosen], keys[~chosen])
