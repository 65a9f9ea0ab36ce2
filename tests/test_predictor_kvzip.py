"""KVzip+ reconstruction labels: the score orders tokens by the repeat pass's attention weighted by
the output norm, the collected `kvzip` column equals a brute-force eager computation, it picks the
positives, and a bad label is refused in one line before anything loads."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from atskv.cli.predictor import collect as collect_command
from atskv.predictor.collect import collect
from atskv.predictor.kvzip import REPEAT_PROMPT, reconstruction_scores
from atskv.predictor.shards import ShardDataset
from atskv.predictor.training import training_columns
from tests.conftest import COMMON, random_prompt, run_cli, tiny_bpe_tokenizer

T, W, K = 64, 8, 6
MANAGED = [1, 2, 3]  # 4 layers, dense_layers=1


def test_a_token_the_repeat_attends_outranks_one_it_ignores():
    """Two KV heads of two query heads; every repeat query points at key 2 and away from key 4."""
    d, n, r = 8, 6, 5
    keys = torch.zeros(1, 2, n + r, d)
    keys[:, :, 2, 0], keys[:, :, 4, 0] = 4.0, -4.0
    query = torch.zeros(1, 4, r, d)
    query[..., 0] = 1.0
    values = torch.ones(1, 2, n + r, d)
    mask = torch.ones(1, 1, r, n + r, dtype=torch.bool)
    o_weight, hidden = torch.eye(4 * d), torch.ones(1, r, 4 * d)  # d_model = Hq * D: every head its own block
    scores = reconstruction_scores(query, keys, values, mask, 1.0, o_weight, hidden, n)
    assert scores.shape == (1, 2, n)
    assert (scores[..., 2] > 10 * scores[..., 4]).all() and (scores[..., 2] == scores.amax(-1)).all()
    silent = values.clone()
    silent[:, :, 2] = 0.0  # attended but adds nothing to the output: the value norm takes it out
    assert (reconstruction_scores(query, keys, silent, mask, 1.0, o_weight, hidden, n)[..., 2] == 0).all()


def _model_and_tokenizer():
    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    return LlamaForCausalLM(config).eval(), tokenizer


def _eager_kvzip(model, ids: torch.Tensor, n: int, start: int) -> dict[int, torch.Tensor]:
    """`{layer: [Hkv, n]}` straight from eager attention weights, values and the o_proj blocks."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=True)
    model.set_attn_implementation("sdpa")
    hkv, hq = model.config.num_key_value_heads, model.config.num_attention_heads
    d = model.config.hidden_size // hq
    scores = {}
    for layer in MANAGED:
        x = model.model.layers[layer].input_layernorm(out.hidden_states[layer])[0, start:]  # [R, d_model]
        a = out.attentions[layer][0, :, start:, :n] / x.norm(dim=-1)[None, :, None]  # [Hq, R, n]
        v = out.past_key_values.layers[layer].values[0, :, :n]  # [Hkv, n, D]
        o = model.model.layers[layer].self_attn.o_proj.weight  # [d_model, Hq * D]
        per_head = torch.stack([
            a[h].amax(0) * (v[h // (hq // hkv)] @ o[:, h * d : (h + 1) * d].T).norm(dim=-1) for h in range(hq)
        ])
        scores[layer] = per_head.view(hkv, hq // hkv, n).amax(1)
    return scores


def test_collected_kvzip_equals_eager_attention_and_picks_the_positives(tmp_path):
    model, tokenizer = _model_and_tokenizer()
    window = random_prompt(T, batch=1)
    folder = collect(model, tokenizer, window, tmp_path, decision_points=(0.5,), future_queries=W, topk=K,
                     dense_layers=1, label="kvzip", progress=False)
    assert ShardDataset(folder).meta["label"] == "kvzip" and training_columns(ShardDataset(folder).meta)[-1] == "kvzip"
    shard = load_file(folder / "shard-0.safetensors")
    t = 32
    instruction = torch.tensor(tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    ids = torch.cat([window[0, : t + 1], instruction, window[0, : t + 1]]).view(1, -1)
    expected = _eager_kvzip(model, ids, t + 1, t + 1 + instruction.numel())
    for r in range(shard["kvzip"].shape[0]):
        layer, h, i = MANAGED[int(shard["layer"][r])], int(shard["head"][r]), int(shard["position"][r])
        torch.testing.assert_close(shard["kvzip"][r], expected[layer][h, i], rtol=1e-4, atol=1e-9)
        assert bool(shard["in_topk"][r]) == (i in expected[layer][h].topk(K).indices.tolist())


def test_a_bad_label_is_one_line_before_the_model_loads(capsys):
    with pytest.raises(ValueError, match=r"^label must be one of mass, kvzip, got 'zip'$"):
        collect_command(model="no-such-model", window_tokens=64, future_queries=8, label="zip")
    assert run_cli(["collect", "--model", "no-such-model", "--window_tokens", "64", "--future_queries", "8",
                    "--label", "zip"]) == 2
    assert capsys.readouterr().err == "atskv: error: label must be one of mass, kvzip, got 'zip'\n"
