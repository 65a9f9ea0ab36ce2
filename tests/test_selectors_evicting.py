"""SnapKV's and H2O's per-token scores against direct computations from the model's own
attention probabilities (eager attention, `output_attentions=True`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import atskv
from atskv.errors import InputError
from tests.conftest import EVERY_TOKEN, random_prompt, tiny_model

T = 24


def eager_probs(model, ids) -> tuple[torch.Tensor, ...]:
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, output_attentions=True).attentions  # per layer [B, Hq, T, T]
    finally:
        model.set_attn_implementation("sdpa")


def per_kv_head(probs: torch.Tensor, hkv: int) -> torch.Tensor:
    """`[B, Hq, Tq, S]` -> summed over each KV group's query heads, `[B, Hkv, Tq, S]`."""
    b, hq, tq, s = probs.shape
    return probs.view(b, hkv, hq // hkv, tq, s).sum(2)


def test_snapkv_scores_are_pooled_window_votes():
    model = tiny_model("llama")
    ids = random_prompt(T, seed=5, batch=2)
    window, kernel = 8, 5
    selector = atskv.make_selector("snapkv", window=window, kernel=kernel)
    with atskv.sparse(model, selector, budget=EVERY_TOKEN, dense_layers=0) as s:
        with torch.no_grad():
            model(ids)
        scores = [s.cache.layers[i].slot_tensor("snapkv").clone() for i in range(model.config.num_hidden_layers)]
    hkv = model.config.num_key_value_heads
    for layer, probs in enumerate(eager_probs(model, ids)):
        votes = per_kv_head(probs, hkv)[:, :, -window:].sum(2)  # [B, Hkv, T]
        pooled = F.max_pool1d(votes.flatten(0, 1).unsqueeze(1), kernel, stride=1, padding=kernel // 2).view_as(votes)
        expected = pooled.clone()
        expected[..., -window:] = torch.inf  # the observation window itself is always kept
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-6)


def test_h2o_accumulates_the_attention_each_token_received():
    """After a dense prefill and one decode step that keeps everything, each token's H2O score is
    the attention it received from every query so far, summed over its KV group's heads."""
    model = tiny_model("qwen2")
    ids = random_prompt(T + 1, seed=6, batch=2)
    with atskv.sparse(model, "h2o", budget=EVERY_TOKEN, dense_layers=0) as s:
        with torch.no_grad():
            out = model(ids[:, :T], use_cache=True)
            model(ids[:, T:], past_key_values=out.past_key_values, use_cache=True)
        scores = [s.cache.layers[i].slot_tensor("h2o").clone() for i in range(model.config.num_hidden_layers)]
    hkv = model.config.num_key_value_heads
    for layer, probs in enumerate(eager_probs(model, ids)):
        expected = per_kv_head(probs, hkv).sum(2)  # every query (prompt + decode), [B, Hkv, T + 1]
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-5)


def test_a_prompt_sample_that_is_not_a_stride_is_refused_in_one_line(tmp_path):
    """`prompt_sample` (H2O's and the learned selector's) is an int >= 1, as the vLLM plugin's is;
    anything else is an `InputError` naming it, before a model runs."""
    for bad in (0, -2, 2.5, True, "8"):
        with pytest.raises(InputError, match="prompt_sample is a stride"):
            atskv.make_selector("h2o", prompt_sample=bad)
    assert atskv.make_selector("h2o", prompt_sample=8).prompt_sample == 8
    assert atskv.make_selector("h2o+quest", h2o={"prompt_sample": 4}).prompt_sample == 4
