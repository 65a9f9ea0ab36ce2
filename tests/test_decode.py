"""The fast path (`atskv.generate`, atskv/runtime/fast/): the same tokens as the reference session,
static shapes and no host synchronisation in a decode step, and its pieces against references."""

from __future__ import annotations

import contextlib

import pytest
import torch

import atskv
import atskv.runtime.fast.compiled as fast_compiled
import atskv.runtime.fast.graph as fast_graph
import atskv.runtime.fast.loop as fast_loop
import atskv.runtime.fast.session as fast_session
from atskv.attention import (
    causal_attention_from,
    grouped_attention,
    masked_attention,
    masked_attention_lse,
    prefix_causal_attention,
    received_mass,
)
from atskv.eval.speed import spaced_profile
from atskv.runtime.fast.host_pages import HostRetrieval
from atskv.runtime.fast.session import causal_mass_from
from atskv.runtime.fast.static_cache import StaticSlotLayer
from atskv.runtime.reference.sparse import attach
from atskv.runtime.vllm.learned import WITHOUT
from atskv.selectors.hybrid import HybridSelector
from atskv.selectors.learned import LearnedSelector
from atskv.selectors.sparcas import SparCasSelector
from tests.conftest import left_padded, random_prompt, tiny_model

CASES = [
    ("dense", 0.5), ("oracle", 8), ("quest", 16), ("sparq", 0.1), ("sparcas", 12),
    ("streaming_llm", 12), ("snapkv", 12), ("h2o", 0.1), ("spark", 12),
]  # fmt: skip
# SparCas on 4 of the 16 dimensions, refreshed on decode steps 4 and 8 of a 10-token run
OPTIONS = {"sparcas": {"dims": 4, "refresh_every": 4}}
# logits of `_random_predictor` (within ~0.3 of 0, by layer) at which the learned selector drops most
# tokens of some layers and KV heads (see `_assert_a_threshold_dropped_tokens`)
THRESHOLD = {"llama": -0.12, "gemma3": -0.15}


def _selector(name: str):
    return atskv.make_selector(name, **OPTIONS.get(name, {}))


def _reference(model, ids, selector, budget, new, mask=None):
    with torch.no_grad(), atskv.sparse(model, selector, budget, dense_layers=1):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


# every selector on a global-attention family and on Gemma 3 (sliding-window layers); three on the rest
GRID = [(f, *c) for f in ("llama", "gemma3") for c in CASES] + [
    (f, *c) for f in ("mistral", "qwen2", "qwen3") for c in CASES if c[0] in ("dense", "quest", "h2o")
]


@pytest.mark.parametrize("family,selector,budget", GRID)
def test_fast_generate_gives_the_reference_tokens(family, selector, budget):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None  # the reference would stop at EOS, the fast loop runs on
    ids = random_prompt(130, seed=1)  # three prompt chunks of 64 (the first a short one)
    fast = atskv.generate(model, ids, _selector(selector), budget, max_new_tokens=10, dense_layers=1,
                          prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, _reference(model, ids, _selector(selector), budget, 10))


@pytest.mark.parametrize(
    "selector,budget", [c for c in CASES if c[0] in ("dense", "quest", "sparq", "sparcas", "snapkv", "h2o", "spark")]
)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fast_generate_of_a_left_padded_batch(family, selector, budget):
    model, ids, mask = left_padded(family, 150, 30, seed=2)
    fast = atskv.generate(model, ids, _selector(selector), budget, attention_mask=mask, max_new_tokens=10,
                          dense_layers=1, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, _reference(model, ids, _selector(selector), budget, 10, mask))


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["snapkv", "h2o"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_left_padded_batch_on_the_gpu_gives_the_reference_tokens(family, selector):
    """An evicting selector prefills a padded row alone from its first real token: on CUDA that is
    the flash call on a query slice and the received-mass kernel on views (float32: no rounding)."""
    model, ids, mask = left_padded(family, 150, 30, seed=2)
    model, ids, mask = model.cuda(), ids.cuda(), mask.cuda()
    budget = dict(CASES)[selector]
    fast = atskv.generate(model, ids, _selector(selector), budget, attention_mask=mask, max_new_tokens=10,
                          dense_layers=1, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, _reference(model, ids, _selector(selector), budget, 10, mask))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_quest_on_the_reference_path_gives_a_padded_row_its_tokens_alone(family):
    """A padded row's pages start at its first real token (20 pads: not a whole page), as they do
    when it runs alone."""
    model, ids, mask = left_padded(family, 150, 20, seed=2)
    batched = _reference(model, ids, _selector("quest"), 16, 10, mask)
    alone = _reference(model, ids[1:, 20:], _selector("quest"), 16, 10)
    assert torch.equal(batched[1, 20:], alone[0])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kascade_reuse_layers_read_their_anchors_picks_on_the_fast_path(family, padded):
    """Kascade's reuse layers take the top-k of the anchor layer before them in the same step; on
    the fast path by slot (every appending layer holds a token in the same slot), in a step whose
    shapes do not grow with the context: the reference's tokens, padded or not."""
    from atskv.selectors.kascade import compute_kascade_profile

    if padded:
        model, ids, mask = left_padded(family, 150, 30, seed=4)
    else:
        model, ids, mask = tiny_model(family), random_prompt(130, seed=4), None
    model.generation_config.eos_token_id = None
    windows = [random_prompt(48, seed=20 + i)[0] for i in range(2)]
    profile = compute_kascade_profile(model, windows, n_anchors=1, topk=6, sparse=atskv.sparse, queries=4,
                                      dense_layers=1, model_name=family)  # fmt: skip
    assert profile.head_map, "no reuse layer: the test would not cover the reuse"

    def make():
        return atskv.make_selector("kascade", profile=profile)

    fast = atskv.generate(model, ids, make(), 12, attention_mask=mask, max_new_tokens=10, dense_layers=1,
                          prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, _reference(model, ids, make(), 12, 10, mask))


@pytest.mark.parametrize(
    "base", ["oracle", "quest", "sparq", "sparcas", "streaming_llm", "h2o", "learned", "learned with a threshold"]
)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_spark_over_each_fast_base_gives_the_reference_tokens(monkeypatch, family, base, tmp_path):
    """SparK's pruned prompt keys, recovered into the cache after the prompt, under every base the
    fast path runs (SnapKV, its default, is in `CASES`): the base's own fast step, on those keys."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    ids = random_prompt(130, seed=6)
    threshold = base.endswith("threshold")
    base = base.split()[0]
    options = OPTIONS.get(base, {})
    if base == "learned":  # refreshing on steps 4 and 8
        managed = [2, 5] if family == "gemma3" else [1, 2, 3]
        options = {"predictor": _random_predictor(model, tmp_path, managed), "refresh_every": 4}
        if threshold:
            options["threshold"] = THRESHOLD[family]

    def make():
        return atskv.make_selector("spark", base=base, base_options=options)

    held = _held_around_evictions(monkeypatch)
    fast = atskv.generate(model, ids, make(), 16, max_new_tokens=10, dense_layers=1, prefill_chunk=64)
    if threshold:
        _assert_a_threshold_dropped_tokens(held, 16)
    assert torch.equal(fast, _reference(model, ids, make(), 16, 10))


@pytest.mark.parametrize(
    "selector",
    ["snapkv+sparq", "h2o+sparq", "streaming_llm+oracle", "h2o+oracle", "learned+sparq",
     "learned+sparq with a threshold"],
)  # fmt: skip
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fast_generate_of_a_hybrid_gives_the_reference_tokens(monkeypatch, family, selector, tmp_path):
    """Residency part evicting at its own budget (a cap, with a threshold), attention part choosing
    among the resident tokens; a left-padded batch."""
    model, ids, mask = left_padded(family, 130, 20, seed=1)
    options, threshold = {}, selector.endswith("threshold")
    selector = selector.split()[0]
    if selector.startswith("learned"):  # refreshing on steps 4 and 8 with a threshold
        managed = [2, 5] if family == "gemma3" else [1, 2, 3]
        options["learned"] = {"predictor": _random_predictor(model, tmp_path, managed)}
        if threshold:
            options["learned"] |= {"threshold": THRESHOLD[family], "refresh_every": 4}

    def make():
        return atskv.make_selector(selector, residency_budget=24, **options)

    held = _held_around_evictions(monkeypatch)
    fast = atskv.generate(model, ids, make(), 8, attention_mask=mask, max_new_tokens=10, dense_layers=1,
                          prefill_chunk=64)  # fmt: skip
    if threshold:
        _assert_a_threshold_dropped_tokens(held, 24)
    assert torch.equal(fast, _reference(model, ids, make(), 8, 10, mask))


@pytest.mark.parametrize(
    ("selector", "budget"), [("snapkv", 64), ("h2o+sparq", 0.3), ("learned+sparq with a threshold", 0.3)]
)
def test_fast_generate_with_a_budget_the_prompt_does_not_fill_gives_the_reference_tokens(
    monkeypatch, tmp_path, selector, budget
):
    """An evicting layer whose budget is above the prompt (an int budget, or a composition whose
    4x residency reaches the whole context) holds each new token until the budget is full: the
    prompt's slots alone would leave the new tokens nowhere to go but over the first slot."""
    model, ids, mask = left_padded("llama", 60, 10, seed=2)
    options, threshold = {}, selector.endswith("threshold")
    selector = selector.split()[0]
    if threshold:
        options["learned"] = {"predictor": _random_predictor(model, tmp_path, [1, 2, 3]),
                              "threshold": THRESHOLD["llama"], "refresh_every": 4}  # fmt: skip
    held = _held_around_evictions(monkeypatch)
    fast = atskv.generate(model, ids, atskv.make_selector(selector, **options), budget,
                          attention_mask=mask, max_new_tokens=10, dense_layers=1, prefill_chunk=64)  # fmt: skip
    assert torch.equal(fast, _reference(model, ids, atskv.make_selector(selector, **options), budget, 10, mask))
    if threshold:
        _assert_a_threshold_dropped_tokens(held, 70)
    else:  # row 0 (60 prompt tokens) grew past its prompt: to 64 + the new token, or every one of its 69
        assert max(int(before[0].max()) for before, _ in held) == (65 if budget == 64 else 69)


@pytest.mark.parametrize("selector", ["h2o", "snapkv", "quest", "sparcas", "h2o+sparq", "learned with a threshold",
                                      "learned without the hidden state"])  # fmt: skip
def test_fast_generate_through_the_kernels_gives_the_reference_tokens(monkeypatch, tmp_path, selector):
    """The fast path as it runs on a GPU (its Triton kernels: decode write, eviction, attention
    with mass, Quest's pick, SparCas's partial logits, the learned selector's features and refresh;
    Triton's interpreter on the CPU), a left-padded batch, against the reference session in torch.
    "without the hidden state": the predictor the vLLM plugin can feed (no projection, norm or token
    type), refreshing only after the 5 steps, so its decode tokens' slots restart as they are written."""
    model, ids, mask = left_padded("llama", 100, 20, seed=3)
    budget = 0.2 if "+" not in selector else 12
    options = {"residency_budget": 24} if "+" in selector else OPTIONS.get(selector, {})
    if selector == "learned with a threshold":  # refreshing on steps 2 and 4 of the 5
        options = {"predictor": _random_predictor(model, tmp_path, [1, 2, 3]), "refresh_every": 2,
                   "threshold": THRESHOLD["llama"]}  # fmt: skip
        selector, budget = "learned", 24
    elif selector == "learned without the hidden state":
        predictor = _random_predictor(model, tmp_path, [1, 2, 3], reduced_width=0, without=WITHOUT)
        options, selector, budget = {"predictor": predictor, "refresh_every": 8}, "learned", 24
    expected = _reference(model, ids, atskv.make_selector(selector, **options), budget, 6, mask)
    monkeypatch.setenv("ATSKV_KERNELS", "triton")
    held = _held_around_evictions(monkeypatch)
    fast = atskv.generate(model, ids, atskv.make_selector(selector, **options), budget, attention_mask=mask,
                          max_new_tokens=6, dense_layers=1, prefill_chunk=64)  # fmt: skip
    if "threshold" in options:
        _assert_a_threshold_dropped_tokens(held, budget)
    assert torch.equal(fast, expected)


_CONVERSIONS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _no_host_reads():
    """Any tensor -> Python value (what forces a device sync on a GPU) raises inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"host read in a decode step: Tensor.{name}")

        return method

    try:
        for name in _CONVERSIONS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize(
    "selector",
    ["quest", "h2o", "learned", "learned with a threshold", "sparcas", "spark", "snapkv with a host tier",
     "learned with a threshold and a host tier"],
)  # fmt: skip
def test_a_decode_step_reads_nothing_back_to_the_host(monkeypatch, tmp_path, selector):
    steps = []
    plain_call = fast_graph.GraphedStep.__call__

    def guarded(self, variant=None):
        with _no_host_reads():
            out = plain_call(self, variant)
        steps.append(out.shape)
        return out

    monkeypatch.setattr(fast_graph.GraphedStep, "__call__", guarded)
    model = tiny_model("gemma3")  # sliding-window and global layers
    tier = HostRetrieval(tokens=32) if selector.endswith("host tier") else None
    threshold = THRESHOLD["gemma3"] if "threshold" in selector else None
    selector = selector.split()[0]
    if selector == "learned":  # refreshing on step 2 and 4 of the 4
        selector = LearnedSelector(predictor=_random_predictor(model, tmp_path, [2, 5]), refresh_every=2,
                                   threshold=threshold)  # fmt: skip
    if selector == "sparcas":  # refreshing on step 2 and 4 of the 4
        selector = SparCasSelector(dims=4, refresh_every=2)
    atskv.generate(model, random_prompt(100, seed=3), selector, 16, max_new_tokens=5, dense_layers=1,
                   prefill_chunk=64, tier=tier)  # fmt: skip
    assert len(steps) == 4


def test_the_planted_host_read_is_caught():
    with pytest.raises(AssertionError, match="host read"), _no_host_reads():
        bool(torch.ones(1))


def test_evicting_layers_shrink_to_budget_plus_one():
    model = tiny_model("llama")
    session = fast_session.StaticSession(model, atskv.make_selector("snapkv"), atskv.SparsityConfig(12, 1), 150, 4, 64)
    with attach(model, session), torch.no_grad():
        cache = session.new_cache()
        model(random_prompt(150), past_key_values=cache, use_cache=True)
        session.finish_prompt(None)
    assert [layer.keys.shape[2] for layer in cache.layers] == [192, 13, 13, 13]  # 154 in whole blocks of 64
    assert [int((layer.slot_pos >= 0).sum(-1).max()) for layer in cache.layers] == [150, 12, 12, 12]
    assert atskv.kv_bytes(cache) < 0.4 * 4 * cache.layers[0].keys.nbytes * 2


def test_finish_prompt_drops_padding_and_keeps_order():
    layer = StaticSlotLayer(capacity=8)
    k = torch.arange(6.0).view(1, 1, 6, 1).expand(2, 1, 6, 16).contiguous()
    layer.update(k, k)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    layer.finish_prompt(real)
    assert layer.slot_pos[1, 0].tolist() == [2, 3, 4, 5, -1, -1, -1, -1]
    assert layer.keys[1, 0, :4, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert layer.write_slot.tolist() == [[6], [4]] and layer.context.tolist() == [6, 4]


def test_a_token_tensor_is_held_once_per_token_until_the_heads_part_at_the_shrink():
    """While the prompt is held every KV head's slot i holds token i: a `token_tensor` is one
    `[B, 1, S, w]` copy through `finish_prompt` (padding dropped as for the keys), and `shrink`
    gives each head its own copy of the tokens it kept."""
    layer = StaticSlotLayer(capacity=8)
    k = torch.zeros(2, 3, 6, 4)
    layer.update(k, k)
    state = layer.token_tensor("t", width=2)
    assert state.shape == (2, 1, 8, 2)
    state[..., :6, 0] = torch.arange(6.0)  # the token's own value: its position
    layer.finish_prompt(torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], dtype=torch.bool))
    held = layer.slot_tensor("t", width=2)  # as held: still one copy
    assert held.shape == (2, 1, 8, 2) and held[1, 0, :4, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    drop = torch.zeros(2, 3, 8, dtype=torch.bool)
    drop[:, 0, 0] = drop[:, 1, 1] = drop[:, 2, 2] = True  # each head evicts another token
    layer.evict(drop)
    layer.shrink(5)
    held = layer.token_tensor("t", 2)
    assert held.shape == (2, 3, 5, 2) and layer.slot_tensor("t", width=2).data_ptr() == held.data_ptr()
    for b in range(2):
        for h in range(3):
            kept = layer.slot_pos[b, h] >= 0
            assert held[b, h, kept, 0].tolist() == layer.slot_pos[b, h, kept].float().tolist()
    kept_all = StaticSlotLayer(capacity=8)  # a layer that decodes without a shrink: each head its copy on first use
    kept_all.update(k, k)
    kept_all.token_tensor("t", width=2)[..., :6, 0] = torch.arange(6.0)
    kept_all.finish_prompt(None)
    own = kept_all.token_tensor("t", 2)
    assert own.shape == (2, 3, 8, 2) and own[:, :, :6, 0].tolist() == [[list(map(float, range(6)))] * 3] * 2


def test_a_window_layer_keeps_what_the_next_query_sees():
    layer = StaticSlotLayer(capacity=10, window=4)
    for start in (0, 6):
        k = torch.arange(start, start + 6.0).view(1, 1, 6, 1).expand(1, 1, 6, 16).contiguous()
        layer.update(k, k)
    layer.finish_prompt(None)
    assert layer.keys.shape[2] == 4 and sorted(layer.slot_pos[0, 0].tolist()) == [-1, 9, 10, 11]


def test_prefix_causal_attention_matches_masked_attention():
    torch.manual_seed(0)
    b, hq, hkv, s, c, d = 2, 4, 2, 40, 12, 16
    q, k, v = torch.randn(b, hq, c, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    out, lse = prefix_causal_attention(q, k, v, s - c, 0.25)
    mask = torch.arange(s).view(1, 1, 1, s) <= (torch.arange(s - c, s).view(1, 1, c, 1))
    ref, _ = grouped_attention(q, k, v, mask.expand(b, hkv, c, s), 0.25)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    logits = torch.einsum("bhgqd,bhsd->bhgqs", q.view(b, hkv, 2, c, d), k) * 0.25
    ref_lse = logits.masked_fill(~mask.unsqueeze(2), -torch.inf).logsumexp(-1).reshape(b, hq, c)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_masked_attention_and_received_mass_match_the_dense_reference():
    """Both masked paths (with the log-sum-exp, and SDPA's output alone) against the dense
    reference, over several query blocks; a query that may see nothing gets zeros."""
    torch.manual_seed(1)
    b, hq, hkv, s, d = 1, 4, 1, 30, 16
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    mask = (torch.arange(s).view(s, 1) >= torch.arange(s)) & (torch.arange(s).view(s, 1) - torch.arange(s) < 5)
    mask[7] = False

    def allowed(start, stop):
        return mask[start:stop].view(1, 1, stop - start, s)

    out, lse = masked_attention_lse(q, k, v, allowed, 0.25, max_elements=200)  # several query blocks
    ref, mass = grouped_attention(q, k, v, mask.expand(b, hkv, s, s), 0.25, want_mass=True)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(received_mass(q, k, lse, allowed, 0.25, max_elements=200), mass, atol=1e-5, rtol=1e-5)
    only = masked_attention(q, k, v, allowed, 0.25, max_elements=200)
    torch.testing.assert_close(only, out, atol=1e-5, rtol=1e-5)
    assert not only[:, :, 7].any() and not out[:, :, 7].any()

    def window(start, stop):  # the slots the block's queries can see at all
        return slice(max(0, start - 4), stop)

    for blocks in (200, 1 << 27):  # one query a block; one block of every query
        spanned, spanned_lse = masked_attention_lse(q, k, v, allowed, 0.25, window, max_elements=blocks)
        torch.testing.assert_close(spanned, out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(spanned_lse, lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(masked_attention(q, k, v, allowed, 0.25, window, max_elements=blocks), out,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("pad", [0, 5, 14, 20])  # none; inside the earlier slots; at the chunk; past it
def test_a_left_padded_rows_causal_part_matches_the_masked_path(pad):
    """A chunk of 6 queries over 20 slots whose first `pad` are padding: attention and received
    mass from the real part alone equal the masked path's (pad queries: zeros, no mass)."""
    torch.manual_seed(2)
    b, hq, hkv, s, c, d = 1, 4, 2, 20, 6, 16
    q, k, v = torch.randn(b, hq, c, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    position = torch.arange(s - c, s).view(c, 1)
    mask = (torch.arange(s) <= position) & (torch.arange(s) >= pad)

    def allowed(start, stop):
        return mask[start:stop].view(1, 1, stop - start, s)

    out, lse = masked_attention_lse(q, k, v, allowed, 0.25)
    first, start = min(c, max(0, pad - (s - c))), pad
    got, got_lse = causal_attention_from(q, k, v, first, start, 0.25)
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, lse, atol=1e-5, rtol=1e-5)
    mass = causal_mass_from(q, k, got_lse, first, start, 0.25)
    torch.testing.assert_close(mass, received_mass(q, k, lse, allowed, 0.25), atol=1e-5, rtol=1e-5)
    assert not mass[..., :pad].any() and (pad >= s or bool(mass[..., pad:].sum() > 0))
    # every 4th query, counted back from the chunk's last (queries 1 and 5 of 6), times 4
    sampled = causal_mass_from(q, k, got_lse, first, start, 0.25, sample=4)
    rows = torch.tensor([1, 5])

    def sampled_allowed(start, stop):
        return mask[rows[start:stop]].view(1, 1, stop - start, s)

    want = received_mass(q[:, :, rows], k, lse[:, :, rows], sampled_allowed, 0.25) * 4
    torch.testing.assert_close(sampled, want, atol=1e-5, rtol=1e-5)


def test_a_left_padded_batch_attends_row_by_row_as_the_masked_path_does():
    """Rows padded by 0, 5, 14 and 20 of 20 slots in one batch (what a keep-everything selector
    prefills whole): each row from its own first real token equals the batch under its mask, and
    the pads are read off the mask only when they all lead."""
    torch.manual_seed(3)
    pads = [0, 5, 14, 20]
    b, hq, hkv, s, c, d = len(pads), 4, 2, 20, 6, 16
    q, k, v = torch.randn(b, hq, c, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    real = torch.arange(s) >= torch.tensor(pads).view(-1, 1)  # [B, S]
    mask = (torch.arange(s) <= torch.arange(s - c, s).view(c, 1)) & real.view(b, 1, s)  # [B, C, S]

    def allowed(start, stop):
        return mask[:, start:stop].view(b, 1, stop - start, s)

    out, lse = masked_attention_lse(q, k, v, allowed, 0.25)
    assert fast_loop.left_padding(real) == pads
    parts = [(min(c, max(0, pad - (s - c))), pad) for pad in pads]
    per_row = fast_session._per_row
    got, got_lse = per_row(parts, lambda rows, part: causal_attention_from(q[rows], k[rows], v[rows], *part, 0.25))
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, lse, atol=1e-5, rtol=1e-5)
    mass = per_row(parts, lambda rows, part: causal_mass_from(q[rows], k[rows], got_lse[rows], *part, 0.25))
    torch.testing.assert_close(mass, received_mass(q, k, lse, allowed, 0.25), atol=1e-5, rtol=1e-5)
    inside = real.clone()
    inside[0, 3] = False  # a pad after a real token: no causal parts
    assert fast_loop.left_padding(inside) is None


def test_unsupported_selectors_and_chunks_are_refused():
    model = tiny_model("llama")
    ids = random_prompt(80)
    with pytest.raises(ValueError, match="no fast decode path"):  # the reference prunes at every (dense) step
        atskv.generate(model, ids, atskv.make_selector("spark", base="dense"), 16)
    # not as a composition's part (`Selector.fast_path_as_part`)
    spark_sparq = HybridSelector(atskv.make_selector("snapkv"), atskv.make_selector("spark", base="sparq"))
    for composed in ("snapkv+quest", "snapkv+sparcas", spark_sparq):
        with pytest.raises(ValueError, match="no fast decode path"):
            atskv.generate(model, ids, composed, 16)
    with pytest.raises(ValueError, match="prefill_chunk"):
        atskv.generate(model, ids, "dense", 16, prefill_chunk=8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "selector", ["dense", "quest", "snapkv", "h2o", "learned", "learned_threshold", "sparcas", "spark", "kascade"]
)
def test_graph_replay_gives_the_eager_tokens(tmp_path, selector):
    """Capture fails on any host sync, so a replayed graph is also the no-sync proof on a GPU;
    the learned selector's and SparCas's refresh steps are a second graph (with a threshold the
    refresh step also frees the unwanted tokens)."""
    model = tiny_model("gemma3").cuda().to(torch.bfloat16)
    ids = random_prompt(300, seed=4).cuda()

    def make():
        if selector == "sparcas":
            return SparCasSelector(dims=4, refresh_every=4)
        if selector == "kascade":  # global layers 2 (anchor) and 5 (reuse), past generate's 2 dense ones
            return atskv.make_selector("kascade", profile=spaced_profile(model, 2, anchors=1))
        if not selector.startswith("learned"):
            return selector
        threshold = THRESHOLD["gemma3"] if selector == "learned_threshold" else None
        return LearnedSelector(predictor=_random_predictor(model, tmp_path, [2, 5]), refresh_every=4,
                               threshold=threshold)  # fmt: skip

    eager = atskv.generate(model, ids, make(), 32, max_new_tokens=16, cuda_graph=False)
    graphed = atskv.generate(model, ids, make(), 32, max_new_tokens=16, cuda_graph=True)
    assert torch.equal(eager, graphed)


def _random_predictor(model, folder, managed, reduced_width: int = 8, without=()):
    from atskv.features import SCALAR_FEATURES
    from atskv.models.geometry import model_geometry
    from atskv.predictor.export import export_predictor
    from atskv.predictor.model import FeatureSpec, RelevanceMLP

    torch.manual_seed(1)
    spec = FeatureSpec(model.config.hidden_size, SCALAR_FEATURES, len(managed), model.config.num_key_value_heads)
    types = torch.randint(0, spec.num_token_types, (model.config.vocab_size,), dtype=torch.int8)
    mlp = RelevanceMLP(spec, reduced_width=reduced_width, hidden=16, without=list(without)).eval()
    export_predictor(mlp, types, folder, base_model="tiny", geometry=model_geometry(model.config),
                     managed_layers=managed)  # fmt: skip
    return folder


def _prompt_mass(monkeypatch, cls) -> list[float]:
    """Filled as a runtime prefills: the mass each prompt chunk of several queries gave `cls`'s
    selector, summed over the rows, KV heads and slots."""
    totals, plain = [], cls.observe

    def recording(self, view, attention_mass):
        if view.query.shape[2] > 1:
            totals.append(float(attention_mass.sum()))
        return plain(self, view, attention_mass)

    monkeypatch.setattr(cls, "observe", recording)
    return totals


@pytest.mark.parametrize("padded", [False, True, "hole"])
@pytest.mark.parametrize("selector", ["h2o", "learned"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_prompt_scored_from_every_8th_query_gives_the_reference_tokens(monkeypatch, tmp_path, family, selector,
                                                                         padded):  # fmt: skip
    """`prompt_sample` 8: each prompt chunk's mass from every 8th query counted back from its last,
    times 8. The fast path's chunks of 64 (2, 64, 64 tokens; a padded row's from its first real
    token) and the reference's one of 130 then sample the same 17 queries, so the two give the
    same tokens, and the prompt's mass totals 8 x 17 per query head and managed layer where every
    query would give 130 (a padded row's first 20 queries see nothing: 14 of its 17 count). "hole":
    pads inside the row (the fast path's masked prompt chunks), which give nothing: 15 of 17."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    managed = [1, 2, 3] if family == "llama" else [2, 5]
    ids, mask = random_prompt(130, seed=6, batch=2 if padded is True else 1), None
    if padded is True:
        mask = torch.ones_like(ids)
        mask[1, :20] = 0
    elif padded == "hole":  # the sampled queries at 41 and 49 among the pads
        mask = torch.ones_like(ids)
        mask[0, 40:52] = 0
    if selector == "learned":
        options, budget, cls = {"predictor": _random_predictor(model, tmp_path, managed)}, 24, LearnedSelector
    else:
        options, budget, cls = {}, 0.1, type(atskv.make_selector("h2o"))
    totals = _prompt_mass(monkeypatch, cls)
    fast = atskv.generate(model, ids, atskv.make_selector(selector, prompt_sample=8, **options), budget,
                          attention_mask=mask, max_new_tokens=10, dense_layers=1, prefill_chunk=64)  # fmt: skip
    fast_total, totals[:] = sum(totals), []
    with torch.no_grad(), atskv.sparse(model, atskv.make_selector(selector, prompt_sample=8, **options), budget,
                                       dense_layers=1):  # fmt: skip
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(fast, reference)
    sampled = {False: 17, True: 17 + 14, "hole": 15}[padded]
    layers = len(totals)  # the reference: one chunk a managed layer
    want = 8 * sampled * model.config.num_attention_heads * layers
    assert fast_total == pytest.approx(want, rel=1e-4) and sum(totals) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize(
    "family,padded,threshold",
    [("llama", False, False), ("llama", True, False), ("gemma3", False, False), ("llama", False, True),
     ("llama", True, True), ("gemma3", True, True), ("llama", True, "window"), ("gemma3", False, "window")],
)  # fmt: skip
def test_the_learned_selector_on_the_fast_path_gives_the_reference_tokens(monkeypatch, tmp_path, family, padded,
                                                                          threshold):  # fmt: skip
    """With a threshold the budget is a cap: rows hold different amounts, under the budget, and a
    refresh drops several tokens in one step. "window": half the budget pinned to the prompt
    tokens its last queries attend most (`window_share`)."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    managed = [1, 2, 3] if family == "llama" else [2, 5]
    predictor = _random_predictor(model, tmp_path, managed)
    ids, mask = random_prompt(130, seed=5, batch=2 if padded else 1), None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :20] = 0
    options = {"window_share": 0.5} if threshold == "window" else {"threshold": THRESHOLD[family]} if threshold else {}

    def selector():  # refreshes on steps 4 and 8 of the 10
        return LearnedSelector(predictor=predictor, refresh_every=4, **options)

    held = _held_around_evictions(monkeypatch)
    fast = atskv.generate(model, ids, selector(), 24, attention_mask=mask, max_new_tokens=10, dense_layers=1,
                          prefill_chunk=64)  # fmt: skip
    with torch.no_grad(), atskv.sparse(model, selector(), 24, dense_layers=1):
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    if threshold is True:
        _assert_a_threshold_dropped_tokens(held, 24)
    assert torch.equal(fast, reference)


def _held_around_evictions(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Filled as the fast path runs: each decode eviction's held slots per (row, KV head) `[B, Hkv]`,
    before it (the new token included) and after it."""
    held = []
    plain = fast_session.evict_lowest

    def counting(scores, slot_pos, *args):
        before = (slot_pos >= 0).sum(-1)
        freed = plain(scores, slot_pos, *args)
        held.append((before, (slot_pos >= 0).sum(-1)))
        return freed

    monkeypatch.setattr(fast_session, "evict_lowest", counting)
    return held


def _assert_a_threshold_dropped_tokens(held: list[tuple[torch.Tensor, torch.Tensor]], budget: int) -> None:
    """The tests of a threshold cannot pass vacuously: some decode step dropped several tokens of a
    row at once (only unwanted ones can: the budget drops one), and rows end the run under budget.
    (A row that drops every token, its new one included, reads zeros on both paths.)"""
    assert any(bool((before - after >= 2).any()) for before, after in held), "no decode step dropped unwanted tokens"
    last = torch.stack([after for _, after in held[-8:]])  # the last few steps' layers
    assert bool((last < budget).any()), "every row holds its whole budget"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_host_tier_parks_what_a_threshold_drops(monkeypatch, tmp_path, family):
    """Each token the threshold drops (several at once after a refresh) is flagged parked: the
    host's residency flags are the GPU's slots, and reading every parked page back gives dense
    attention's tokens; a left-padded batch."""
    model, ids, mask = left_padded(family, 150, 30, seed=2)
    run = dict(attention_mask=mask, max_new_tokens=12, dense_layers=1, prefill_chunk=64)
    dense = atskv.generate(model, ids, "dense", 0.5, **run)
    managed = [2, 5] if family == "gemma3" else [1, 2, 3]
    selector = LearnedSelector(predictor=_random_predictor(model, tmp_path, managed), refresh_every=4,
                               threshold=THRESHOLD[family])  # fmt: skip
    held, sessions = _held_around_evictions(monkeypatch), []
    plain_attach = fast_loop.attach

    def attach_and_keep(model, session):
        sessions.append(session)
        return plain_attach(model, session)

    monkeypatch.setattr(fast_loop, "attach", attach_and_keep)
    tiered = atskv.generate(model, ids, selector, 24, tier=HostRetrieval(tokens=10_000), **run)
    _assert_a_threshold_dropped_tokens(held, 24)
    session = sessions[0]
    for idx, host in session.hosts.items():
        slot_pos = session.cache.layers[idx].slot_pos
        index = torch.where(slot_pos >= 0, slot_pos - host.offset, host.resident.shape[-1] - 1)  # free: the sink
        on_gpu = torch.zeros_like(host.resident).scatter_(2, index, True)
        assert torch.equal(host.resident[..., :-1], on_gpu[..., :-1]), f"layer {idx}: parked flags"
    assert torch.equal(tiered, dense)


def test_an_evicting_selector_prefills_a_batch_one_row_at_a_time(monkeypatch):
    """Each row's prompt is compressed before the next is read, so the prompt KV of one row, not
    of the batch, is the prefill's peak: what lets a compressed cache serve a larger batch."""
    rows = []
    plain_prefill = fast_loop._prefill

    def counting(model, session, ids, *args):
        rows.append(ids.shape[0])
        return plain_prefill(model, session, ids, *args)

    monkeypatch.setattr(fast_loop, "_prefill", counting)
    model = tiny_model("llama")
    atskv.generate(model, random_prompt(80, batch=3), "snapkv", 16, max_new_tokens=2, prefill_chunk=64)
    atskv.generate(model, random_prompt(80, batch=3), "quest", 16, max_new_tokens=2, prefill_chunk=64)
    assert rows == [1, 1, 1, 3]


@pytest.mark.parametrize("family,selector", [("llama", "snapkv"), ("gemma3", "quest")])
def test_compiled_layers_give_the_eager_tokens(family, selector):
    """`compile=True` fuses the model's own per-layer work; atskv's attention and cache write stay
    eager (graph breaks), and in float32 the tokens stay the eager ones."""
    from torch._dynamo.utils import counters

    model = tiny_model(family)
    ids = random_prompt(130, seed=2)
    eager = atskv.generate(model, ids, selector, 16, max_new_tokens=6, dense_layers=1, prefill_chunk=64)
    counters.clear()
    compiled = atskv.generate(model, ids, selector, 16, max_new_tokens=6, dense_layers=1, prefill_chunk=64,
                              compile=True)  # fmt: skip
    assert counters["stats"]["unique_graphs"] > 0  # something was compiled
    assert torch.equal(compiled, eager)
    assert all("forward" not in layer.__dict__ for layer in fast_compiled.decoder_layers(model))  # restored


def test_pads_inside_a_row_give_the_reference_prompt_mass(monkeypatch):
    """A row whose mask has a hole (the fast path's masked prompt chunks): H2O's prompt mass, layer
    by layer, as the reference hook gives it. A pad query sees nothing in either runtime, so gives
    no mass (before, both let it see the real tokens before it, at rotary positions the two place
    apart: up to 1e-2 a slot off), and the mass totals the real queries' alone."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = random_prompt(130, seed=6)
    mask = torch.ones_like(ids)
    mask[0, 40:52] = 0
    cls, seen = type(atskv.make_selector("h2o")), []
    plain = cls.observe

    def recording(self, view, mass):
        if view.query.shape[2] > 1:
            seen.append(mass[..., :130].clone())
        return plain(self, view, mass)

    monkeypatch.setattr(cls, "observe", recording)
    atskv.generate(model, ids, atskv.make_selector("h2o"), 0.1, attention_mask=mask, max_new_tokens=1,
                   dense_layers=1, prefill_chunk=256)  # fmt: skip
    fast = list(seen)
    seen.clear()
    with torch.no_grad(), atskv.sparse(model, atskv.make_selector("h2o"), 0.1, dense_layers=1):
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    assert len(fast) == len(seen) == 3
    for got, want in zip(fast, seen):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert float(got.sum()) == pytest.approx((130 - 12) * model.config.num_attention_heads, rel=1e-5)
