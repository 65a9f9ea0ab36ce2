"""The grouped (un-expanded KV) attention paths against an explicit repeat_kv reference."""

import pytest
import torch

from atskv.attention import StreamedAttention, grouped_attention, grouped_probs, sdpa_attention


def reference(query, keys, values, mask, scaling):
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1)
    v = values.repeat_interleave(group, 1)
    m = mask.repeat_interleave(group, 1)
    logits = (query @ k.transpose(-1, -2) * scaling).masked_fill(~m, float("-inf"))
    probs = logits.softmax(-1).nan_to_num(0.0)  # a query with no slot reads nothing
    mass = probs.view(keys.shape[0], keys.shape[1], group, *probs.shape[2:]).sum(dim=(2, 3))
    return (probs @ v).transpose(1, 2), mass


@pytest.mark.parametrize(("hq", "hkv", "tq"), [(4, 1, 1), (9, 3, 1), (8, 2, 37)])
def test_grouped_paths_match_reference(hq, hkv, tq):
    g = torch.Generator().manual_seed(hq * 100 + tq)
    b, s, d = 2, 50, 16
    query = torch.randn(b, hq, tq, d, generator=g)
    keys = torch.randn(b, hkv, s, d, generator=g)
    values = torch.randn(b, hkv, s, d, generator=g)
    mask = torch.rand(b, hkv, tq, s, generator=g) < 0.3  # a different set per KV head
    mask[..., 0] = True  # every row has at least one slot
    expected, expected_mass = reference(query, keys, values, mask, 0.25)
    out, mass = grouped_attention(query, keys, values, mask, 0.25, want_mass=True, query_chunk=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass, expected_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdpa_attention(query, keys, values, mask, 0.25), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hkv", [1, 2])
def test_rows_without_any_slot_give_zeros_and_the_others_are_unchanged(hkv):
    """A query that may attend nothing (a pad query, or one whose selector wants no token at all)
    reads zeros and gives no mass, as the sparse decode kernel and the streamed attention do, not
    an average over slots it may not see; a row with slots is as before."""
    g = torch.Generator().manual_seed(hkv)
    b, hq, tq, s, d = 2, 4, 3, 5, 8
    query = torch.randn(b, hq, tq, d, generator=g)
    keys, values = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    mask = torch.zeros(b, hkv, tq, s, dtype=torch.bool)
    mask[:, :, 1, :2] = True
    mask[1, -1, 2, 3] = True  # query 2 has a slot in one row's last KV head only
    expected, expected_mass = reference(query, keys, values, mask, 1.0)
    assert bool((expected == 0).any(-1).all(-1).any()), "some query heads read nothing"
    out, mass = grouped_attention(query, keys, values, mask, 1.0, want_mass=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass, expected_mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sdpa_attention(query, keys, values, mask, 1.0), expected, rtol=1e-5, atol=1e-6)
    totals = grouped_probs(query, keys, mask, 1.0).sum(-1)  # [B, Hkv, G, Tq]
    torch.testing.assert_close(totals, mask.any(-1).unsqueeze(2).float().expand_as(totals))


@pytest.mark.parametrize(("hq", "hkv", "tq"), [(4, 1, 1), (9, 3, 2)])
def test_streamed_attention_matches_reference_over_any_split(hq, hkv, tq):
    """Blocks of uneven sizes, one of them with no allowed slot at all, one a single slot: the
    streamed softmax must equal attention over the concatenation, masses included."""
    g = torch.Generator().manual_seed(hq + tq)
    b, s, d = 2, 60, 16
    query = torch.randn(b, hq, tq, d, generator=g)
    keys = torch.randn(b, hkv, s, d, generator=g) * 3  # large logits: the running max matters
    values = torch.randn(b, hkv, s, d, generator=g)
    mask = torch.rand(b, hkv, tq, s, generator=g) < 0.5
    mask[..., 40:52] = False  # block 3 is empty
    mask[..., 0] = True
    expected, expected_mass = reference(query, keys, values, mask, 0.25)
    cuts = [0, 17, 40, 52, 53, 60]
    stream = StreamedAttention(query, 0.25)
    for i, j in zip(cuts, cuts[1:]):
        stream.add(keys[:, :, i:j], values[:, :, i:j], mask[..., i:j])
    out, masses = stream.result()
    assert [m.shape[-1] for m in masses] == [17, 23, 12, 1, 7]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(masses, -1), expected_mass, rtol=1e-5, atol=1e-5)
    assert bool((masses[2] == 0).all())
    group = hq // hkv
    logits = (query.view(b, hkv, group, tq, d) @ keys.unsqueeze(2).transpose(-1, -2)) * 0.25
    expected_lse = logits.masked_fill(~mask.unsqueeze(2), -torch.inf).logsumexp(-1)
    torch.testing.assert_close(stream.log_normaliser(), expected_lse, rtol=1e-5, atol=1e-5)


def test_streamed_attention_without_any_slot_gives_zeros():
    query, keys, values = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    mask = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    stream = StreamedAttention(query, 1.0)
    stream.add(keys, values, mask)
    out, (mass,) = stream.result()
    assert bool((out == 0).all()) and bool((mass == 0).all())
    assert bool((stream.log_normaliser() == -torch.inf).all())
