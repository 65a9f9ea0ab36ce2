"""One meaning of a budget everywhere: an int is tokens (>= 1), a float strictly between 0 and 1 a
fraction of the context; anything else is an InputError naming the budget and the rule, from the
central check and from every place that takes a budget."""

from __future__ import annotations

import pytest
import torch

import atskv
from atskv.budget import check_budget, resolve_budget
from atskv.errors import InputError
from atskv.eval import peer
from atskv.rl.policy import GumbelTopKPolicy
from tests.conftest import random_prompt, run_cli, tiny_model

REJECTED = [1.0, 0, 0.0, -1, -0.5, 1.5, 2.0, True, False, "0.1", "256", None, float("nan")]
ACCEPTED = [1, 256, 0.1, 0.5, 0.999]


@pytest.mark.parametrize("budget", REJECTED, ids=repr)
def test_the_central_check_refuses_anything_but_tokens_or_a_fraction(budget):
    with pytest.raises(InputError, match=r"bad budget .*an int, the tokens kept .*strictly between 0 and 1"):
        check_budget(budget)
    with pytest.raises(InputError, match="bad budget"):
        resolve_budget(budget, torch.tensor([100]))


def test_one_point_zero_is_refused_with_the_way_to_keep_everything():
    with pytest.raises(InputError, match="to keep every token, pass the context length as an int"):
        check_budget(1.0)


@pytest.mark.parametrize("budget", ACCEPTED, ids=repr)
def test_tokens_and_fractions_are_accepted(budget):
    assert check_budget(budget) == budget
    context = torch.tensor([[[1000]], [[10]]])
    kept = resolve_budget(budget, context)
    expected = [min(budget, 1000), min(budget, 10)] if isinstance(budget, int) else [
        max(1, -(-int(budget * 1000 * 1000) // 1000)), max(1, -(-int(budget * 10 * 1000) // 1000))]
    assert kept.flatten().tolist() == expected


@pytest.mark.parametrize("budget", REJECTED, ids=repr)
def test_every_place_that_takes_a_budget_refuses_the_same_values(budget):
    model = tiny_model("llama")
    with pytest.raises(InputError, match="bad budget"):
        with atskv.sparse(model, "h2o", budget=budget):
            pass
    with pytest.raises(InputError, match="bad budget"):
        atskv.TieringConfig(budget=budget)
    with pytest.raises(InputError, match="bad budget"):
        GumbelTopKPolicy(budget)
    with pytest.raises(InputError, match="bad budget"):
        peer.compression_ratio(budget)


def test_an_int_budget_of_the_context_keeps_every_token():
    """What 1.0 used to say: an int at least the context length keeps everything (the hook clamps it)."""
    model = tiny_model("llama")
    ids = random_prompt(12)
    with torch.no_grad():
        dense = model(ids).logits
        with atskv.sparse(model, "h2o", budget=ids.shape[1], dense_layers=0, sparse_prefill=True):
            kept = model(ids).logits
    torch.testing.assert_close(kept, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", ["1.0", "0", "-3", "1.5"])
def test_the_command_line_refuses_them_before_loading_a_model(value, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the budget was checked")

    monkeypatch.setattr("atskv.models.load_model", refuse)
    assert run_cli(["generate", "hi", "--selector", "h2o", "--budget", value]) == 2
    err = capsys.readouterr().err
    assert f"bad budget {value}" in err and "\n" not in err.strip()


def test_a_numpy_count_is_a_token_budget_and_a_numpy_fraction_a_fraction():
    import numpy as np

    assert check_budget(np.int64(32)) == 32 and type(check_budget(np.int64(32))) is int
    assert type(check_budget(np.float32(0.25))) is float
    with pytest.raises(InputError, match="bad budget"):
        check_budget(np.int64(0))
