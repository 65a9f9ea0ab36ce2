"""The predictor's building blocks: the token-type table and the RelevanceMLP."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.predictor.token_types import TOKEN_TYPES, token_type_table
from tests.conftest import tiny_bpe_tokenizer

SCALARS = ("attention", "position", "log_age", "hidden_norm", "key_norm", "prev_attention")
GEOMETRIES = {"smollm2-135m": (576, 28, 3), "gemma3-270m": (640, 3, 1)}


def types_of(tokenizer, table, pieces):
    return [TOKEN_TYPES[table[i]] for i in tokenizer.convert_tokens_to_ids(pieces)]


def test_token_types_on_byte_level_bpe():
    tokenizer = tiny_bpe_tokenizer()
    table = token_type_table(tokenizer)
    assert table.shape == (len(tokenizer),) and table.dtype == torch.int8
    assert int(table.min()) >= 0 and int(table.max()) < len(TOKEN_TYPES)
    pieces = ["<s>", "</s>", "<unk>", "0", "7", "ĠThe", "T", "Ġthe", "he", ".", ",", "Ċ", "Ġ", "Ã"]
    expected = ["special"] * 3 + ["numeric"] * 2 + ["capitalised"] * 2 + ["lowercase"] * 2
    expected += ["punctuation", "punctuation", "newline", "whitespace", "other"]  # "Ã": a lone UTF-8 lead byte
    assert types_of(tokenizer, table, pieces) == expected
    counts = torch.bincount(table.long(), minlength=len(TOKEN_TYPES))
    assert counts[TOKEN_TYPES.index("special")] == 3 and counts[TOKEN_TYPES.index("numeric")] == 10


def test_token_types_on_sentencepiece_style_pieces():
    """Gemma-style "▁" markers and byte-fallback pieces, and a padded model vocabulary."""
    pieces = ["<unk>", "<bos>", "▁The", "▁the", "▁", "▁▁", "<0x0A>", "<0xE2>", "42", ".", "ab1"]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", unk_token="<unk>")
    table = token_type_table(tokenizer, vocab_size=len(pieces) + 5)
    assert [TOKEN_TYPES[t] for t in table[: len(pieces)]] == [
        "special", "special", "capitalised", "lowercase", "whitespace", "whitespace",
        "newline", "other", "numeric", "punctuation", "other",
    ]  # fmt: skip
    assert table.shape == (len(pieces) + 5,) and (table[len(pieces) :] == TOKEN_TYPES.index("other")).all()
    backend.decoder = decoders.Metaspace()  # drops a lone "▁" entirely: still whitespace
    assert TOKEN_TYPES[token_type_table(tokenizer)[4]] == "whitespace"


@pytest.mark.slow
def test_token_types_on_smollm2():
    from atskv.models import load_model

    tokenizer = load_model("smollm2-135m").tokenizer
    table = token_type_table(tokenizer)
    assert table.shape == (49152,)
    counts = dict(zip(TOKEN_TYPES, torch.bincount(table.long(), minlength=len(TOKEN_TYPES)).tolist()))
    assert counts["special"] == len(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    assert counts["numeric"] == 10  # SmolLM2 splits numbers into single digits
    assert counts["lowercase"] > counts["capitalised"] > counts["punctuation"] > counts["newline"] > 0
    assert counts["lowercase"] + counts["capitalised"] > 0.9 * len(tokenizer)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert [TOKEN_TYPES[table[i]] for i in encode(" The the.\n7")] == [
        "capitalised", "lowercase", "punctuation", "newline", "numeric"
    ]  # fmt: skip


def make_inputs(spec: FeatureSpec, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, spec.d_model, generator=g),
        torch.randn(n, len(spec.scalar_features), generator=g),
        torch.randint(0, spec.num_token_types, (n,), generator=g, dtype=torch.int8),
        torch.randint(0, spec.num_layers, (n,), generator=g),
        torch.randint(0, spec.num_kv_heads, (n,), generator=g),
    )


@pytest.mark.parametrize("model", GEOMETRIES)
def test_relevance_mlp_shape_and_size(model):
    d_model, layers, kv_heads = GEOMETRIES[model]
    spec = FeatureSpec(d_model, SCALARS, layers, kv_heads)
    mlp = RelevanceMLP(spec).eval()
    assert 100_000 <= mlp.parameter_count() <= 500_000
    hidden, scalars, types, layer, head = make_inputs(spec, 33)
    logits = mlp(hidden.half(), scalars, types, layer, head)  # runtime hidden states may be half precision
    assert logits.shape == (33,) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    split = mlp.score(mlp.project_hidden(hidden), scalars, types, layer, head)
    torch.testing.assert_close(split, mlp(hidden, scalars, types, layer, head))
    # the hidden state's scale is the norm feature's business: the projection sees its direction
    torch.testing.assert_close(mlp(10 * hidden, scalars, types, layer, head), split)


def test_layer_and_head_embeddings_condition_the_output():
    spec = FeatureSpec(576, SCALARS, 28, 3)
    mlp = RelevanceMLP(spec).eval()
    hidden, scalars, types, _, _ = make_inputs(spec, 8)
    zeros, ones = torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    base = mlp(hidden, scalars, types, zeros, zeros)
    assert not torch.allclose(base, mlp(hidden, scalars, types, ones * 5, zeros))
    assert not torch.allclose(base, mlp(hidden, scalars, types, zeros, ones * 2))
    assert not torch.allclose(base, mlp(hidden, scalars, (types.long() + 1) % spec.num_token_types, zeros, zeros))


def test_gradients_reach_every_parameter():
    spec = FeatureSpec(640, SCALARS, 3, 1)
    mlp = RelevanceMLP(spec).train()
    hidden, scalars, types, layer, head = make_inputs(spec, 64)
    labels = (torch.rand(64, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    torch.nn.functional.binary_cross_entropy_with_logits(mlp(hidden, scalars, types, layer, head), labels).backward()
    for name, p in mlp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # training updated the scalar standardisation that eval mode uses
    torch.testing.assert_close(mlp.scalar_norm.running_mean, 0.1 * scalars.mean(0))


def test_feature_spec_round_trip_and_mismatches():
    spec = FeatureSpec(576, SCALARS, 28, 3)
    again = FeatureSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.num_token_types == len(TOKEN_TYPES) and isinstance(again.scalar_features, tuple)
    with pytest.raises(ValueError, match="unknown FeatureSpec fields"):
        FeatureSpec.from_dict({**spec.to_dict(), "vocab": 3})
    with pytest.raises(ValueError, match="unique"):
        FeatureSpec(576, ("a", "a"), 28, 3)
    mlp = RelevanceMLP(spec)
    hidden, scalars, types, layer, head = make_inputs(spec, 4)
    with pytest.raises(ValueError, match="expects 576"):
        mlp(hidden[:, :100], scalars, types, layer, head)
    with pytest.raises(ValueError, match="log_age"):
        mlp(hidden, scalars[:, :3], types, layer, head)
    with pytest.raises(ValueError, match="must have shape"):
        mlp(hidden, scalars, types[:2], layer, head)


def test_inputs_left_out_change_nothing_and_the_rest_still_counts():
    """The ablations' MLPs: no hidden state (reduced_width 0), no attention features, no token type."""
    spec = FeatureSpec(64, SCALARS, 2, 2)
    mlp = RelevanceMLP(spec, reduced_width=0, hidden=32, without=["attention", "prev_attention", "token_type"]).eval()
    assert mlp.projected_width == 0 and mlp.arguments()["without"] == ["attention", "prev_attention", "token_type"]
    assert mlp.inputs() == {"position", "log_age", "hidden_norm", "key_norm"}  # what a runtime must compute
    assert RelevanceMLP(spec).inputs() == {"hidden", "token_type", *SCALARS}
    hidden, scalars, types, layer, head = make_inputs(spec, 16)
    base = mlp(hidden, scalars, types, layer, head)
    other = scalars.clone()
    other[:, [0, 5]] += 3.0  # attention and prev_attention
    torch.testing.assert_close(mlp(torch.randn_like(hidden), other, (types + 1) % 8, layer, head), base)
    other[:, 1] += 3.0  # position is still read
    assert not torch.allclose(mlp(hidden, other, types, layer, head), base)
    with pytest.raises(ValueError, match=r"without names \['age'\]"):
        RelevanceMLP(spec, without=["age"])
