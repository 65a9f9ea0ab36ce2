"""Retrieval indexes of the passive tier (atskv/runtime/reference/retrieval.py), against direct references."""

from __future__ import annotations

import sys

import pytest
import torch

from atskv.runtime.reference.retrieval import ExactIndex, FaissIndex, KeyIndex, LSHIndex, make_index

B, H, G, D = 2, 3, 3, 16
INDEXES = [("lsh", {"rank": "collisions"}), ("lsh", {"rank": "hamming"}), ("faiss", {}), ("exact", {})]
INDEX_IDS = ["lsh-collisions", "lsh-hamming", "faiss", "exact"]


def random_entries(n: int, seed: int = 0, hole: float = 0.2):
    """Keys `[B, H, n, D]`, unique scattered positions per group with a fraction set to -1, queries."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, n, D, generator=g)
    positions = torch.stack([torch.randperm(10 * n, generator=g)[:n] for _ in range(B * H)]).view(B, H, n)
    positions[torch.rand(B, H, n, generator=g) < hole] = -1
    queries = torch.randn(B, H, G, D, generator=g)
    return keys, positions, queries


def brute_force(keys, positions, queries, n, offsets=None):
    """Positions of the top-n entries by max over the group's heads of q·k (minus the head's
    offset), -1 padded."""
    scores = torch.einsum("bhgd,bhnd->bhgn", queries, keys)
    if offsets is not None:
        scores = scores - offsets.unsqueeze(-1)
    scores = scores.amax(2).masked_fill(positions < 0, -torch.inf)
    best = scores.topk(min(n, scores.shape[-1]), dim=-1)
    found = torch.where(best.values > -torch.inf, positions.gather(-1, best.indices), -1)
    return torch.nn.functional.pad(found, (0, n - found.shape[-1]), value=-1)


def returned(result: torch.Tensor, row: int, head: int) -> set[int]:
    return {int(p) for p in result[row, head] if p >= 0}


def clustered(n: int, seed: int, clusters: int = 16):
    """Keys around random centres; the group's query heads near one of them."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(B, H, clusters, D, generator=g)
    pick = torch.randint(0, clusters, (B, H, n), generator=g)
    keys = centres.gather(2, pick[..., None].expand(B, H, n, D)) + 0.5 * torch.randn(B, H, n, D, generator=g)
    near = torch.randint(0, clusters, (B, H, 1), generator=g).expand(B, H, G)
    queries = centres.gather(2, near[..., None].expand(B, H, G, D)) + 0.5 * torch.randn(B, H, G, D, generator=g)
    return keys, torch.arange(n).expand(B, H, n).contiguous(), queries


# --- FAISS: exact -------------------------------------------------------------------------
def test_faiss_flat_is_the_brute_force_top_n():
    keys, positions, queries = random_entries(60)
    index = FaissIndex(D)
    index.add(keys, positions)
    for n in (1, 7, 60, 80):  # 80 > entries: padded with -1
        assert torch.equal(index.search(queries, n), brute_force(keys, positions, queries, n)), n


@pytest.mark.parametrize("cls", [FaissIndex, ExactIndex])
def test_exact_indexes_compare_heads_after_their_offsets(cls):
    keys, positions, queries = random_entries(60)
    queries[:, :, 0] *= 4  # head 0's logits dwarf the others': unshifted, it fills the list
    offsets = torch.randn(B, H, G) + torch.tensor([1000.0, 0.0, 0.0])  # head 0 drops out
    index = cls(D)
    index.add(keys, positions)
    for n in (5, 20):
        shifted = index.search(queries, n, offsets=offsets)
        assert torch.equal(shifted, brute_force(keys, positions, queries, n, offsets)), n
        assert not torch.equal(shifted, index.search(queries, n))


def test_exact_index_equals_faiss():
    keys, positions, queries = random_entries(80, seed=3)
    exact, flat = ExactIndex(D), FaissIndex(D)
    for index in (exact, flat):
        index.add(keys, positions)
        index.remove(positions[:, :, :10])
    assert torch.equal(exact.search(queries, 25), flat.search(queries, 25))


def test_faiss_takes_half_precision_keys_and_returns_on_its_device():
    keys, positions, queries = random_entries(20)
    index = FaissIndex(D, device="cpu")
    index.add(keys.bfloat16(), positions)
    result = index.search(queries.half(), 5)
    assert result.dtype == torch.long and result.device.type == "cpu"
    assert torch.equal(result, brute_force(keys.bfloat16().float(), positions, queries.half().float(), 5))


def test_faiss_missing_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        FaissIndex(D)


# --- LSH: the hashing and ranking rule ----------------------------------------------------
def test_lsh_codes_are_packed_sign_projections():
    index = LSHIndex(D, bits=5, tables=3, seed=1)
    vectors = torch.randn(7, D)
    signs = (vectors @ index.projection.T > 0).view(7, 3, 5)
    expected = sum(signs[..., j].long() << j for j in range(5))
    assert torch.equal(index.encode(vectors).long(), expected)
    for bits, dtype in ((8, torch.uint8), (9, torch.int16), (31, torch.int32), (62, torch.int64)):
        assert LSHIndex(D, bits=bits).code_dtype == dtype


def lsh_reference(index: LSHIndex, keys, positions, queries, n):
    """The documented ranking on unpacked sign bits, one group at a time."""
    out = torch.full((B, H, n), -1, dtype=torch.long)
    kbits = (keys @ index.projection.T > 0).view(B, H, -1, index.tables, index.bits)
    qbits = (queries @ index.projection.T > 0).view(B, H, G, index.tables, index.bits)
    for row in range(B):
        for head in range(H):
            ranked = []
            for i, pos in enumerate(positions[row, head].tolist()):
                if pos < 0:
                    continue
                same = qbits[row, head] == kbits[row, head, i]  # [G, L, b]
                agree, collide = same.sum((1, 2)), same.all(-1).sum(-1)
                if index.rank == "collisions":
                    best = max((int(c), int(a)) for c, a in zip(collide, agree) if c > 0) if collide.any() else None
                else:
                    best = (int(agree.max()),)
                if best is not None:
                    ranked.append((*best, pos))
            ranked.sort(reverse=True)  # recency (the larger position) breaks ties
            chosen = [r[-1] for r in ranked[:n]]
            out[row, head, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
    return out


@pytest.mark.parametrize("rank", ["collisions", "hamming"])
@pytest.mark.parametrize("bits,tables", [(2, 2), (8, 4)])
def test_lsh_search_follows_the_documented_ranking(rank, bits, tables):
    keys, positions, queries = random_entries(40, seed=3)
    index = LSHIndex(D, bits=bits, tables=tables, seed=2, rank=rank)
    index.add(keys, positions)
    for n in (1, 5, 40):
        assert torch.equal(index.search(queries, n), lsh_reference(index, keys, positions, queries, n)), n


@pytest.mark.parametrize("rank", ["collisions", "hamming"])
def test_lsh_finds_a_key_that_is_a_scaled_query(rank):
    keys, positions, queries = random_entries(200, seed=4, hole=0.0)
    keys[:, :, 17] = 3.0 * queries[:, :, 1]  # the true top-1 in every group: far above the random keys
    assert torch.equal(brute_force(keys, positions, queries, 1)[..., 0], positions[:, :, 17])
    index = LSHIndex(D, seed=5, rank=rank)
    index.add(keys, positions)
    assert torch.equal(index.search(queries, 1)[..., 0], positions[:, :, 17])


@pytest.mark.parametrize("rank", ["collisions", "hamming"])
def test_lsh_recall_on_clustered_keys_is_far_above_random(rank):
    n, total = 32, 1024

    def recall(tables: int) -> float:
        recalls = []
        for seed in range(3):
            keys, positions, queries = clustered(total, seed)
            index = LSHIndex(D, bits=8, tables=tables, seed=seed, rank=rank)
            index.add(keys, positions)
            found, truth = index.search(queries, n), brute_force(keys, positions, queries, n)
            recalls.append(float((found[..., :, None] == truth[..., None, :]).any(-1).float().mean()))
        return sum(recalls) / len(recalls)

    # measured recall@32 of 1024: 0.40 (collisions) / 0.39 (hamming) with 4 tables, 0.47 / 0.48 with
    # 16; random would be n/N ~ 0.03. The angular estimate caps it: the centres' norms differ.
    four = recall(4)
    assert four >= 0.35
    assert recall(16) > four


# --- the protocol, for every index --------------------------------------------------------
@pytest.fixture(params=INDEXES, ids=INDEX_IDS)
def index(request) -> KeyIndex:
    name, kwargs = request.param
    return make_index(name, head_dim=D, **kwargs)


def reference(index, keys, positions, queries, n):
    """What `index` must return for these entries: the brute-force top-n, or LSH's documented rule."""
    if isinstance(index, LSHIndex):
        return lsh_reference(index, keys, positions, queries, n)
    return brute_force(keys, positions, queries, n)


def test_protocol_and_accounting(index):
    assert isinstance(index, KeyIndex)
    keys, positions, queries = random_entries(30)
    assert len(index) == 0 and index.search(queries, 4).eq(-1).all()
    index.add(keys, positions)
    assert torch.equal(index.count(), (positions >= 0).sum(-1))
    assert len(index) == int((positions >= 0).sum()) and index.nbytes > 0


def test_minus_one_positions_are_ignored(index):
    keys, positions, queries = random_entries(30, hole=0.5)
    index.add(keys, positions)
    result = index.search(queries, 30)
    assert torch.equal(result, reference(index, keys, positions, queries, 30))
    for row in range(B):
        for head in range(H):
            assert returned(result, row, head) <= {int(p) for p in positions[row, head] if p >= 0}
            assert (result[row, head] >= 0).sum() == len(returned(result, row, head))  # no repeats


def test_fewer_entries_than_n_are_padded_with_minus_one(index):
    keys, positions, queries = random_entries(6, hole=0.0)
    index.add(keys, positions)
    result = index.search(queries, 10)
    assert result.shape == (B, H, 10) and result[..., 6:].eq(-1).all()
    assert torch.equal(result, reference(index, keys, positions, queries, 10))


def test_groups_are_independent(index):
    keys = torch.zeros(B, H, 1, D)
    positions = torch.full((B, H, 1), -1)
    keys[0, 1, 0], positions[0, 1, 0] = torch.ones(D), 42
    index.add(keys, positions)
    queries = torch.ones(B, H, G, D)  # would match the entry perfectly in any group
    result = index.search(queries, 3)
    assert returned(result, 0, 1) == {42}
    assert all(not returned(result, r, h) for r in range(B) for h in range(H) if (r, h) != (0, 1))
    assert index.count().tolist() == [[0, 1, 0], [0, 0, 0]]


def test_removed_positions_are_never_returned(index):
    keys, positions, queries = random_entries(40, hole=0.0)
    index.add(keys, positions)
    gone = positions.clone()
    gone[..., 1::2] = -1  # remove every other entry, a ragged -1 pattern per group is skipped
    index.remove(gone)
    kept = positions.masked_fill(gone >= 0, -1)
    assert torch.equal(index.count(), torch.full((B, H), 20))
    result = index.search(queries, 40)
    assert torch.equal(result, reference(index, keys, kept, queries, 40))
    for row in range(B):
        for head in range(H):
            assert not returned(result, row, head) & returned(gone, row, head)
    with pytest.raises(ValueError, match="not in the index"):
        index.remove(gone)  # removing an absent position is an error, and leaves the index as it was
    assert torch.equal(index.count(), torch.full((B, H), 20))


def test_adding_a_held_position_again_is_an_error(index):
    keys, positions, _ = random_entries(10, hole=0.0)
    index.add(keys, positions)
    with pytest.raises(ValueError, match="already holds"):
        index.add(keys[:, :, :1], positions[:, :, :1])
    with pytest.raises(ValueError, match="repeat"):
        index.add(keys[:, :, :2], torch.full((B, H, 2), 1000))
    assert torch.equal(index.count(), torch.full((B, H), 10))


def test_many_small_adds_and_removes(index):
    keys, positions, queries = random_entries(200, hole=0.1)
    for start in range(0, 200, 3):  # decode-time demotions, a few tokens at a time
        index.add(keys[:, :, start : start + 3], positions[:, :, start : start + 3])
    assert torch.equal(index.count(), (positions >= 0).sum(-1))
    index.remove(positions[:, :, :100])
    index.add(keys[:, :, :100], positions[:, :, :100])  # back again, into the freed slots
    assert torch.equal(index.count(), (positions >= 0).sum(-1))
    assert torch.equal(index.search(queries, 50), reference(index, keys, positions, queries, 50))


def whole_capacity(search):
    """`search` as it was before indexes kept `end`: every slot of the capacity scored."""

    def scan(index, *args, **kwargs):
        end, index.end = index.end, index.slot_pos.shape[-1]
        try:
            return search(index, *args, **kwargs)
        finally:
            index.end = end

    return scan


@pytest.mark.parametrize("cls", [LSHIndex, ExactIndex])
def test_a_search_below_end_returns_what_a_scan_of_the_capacity_did(cls):
    """Free slots below `end` and a capacity grown past it; half the keys repeat others, so
    scores tie and `ExactIndex` must keep `topk`'s order among them too."""
    index = cls(D)
    keys, positions, queries = random_entries(120, hole=0.0)
    keys[:, :, 60:] = keys[:, :, :60]
    index.add(keys[:, :, :100], positions[:, :, :100])
    index.remove(positions[:, :, :60])
    back = list(range(60)) + list(range(100, 120))  # 60 into the freed slots, 20 past the capacity
    index.add(keys[:, :, back], positions[:, :, back])
    index.remove(positions[:, :, 50:70])
    assert index.end == 120 < index.slot_pos.shape[-1]
    offsets = torch.randn(B, H, G)
    for n in (5, 40, 100, 150):
        for shift in (None, offsets):
            expected = whole_capacity(cls.search)(index, queries, n, shift)
            assert torch.equal(index.search(queries, n, shift), expected), (n, shift is None)


def test_lsh_storage_grows_geometrically_and_reuses_free_slots():
    index = LSHIndex(D, tables=4)
    keys, positions, _ = random_entries(300, hole=0.0)
    capacities = set()
    for t in range(300):
        index.add(keys[:, :, t : t + 1], positions[:, :, t : t + 1])
        capacities.add(index.slot_pos.shape[-1])
    assert len(capacities) <= 6 and max(capacities) < 600  # 16, 32, ..., 512: no reallocation per add
    index.remove(positions[:, :, :50])
    capacity = index.slot_pos.shape[-1]
    index.add(keys[:, :, :50], positions[:, :, :50])
    assert index.slot_pos.shape[-1] == capacity
    # 4 one-byte codes and an int64 position per slot, plus the projection; the keys take 4 * D bytes
    assert index.nbytes == B * H * capacity * (4 + 8) + index.projection.numel() * 4


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [({"bits": 0}, "bits"), ({"bits": 63}, "bits"), ({"tables": 0}, "tables"), ({"rank": "cosine"}, "rank")],
)
def test_lsh_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LSHIndex(D, **kwargs)


def test_bad_names_and_kinds():
    with pytest.raises(ValueError, match="lsh"):
        make_index("annoy", head_dim=D)
    with pytest.raises(ValueError, match="flat"):
        FaissIndex(D, kind="hnsw")


def test_bad_shapes_and_n(index):
    keys, positions, queries = random_entries(5)
    with pytest.raises(ValueError, match="keys must be"):
        index.add(keys[..., :8], positions)
    with pytest.raises(ValueError, match="positions must be"):
        index.add(keys, positions[..., :3])
    index.add(keys, positions)
    with pytest.raises(ValueError, match="queries must be"):
        index.search(queries[..., :8], 3)
    with pytest.raises(ValueError, match="n .* must be >= 1"):
        index.search(queries, 0)
    with pytest.raises(ValueError, match="rows, KV heads"):
        index.search(queries[:1], 3)
    with pytest.raises(ValueError, match="rows, KV heads"):
        index.add(keys[:, :2], positions[:, :2])


# --- CUDA ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rank", ["collisions", "hamming"])
def test_lsh_on_cuda_equals_lsh_on_cpu(rank):
    keys, positions, queries = random_entries(500, seed=7)
    cpu, cuda = LSHIndex(D, seed=3, rank=rank), LSHIndex(D, seed=3, rank=rank, device="cuda")
    for index in (cpu, cuda):
        index.add(keys[:, :, :300], positions[:, :, :300])
        index.remove(positions[:, :, :100])
        index.add(keys[:, :, 300:], positions[:, :, 300:])
    assert torch.equal(cuda.codes.cpu(), cpu.codes) and torch.equal(cuda.slot_pos.cpu(), cpu.slot_pos)
    for n in (1, 16, 500):
        assert torch.equal(cuda.search(queries.cuda(), n).cpu(), cpu.search(queries, n))
