"""Mass each slot receives from a causal prompt chunk: the torch reference against float64
probabilities and the hook's `received_mass` with the prefill's own causal `allowed`, the Triton
kernel (Triton's interpreter on CPU) against the reference."""

import pytest
import torch

from atskv.attention import grouped_attention, prefix_causal_attention, received_mass
from atskv.kernels.received_mass import (
    paged_received_mass,
    prefix_received_mass,
    prefix_received_mass_reference,
    prefix_received_mass_triton,
)

SMALL_BLOCKS = {"block_n": 32, "block_m": 16}  # several key and query blocks at test sizes
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernel tests run: compiled on a GPU


def make_chunk(b, hkv, group, d, tq, offset, spare, dtype=torch.float32, seed=0, device="cpu"):
    """A prompt chunk as `StaticSession.prompt_chunk` has it: keys a slot buffer of `offset + tq`
    held slots and `spare` free ones, the query a `[B, T, Hq, D]` tensor seen as `[B, Hq, T, D]`
    (strided, as the model passes it), and the natural-log log-sum-exp `prefix_causal_attention`
    returns for it."""
    g = torch.Generator().manual_seed(seed)
    slots = offset + tq + spare
    query = torch.randn(b, tq, hkv * group, d, generator=g).to(device, dtype).transpose(1, 2)
    keys = torch.randn(b, hkv, slots, d, generator=g).to(device, dtype)
    values = torch.randn(b, hkv, slots, d, generator=g).to(device, dtype)
    scaling = d**-0.5
    stop = offset + tq
    _, lse = prefix_causal_attention(query, keys[:, :, :stop], values[:, :, :stop], offset, scaling)
    return query, keys, lse, scaling


def float64_mass(query, keys, offset, scaling):
    """Softmax of every query head over the slots it sees (float64), summed over each KV head's
    group and the queries; `[B, Hkv, S]` with zeros past the chunk."""
    b, hq, tq, d = query.shape
    hkv, slots = keys.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(hq // hkv, 1)
    logits = torch.einsum("bhtd,bhsd->bhts", query.double(), k) * scaling
    sees = torch.arange(slots) <= offset + torch.arange(tq)[:, None]
    probs = logits.masked_fill(~sees, float("-inf")).softmax(-1)
    return probs.view(b, hkv, -1, tq, slots).sum(dim=(2, 3))


def slot_allowed(keys, offset, tq):
    """The `allowed` of `StaticSession.prompt_chunk` without a window or padding, from the slots'
    positions (slots `0 .. offset + tq - 1` hold positions in order)."""
    stop = offset + tq
    slot_pos = torch.arange(stop, device=keys.device).expand(keys.shape[0], keys.shape[1], stop)
    q_pos = torch.arange(offset, stop, device=keys.device)

    def allowed(start, end):
        qp = q_pos[start:end].view(1, 1, -1, 1)
        return (slot_pos[:, :1].unsqueeze(2) <= qp) & (slot_pos[:, :1].unsqueeze(2) >= 0)

    return allowed


@pytest.mark.parametrize(("group", "offset"), [(1, 0), (4, 0), (4, 37)])
def test_reference_is_the_prefills_received_mass(group, offset):
    query, keys, lse, scaling = make_chunk(2, 2, group, 64, tq=45, offset=offset, spare=19, seed=group + offset)
    out = prefix_received_mass_reference(query, keys, lse, offset, scaling)
    assert out.shape == keys.shape[:3] and out.dtype == torch.float32
    stop = offset + 45
    hook = received_mass(query, keys[:, :, :stop], lse, slot_allowed(keys, offset, 45), scaling)
    torch.testing.assert_close(out[..., :stop], hook, rtol=0, atol=0)
    assert (out[..., stop:] == 0).all()
    torch.testing.assert_close(out.double(), float64_mass(query, keys, offset, scaling), rtol=1e-5, atol=1e-5)
    # every query's probabilities sum to one: the mass of a KV head is its group's query count
    torch.testing.assert_close(out.sum(-1), torch.full(out.shape[:2], 45.0 * group), rtol=1e-5, atol=0)
    # as the whole chunk's attention over the mask gives it (offset 0: the chunk is the whole prompt)
    if offset == 0:
        mask = (torch.arange(keys.shape[2]) <= torch.arange(45)[:, None]).expand(2, 2, -1, -1)
        _, dense = grouped_attention(query, keys, keys, mask, scaling, want_mass=True)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("offset", [0, 37])
def test_triton_matches_reference_fp32(group, d, offset):
    # 45 queries: not a whole number of 16-query blocks; 19 free slots past the chunk
    query, keys, lse, scaling = make_chunk(
        2, 2, group, d, tq=45, offset=offset, spare=19, seed=d + offset, device=DEVICE
    )
    expected = prefix_received_mass_reference(query, keys, lse, offset, scaling)
    out = prefix_received_mass_triton(query, keys, lse, offset, scaling, **SMALL_BLOCKS)
    assert out.shape == keys.shape[:3] and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[..., offset + 45 :] == 0).all()


@pytest.mark.parametrize("stride", [1, 5])
def test_paged_keys_read_through_the_block_table_give_the_gathered_keys_mass(stride):
    """`paged_received_mass`: a request's keys scattered over a paged cache's blocks (vLLM's
    `[Hkv, num_slots, D]` slot view, blocks shuffled, its last one partly filled) give, through
    the kernel reading the block table, the reference's mass over the keys gathered in order."""
    hkv, group, d, block, tq, offset = 2, 3, 32, 16, 45, 62
    g = torch.Generator().manual_seed(stride)
    query, keys, lse, scaling = make_chunk(1, hkv, group, d, tq, offset, spare=0, seed=stride)
    length = offset + tq  # 107 positions: 6 full blocks and 11 of a seventh
    blocks = -(-length // block)
    table = torch.randperm(3 * blocks, generator=g)[:blocks].to(torch.int32)  # a row of a wider pool
    cache = torch.randn(3 * blocks, block, hkv, d, generator=g)  # vLLM's layout; the unused slots are noise
    position = torch.arange(length)
    cache[table[position // block].long(), position % block] = keys[0].transpose(0, 1)
    key_slots = cache.flatten(0, 1).transpose(0, 1)  # [Hkv, num_slots, D], strided as vLLM's slot view
    picked = slice((tq - 1) % stride, None, stride)
    args = (query[:, :, picked], lse[:, :, picked], offset + picked.start, scaling)
    want = prefix_received_mass_reference(args[0], keys, args[1], *args[2:], query_stride=stride)
    reference = paged_received_mass(args[0], key_slots, table, block, length, *args[1:], query_stride=stride)
    torch.testing.assert_close(reference, want, rtol=1e-6, atol=1e-6)
    on_device = [t.to(DEVICE) for t in (args[0], key_slots, table, args[1])]
    got = prefix_received_mass_triton(on_device[0], on_device[1].unsqueeze(0), on_device[3], *args[2:],
                                      query_stride=stride, table=(on_device[2], block, length), **SMALL_BLOCKS).cpu()
    assert got.shape == (1, hkv, length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize(("offset", "stride"), [(0, 1), (37, 1), (37, 3)])
def test_several_heads_a_step_give_the_mass_of_one_head_a_step(heads, offset, stride):
    """`heads_per_step`: each step's tile holds `block_m` queries of each of several heads of the
    group (the diagonal's masks, sampled queries and partial query blocks included), as the
    reference gives; a count that is no power of two dividing the group is refused."""
    query, keys, lse, scaling = make_chunk(2, 2, 4, 32, 44 * stride + 1, offset, spare=5, seed=heads, device=DEVICE)
    args = (query[:, :, ::stride], keys, lse[:, :, ::stride], offset, scaling)  # 45 queries, `stride` apart
    expected = prefix_received_mass_reference(*args, query_stride=stride)
    out = prefix_received_mass_triton(*args, query_stride=stride, heads_per_step=heads, **SMALL_BLOCKS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="heads_per_step"):
        prefix_received_mass_triton(*args, query_stride=stride, heads_per_step=3, **SMALL_BLOCKS)


def test_triton_on_views_that_start_past_a_rows_padding():
    """A left-padded row's real part (`causal_mass_from`): the queries from the first real one and
    the keys from the first real slot, views into the chunk's tensors, as the reference gives."""
    query, keys, lse, scaling = make_chunk(1, 2, 4, 64, tq=45, offset=37, spare=0, seed=5, device=DEVICE)
    first, start = 6, 40  # the chunk's first 6 queries and the first 40 slots are padding
    q, k, part_lse = query[:, :, first:], keys[:, :, start:], lse[:, :, first:]
    offset = k.shape[2] - q.shape[2]
    expected = prefix_received_mass_reference(q.contiguous(), k.contiguous(), part_lse.contiguous(), offset, scaling)
    out = prefix_received_mass_triton(q, k, part_lse, offset, scaling, **SMALL_BLOCKS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("block_n", "block_m"), [(16, 16), (32, 16), (16, 32)])
def test_triton_every_alignment_of_offset_and_blocks(block_n, block_m):
    """Every offset modulo the blocks: which query blocks the kernel skips, masks on the diagonal
    and sums without a mask depends on where the chunk starts against the key and query blocks."""
    for offset in range(34):
        query, keys, lse, scaling = make_chunk(1, 1, 2, 16, tq=21, offset=offset, spare=3, seed=offset, device=DEVICE)
        expected = prefix_received_mass_reference(query, keys, lse, offset, scaling)
        out = prefix_received_mass_triton(query, keys, lse, offset, scaling, block_n=block_n, block_m=block_m)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"offset {offset}: {m}")


@pytest.mark.parametrize(("d", "offset", "spare"), [(80, 21, 3), (256, 50, 40)])
def test_triton_other_head_dims(d, offset, spare):
    """A head dim that is not a power of two (padded in the kernel) and Gemma 3's 256."""
    query, keys, lse, scaling = make_chunk(2, 1, 4, d, tq=29, offset=offset, spare=spare, seed=d, device=DEVICE)
    expected = prefix_received_mass_reference(query, keys, lse, offset, scaling)
    torch.testing.assert_close(prefix_received_mass_triton(query, keys, lse, offset, scaling, **SMALL_BLOCKS),
                               expected, rtol=1e-5, atol=1e-5)  # fmt: skip


def test_dispatch_and_default_blocks(monkeypatch):
    """The public entry point runs the kernel when asked to (`ATSKV_KERNELS=triton`), with its
    default blocks (128 keys, 64 queries in bf16: several query blocks and a partial key block)."""
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    query, keys, lse, scaling = make_chunk(
        2, 2, 4, 128, tq=150, offset=70, spare=36, dtype=torch.bfloat16, seed=3, device=DEVICE
    )
    expected = prefix_received_mass_reference(query.float(), keys.float(), lse, 70, scaling)
    torch.testing.assert_close(prefix_received_mass(query, keys, lse, 70, scaling), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("ATSKV_KERNELS", "reference")
    assert torch.equal(prefix_received_mass(query, keys, lse, 70, scaling),
                       prefix_received_mass_reference(query, keys, lse, 70, scaling))  # fmt: skip


@pytest.mark.parametrize("offset", [0, 37])
def test_triton_bf16(offset):
    """bf16 inputs: the kernel's logits are float32 accumulations of exact bf16 products, so it
    matches the reference on the same values in float32; the reference in bf16 rounds its logits
    to bf16 before the exp, a few percent per probability."""
    query, keys, lse, scaling = make_chunk(
        2, 2, 4, 64, tq=45, offset=offset, spare=19, dtype=torch.bfloat16, device=DEVICE
    )
    out = prefix_received_mass_triton(query, keys, lse, offset, scaling, **SMALL_BLOCKS)
    expected = prefix_received_mass_reference(query.float(), keys.float(), lse, offset, scaling)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    rounded = prefix_received_mass_reference(query, keys, lse, offset, scaling)
    torch.testing.assert_close(out, rounded, rtol=0.1, atol=0.05)


def test_queries_that_saw_nothing_give_nothing():
    """A query whose log-sum-exp is -inf contributes no mass (as in `received_mass`), and the
    query and lse may be any strides."""
    query, keys, lse, scaling = make_chunk(2, 2, 2, 64, tq=40, offset=10, spare=5, device=DEVICE)
    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # strides (.., 1, Hq), as CPU flash returns it
    lse[0, 1, 3:30] = -torch.inf
    lse[1, :, :] = -torch.inf
    expected = prefix_received_mass_reference(query, keys, lse, 10, scaling)
    out = prefix_received_mass_triton(query, keys, lse, 10, scaling, **SMALL_BLOCKS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all() and out[0].sum() > 0


def test_rejects_bad_shapes():
    query, keys, lse, scaling = make_chunk(1, 2, 2, 64, tq=20, offset=10, spare=0)
    for fn in (prefix_received_mass_reference, prefix_received_mass_triton):
        with pytest.raises(ValueError, match="offset"):
            fn(query, keys, lse, 11, scaling)
        with pytest.raises(ValueError, match="lse"):
            fn(query, keys, lse[:, :, 1:], 10, scaling)
        with pytest.raises(ValueError, match="Hq % Hkv"):
            fn(query[:, :3], keys, lse[:, :3], 10, scaling)
        with pytest.raises(TypeError, match="dtype"):
            fn(query, keys.half(), lse, 10, scaling)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 12288])
def test_triton_on_gpu_at_realistic_sizes(offset):
    """The 8B shape's heads (32 on 8, D = 128, bf16) on a 2K chunk."""
    query, keys, lse, scaling = make_chunk(1, 8, 4, 128, tq=2048, offset=offset, spare=64, dtype=torch.bfloat16,
                                           seed=offset, device="cuda")  # fmt: skip
    expected = prefix_received_mass_reference(query.float(), keys.float(), lse, offset, scaling)
    torch.testing.assert_close(prefix_received_mass(query, keys, lse, offset, scaling), expected, rtol=1e-3, atol=1e-3)
    from atskv.kernels.received_mass import prefix_lse  # at its default blocks, the flash pass's lse

    torch.testing.assert_close(prefix_lse(query, keys, offset, scaling), lse.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_a_servers_chunks_compile_the_mass_kernel_once(monkeypatch):
    """Chunks as a server schedules them: other token counts, offsets and lengths, every 8th query
    sampled, their log-sum-exps a view into one buffer at any column (16-byte aligned or not).
    After the first, none compiles a variant of its own (one did inside a timed prefill on the
    H100, where vLLM's JIT monitor saw it)."""
    from triton import knobs

    from atskv.kernels.received_mass import prefix_received_mass_triton

    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw.get("fn")))
    for i, (tq, offset, column) in enumerate([(301, 0, 0), (250, 77, 3), (517, 1000, 5), (64, 33, 1)]):
        query, keys, own, scaling = make_chunk(1, 8, 4, 128, tq=tq, offset=offset, spare=5, dtype=torch.bfloat16,
                                               seed=i, device="cuda")  # fmt: skip
        buffer = torch.zeros(32, column + tq, device="cuda")  # FlashAttention's [Hq, tokens]: the request from `column`
        buffer[:, column:] = own[0]
        lse = buffer[:, column:].unsqueeze(0)
        first = (tq - 1) % 8
        prefix_received_mass_triton(query[:, :, first::8], keys, lse[:, :, first::8], offset + first, scaling,
                                    query_stride=8)  # fmt: skip
        torch.cuda.synchronize()
        if i == 0:
            compiled.clear()
    assert compiled == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, offset, tq", [(1, 0, 37), (3, 50, 37), (2, 130, 5), (4, 7, 64)])
def test_the_lse_kernel_matches_the_flash_pass(dtype, group, offset, tq):
    """`prefix_lse` (logits only) against the flash pass the vLLM plugin ran for the log-sum-exps
    (`prefix_causal_attention` with the keys as values); several key and query blocks, a chunk at
    the start and past it, GQA groups."""
    from atskv.kernels.received_mass import prefix_lse_reference, prefix_lse_triton

    g = torch.Generator().manual_seed(group * 100 + offset)
    hkv, d = 2, 32
    query = torch.randn(2, hkv * group, tq, d, generator=g).to(dtype)
    keys = torch.randn(2, hkv, offset + tq + 9, d, generator=g).to(dtype)  # spare slots past the chunk
    want = prefix_lse_reference(query, keys, offset, d**-0.5)
    got = prefix_lse_triton(query.to(DEVICE), keys.to(DEVICE), offset, d**-0.5, block_m=16, block_n=16)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=tolerance)
    assert got.shape == (2, hkv * group, tq) and got.dtype == torch.float32


@pytest.mark.parametrize("stride, first", [(3, 2), (8, 0), (8, 5), (40, 1)])
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_every_strideth_query_gives_what_those_queries_give(stride, first, kernel):
    """`query_stride`: a sample of a chunk's queries, every `stride`-th from its `first`, at their
    own positions: the mass is what exactly those queries give (float64), for the reference and,
    across key and query blocks that straddle the diagonal, the kernel."""
    b, hkv, group, d, tq, offset, spare = 2, 2, 3, 32, 150, 37, 9
    query, keys, lse, scaling = make_chunk(b, hkv, group, d, tq, offset, spare, seed=stride + first)
    picked = slice(first, None, stride)
    want = float64_mass(query, keys, offset, scaling)  # every query
    sees = torch.arange(keys.shape[2]) <= offset + torch.arange(tq)[:, None]
    k = keys.double().repeat_interleave(group, 1)
    probs = (torch.einsum("bhtd,bhsd->bhts", query.double(), k) * scaling).masked_fill(~sees, float("-inf")).softmax(-1)
    want = probs[:, :, picked].reshape(b, hkv, group, -1, keys.shape[2]).sum(dim=(2, 3))
    args = (query[:, :, picked], keys, lse[:, :, picked], offset + first, scaling)
    if kernel == "reference":
        got = prefix_received_mass_reference(*args, query_stride=stride)
    else:
        on_device = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]  # compiled where there is a GPU
        got = prefix_received_mass_triton(*on_device, query_stride=stride, **SMALL_BLOCKS).cpu()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    last = offset + first + (query[:, :, picked].shape[2] - 1) * stride  # the last sampled query's position
    with pytest.raises(ValueError, match="apart"):  # a sample reaching past the buffer's slots
        prefix_received_mass_reference(query[:, :, picked], keys[:, :, :last], lse[:, :, picked], offset + first,
                                       scaling, query_stride=stride)  # fmt: skip
