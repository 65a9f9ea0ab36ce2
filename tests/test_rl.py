"""Policy-gradient fine-tuning (`atskv.rl`): policies against enumeration, rollouts against dense
and eager attention and against the learned selector in the hook, the reward, a REINFORCE step
that learns, and `atskv finetune` -> `atskv export` -> the learned selector on a tiny model."""

from __future__ import annotations

import itertools
import math
import re
import statistics

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import atskv
from atskv.data import synthetic_filler
from atskv.features import SCALAR_FEATURES
from atskv.models import load_model, model_geometry
from atskv.models.cache_names import returned_cache, with_cache
from atskv.predictor.attention_bias import DROPPED, BiasSession
from atskv.predictor.export import export_predictor, load_predictor
from atskv.predictor.model import FeatureSpec, RelevanceMLP
from atskv.predictor.token_types import token_type_table
from atskv.rl.evaluate import (
    DENSE,
    THRESHOLD,
    Above,
    SharedTop,
    evaluate_predictors,
    evaluate_selectors,
    keep_mask,
    selector_keep,
    summary,
)
from atskv.rl.items import CORPUS, RolloutItem, task_items
from atskv.rl.policy import BernoulliPolicy, GumbelTopKPolicy, RowLevelPolicy, Selection, marginal_kl
from atskv.rl.reward import leave_one_out, reward
from atskv.rl.rollout import RolloutResult, context_features, continuation_scores, predictor_logits, rollout
from atskv.rl.training import PolicyGradientModule, policy_loss
from atskv.selectors.learned import LearnedSelector
from tests.conftest import COMMON, random_prompt, run_cli, tiny_bpe_tokenizer, tiny_model
from tests.test_cli import check_learned_gets_its_options

MANAGED = [2, 3]  # a 4-layer tiny Llama with dense_layers=2


# --- policies -----------------------------------------------------------------------------------
def _all_ordered_pairs(n: int = 4) -> Selection:
    order = torch.tensor(list(itertools.permutations(range(n), 2)))
    return Selection(torch.zeros(len(order), n, dtype=torch.bool).scatter_(-1, order, True), order)


def test_plackett_luce_log_probs_are_exact_and_match_sampling():
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0])
    policy = GumbelTopKPolicy(2, temperature=0.8)
    pairs = _all_ordered_pairs()
    probs = policy.log_prob(logits, pairs).exp()
    s = logits / 0.8
    by_hand = [s[a].exp() / s.exp().sum() * s[b].exp() / (s.exp().sum() - s[a].exp()) for a, b in pairs.order.tolist()]
    torch.testing.assert_close(probs, torch.stack(by_hand))
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    drawn = policy.sample(logits, 40_000, torch.Generator().manual_seed(0))
    assert (drawn.keep.sum(-1) == 2).all() and drawn.keep.gather(-1, drawn.order).all()
    codes = torch.bincount(drawn.order[:, 0] * 4 + drawn.order[:, 1], minlength=16).float() / 40_000
    frequencies = codes[pairs.order[:, 0] * 4 + pairs.order[:, 1]]
    assert (frequencies - probs).abs().max() < 0.01


def test_plackett_luce_entropy_estimate_is_unbiased():
    logits = torch.tensor([0.5, -1.0, 1.5, 0.0])
    policy = GumbelTopKPolicy(2)
    pairs = _all_ordered_pairs()
    log_probs = policy.log_prob(logits, pairs)
    exact = -(log_probs.exp() * log_probs).sum()
    estimates = torch.stack(  # per pair: the sum of its draws' entropies (the estimate is per token)
        [policy.entropy(logits, Selection(pairs.keep[i : i + 1], pairs.order[i : i + 1])) * 4 for i in range(12)]
    )
    assert (log_probs.exp() * estimates).sum().item() == pytest.approx(exact.item(), rel=1e-5)


def test_bernoulli_log_probs_and_entropy_against_enumeration():
    logits = torch.tensor([[0.7, -1.1, 0.2], [2.0, 0.0, -0.4]])  # 2 rows x 3 tokens
    policy = BernoulliPolicy(temperature=1.5)
    masks = torch.tensor(list(itertools.product([False, True], repeat=6))).view(64, 2, 3)
    log_probs = policy.log_prob(logits, Selection(masks))
    assert log_probs.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    exact = -(log_probs.exp() * log_probs).sum() / 6  # per token
    assert policy.entropy(logits).item() == pytest.approx(exact.item(), rel=1e-5)
    drawn = policy.sample(logits, 20_000, torch.Generator().manual_seed(0))
    assert (drawn.keep.float().mean(0) - torch.sigmoid(logits / 1.5)).abs().max() < 0.015


def test_row_level_samples_levels_keeps_the_ranking_and_has_exact_memory():
    """Each row keeps the tokens above its sampled level (so a sample is a prefix of the row's
    ranking); the log-probability is the Gaussian density of the levels and its gradient reaches
    every logit of the row through their mean; E[memory] and the keep marginals are Phi(s)."""
    logits = torch.tensor([[0.7, -1.1, 0.2, 2.4], [-2.0, 0.0, -0.4, 0.9]])
    policy = RowLevelPolicy(temperature=1.5)
    s = logits / 1.5
    drawn = policy.sample(logits, 20_000, torch.Generator().manual_seed(0))
    rank = s.argsort(-1, descending=True)
    kept_in_rank_order = drawn.keep.gather(-1, rank.expand_as(drawn.keep))
    assert (kept_in_rank_order.int().diff(dim=-1) <= 0).all()  # kept tokens come first in the ranking
    torch.testing.assert_close(drawn.keep, s + (drawn.levels - s.mean(-1)).unsqueeze(-1) > 0)
    assert (drawn.keep.float().mean(0) - torch.special.ndtr(s)).abs().max() < 0.015
    assert drawn.memory.mean().item() == pytest.approx(policy.expected_memory(logits).item(), abs=0.01)
    torch.testing.assert_close(torch.sigmoid(policy.keep_marginal_logits(logits)), torch.special.ndtr(s))
    x = logits.clone().requires_grad_(True)
    one = Selection(drawn.keep[:1], levels=drawn.levels[:1])
    noise = drawn.levels[0] - s.mean(-1)
    torch.testing.assert_close(policy.log_prob(x, one), (-0.5 * noise**2 - 0.5 * math.log(2 * math.pi)).sum().view(1))
    (grad,) = torch.autograd.grad(policy.log_prob(x, one).sum(), x)
    torch.testing.assert_close(grad, (noise / 1.5 / 4).unsqueeze(-1).expand(2, 4))  # d/dc log N(z; c, 1) / N / T
    with pytest.raises(ValueError, match="sampled levels"):
        policy.log_prob(logits, Selection(drawn.keep[:1]))


def test_shared_top_is_one_threshold_over_all_rows():
    """shared<b> keeps the b highest logits of all rows together: rows keep different amounts, the
    total is exact, and at the threshold's own count it is the threshold's mask; above<c> is the
    threshold moved to c."""
    logits = torch.tensor([[[3.0, 2.5, 2.0, -1.0]], [[-2.0, -3.0, 0.5, -0.5]]])  # [L=2, Hkv=1, T=4]
    keep = keep_mask(SharedTop(0.5), logits)
    assert keep.sum().item() == 4 and keep.sum(-1).flatten().tolist() == [3, 1]
    threshold = keep_mask(THRESHOLD, logits)
    assert torch.equal(keep_mask(SharedTop(threshold.float().mean().item()), logits), threshold)
    assert keep_mask(SharedTop(0.01), logits).sum().item() == 1  # rounds up: never nothing
    assert torch.equal(keep_mask(Above(0.0), logits), threshold)
    assert keep_mask(Above(2.2), logits).sum(-1).flatten().tolist() == [2, 0]
    with pytest.raises(ValueError, match="fraction in"):
        SharedTop(1.0)


def test_greedy_decisions_and_budgets():
    logits = torch.tensor([[0.3, -2.0, 1.0, -0.1, 0.5]])
    assert BernoulliPolicy(temperature=3.0).greedy(logits).tolist() == [[True, False, True, False, True]]
    assert GumbelTopKPolicy(2).greedy(logits).tolist() == [[False, False, True, False, True]]
    assert GumbelTopKPolicy(0.5).tokens(5) == 3 and GumbelTopKPolicy(0.01).tokens(5) == 1
    # the Plackett-Luce keep marginal is shift-invariant, like the policy
    policy = GumbelTopKPolicy(2)
    torch.testing.assert_close(policy.keep_marginal_logits(logits), policy.keep_marginal_logits(logits + 7.0))
    assert (torch.sigmoid(policy.keep_marginal_logits(logits)) > 0.5).sum() == 2


@pytest.mark.parametrize(
    "policy", [BernoulliPolicy(), GumbelTopKPolicy(2), RowLevelPolicy()], ids=["bernoulli", "gumbel_topk", "row_level"]
)
def test_reinforce_moves_probability_toward_the_rewarded_token(policy):
    torch.manual_seed(0)
    logits = torch.zeros(2, 6, requires_grad=True)  # 2 rows (layer, head) x 6 tokens
    reference = logits.detach().clone()
    optimiser = torch.optim.Adam([logits], lr=0.05)

    def p_keep_3() -> float:
        return policy.sample(logits, 4000, torch.Generator().manual_seed(1)).keep[..., 3].float().mean().item()

    before = p_keep_3()
    for _ in range(40):
        selection = policy.sample(logits, 8)
        performance = selection.keep[..., 3].float().mean(-1)  # pays only for keeping token 3
        loss, parts = policy_loss(policy, logits, selection, performance, 1.0, reference, 1e-3, 1e-3)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert p_keep_3() > before + 0.25
    assert parts["kl"] > 0  # it moved away from the reference


def test_memory_and_entropy_enter_the_loss_with_their_exact_gradients_on_one_scale():
    """With a constant performance (no advantage) the loss is (1 - alpha) E[memory] - w H: its
    gradient must be that of E[memory] and of the entropy taken over every mask (2 rows x 3
    tokens = 6 decisions, 64 masks), both as means over the 6 decisions."""
    policy = BernoulliPolicy(temperature=1.5)
    logits = torch.tensor([[0.7, -1.1, 0.2], [2.0, 0.0, -0.4]], requires_grad=True)
    masks = torch.tensor(list(itertools.product([False, True], repeat=6))).view(64, 2, 3)
    log_probs = policy.log_prob(logits, Selection(masks))  # differentiable in `logits`
    expected_memory = (log_probs.exp() * masks.flatten(1).float().mean(1)).sum()
    entropy = -(log_probs.exp() * log_probs).sum() / 6
    (memory_grad,) = torch.autograd.grad(expected_memory, logits, retain_graph=True)
    (entropy_grad,) = torch.autograd.grad(entropy, logits)
    p = torch.sigmoid(logits.detach() / 1.5)
    torch.testing.assert_close(memory_grad, p * (1 - p) / 1.5 / 6)  # d mean(sigmoid(l / T)) / dl
    drawn = policy.sample(logits, 5, torch.Generator().manual_seed(0))
    for alpha, entropy_weight in [(0.3, 0.0), (0.8, 0.05), (1.0, 0.05)]:
        loss, parts = policy_loss(policy, logits, drawn, torch.full((5,), -2.5), alpha, logits, entropy_weight, 0.3)
        (grad,) = torch.autograd.grad(loss, logits)
        torch.testing.assert_close(grad, (1 - alpha) * memory_grad - entropy_weight * entropy_grad)
        assert parts["expected_memory"].item() == pytest.approx(expected_memory.item(), rel=1e-6)
    topk = GumbelTopKPolicy(1)  # memory is fixed by the budget: nothing to learn from it
    logits = torch.randn(2, 3, requires_grad=True)
    fixed = topk.expected_memory(logits)
    assert fixed.item() == pytest.approx(1 / 3) and not fixed.requires_grad
    loss, _ = policy_loss(topk, logits, topk.sample(logits, 4), torch.zeros(4), 0.2, logits.detach(), 0.0, 0.0)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().max().item() == 0.0


@pytest.mark.parametrize("policy", [BernoulliPolicy(), RowLevelPolicy()], ids=["bernoulli", "row_level"])
def test_smaller_alpha_lowers_keep_probabilities_more(policy):
    """One SGD step from the same logits and samples, performance constant: the memory price
    (1 - alpha) is all that differs, so the mean keep probability must fall, and fall more the
    smaller alpha; with the default entropy and KL weights beside it."""
    start = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    selection = policy.sample(start, 8, torch.Generator().manual_seed(1))
    drops = []
    for alpha in (0.2, 0.5, 0.9, 0.99):
        logits = start.clone().requires_grad_(True)
        optimiser = torch.optim.SGD([logits], lr=1000.0)  # the memory gradient per logit is ~1 / D
        loss, _ = policy_loss(policy, logits, selection, torch.full((8,), -3.0), alpha, start, 1e-3, 1e-2)
        loss.backward()
        optimiser.step()
        drops.append((policy.expected_memory(start) - policy.expected_memory(logits)).item())
    assert drops[-1] > 0
    assert drops == sorted(drops, reverse=True) and drops[0] > 10 * drops[-1]


def test_marginal_kl_is_zero_against_itself_and_positive_otherwise():
    logits = torch.randn(3, 10)
    for policy in (BernoulliPolicy(), GumbelTopKPolicy(4)):
        assert marginal_kl(policy, logits, logits).item() == pytest.approx(0.0, abs=1e-7)
        assert marginal_kl(policy, logits, logits.flip(-1)).item() > 0


# --- reward -------------------------------------------------------------------------------------
def test_reward_and_leave_one_out():
    performance, memory = torch.tensor([-2.0, -3.0, -1.0]), torch.tensor([0.5, 0.2, 1.0])
    torch.testing.assert_close(reward(performance, memory, 0.8), 0.8 * performance - 0.2 * memory)
    torch.testing.assert_close(reward(performance, memory, 1.0), performance)
    torch.testing.assert_close(reward(performance, memory, 0), -memory)
    torch.testing.assert_close(leave_one_out(torch.tensor([1.0, 2.0, 6.0])), torch.tensor([-3.0, -1.5, 4.5]))
    for alpha in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"alpha .* \[0, 1\]"):
            reward(performance, memory, alpha)
    with pytest.raises(ValueError, match="at least 2 samples"):
        leave_one_out(torch.tensor([1.0]))


def test_budgets_the_policy_cannot_meet():
    for budget, message in [
        (0, "at least 1 token"),
        (-3, "at least 1 token"),
        (1.0, "strictly between 0 and 1"),
        (0.0, "strictly between 0 and 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            GumbelTopKPolicy(budget)
    with pytest.raises(ValueError, match="keeps the whole context of 8 tokens"):
        GumbelTopKPolicy(8).check(8)
    with pytest.raises(ValueError, match="keeps the whole context"):
        GumbelTopKPolicy(8).sample(torch.zeros(1, 6), 2)
    with pytest.raises(ValueError, match="temperature"):
        BernoulliPolicy(temperature=0.0)


# --- rollouts -----------------------------------------------------------------------------------
def _eager_with_dropped(model, dropped: dict[int, torch.Tensor], t: int):
    """Eager attention in which `dropped[layer]` `[Hkv, t+1]` tokens are masked for queries after t."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in dropped:
            g = query.shape[1] // key.shape[1]
            attention_mask = attention_mask.expand(-1, query.shape[1], -1, -1).clone()
            for h, row in enumerate(dropped[module.layer_idx]):
                attention_mask[:, h * g : (h + 1) * g, t + 1 :, : t + 1][..., row] = torch.finfo(query.dtype).min
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_rl_dropped", forward)
    AttentionMaskInterface.register("test_rl_dropped", eager_mask)
    model.set_attn_implementation("test_rl_dropped")
    try:
        with torch.no_grad():
            return model(random_prompt(40, seed=1)).logits[0]
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rollout_nll_against_dense_and_eager_attention(family):
    model = tiny_model(family)
    layers = [2, 3] if family == "llama" else [2, 5]  # Gemma: the global layers only
    ids = random_prompt(40, seed=1)[0]
    item, t = RolloutItem(ids, 30, CORPUS), 29
    hkv = model.config.num_key_value_heads
    keep = torch.ones(3, len(layers), hkv, 30, dtype=torch.bool)
    keep[1] = False  # everything dropped
    keep[2] = torch.rand(len(layers), hkv, 30, generator=torch.Generator().manual_seed(0)) < 0.5
    result = rollout(model, item, keep, layers)
    with torch.no_grad():
        dense = F.cross_entropy(model(ids[None]).logits[0, 30:-1], ids[31:])
    assert result.nll[0].item() == pytest.approx(dense.item(), rel=1e-5)
    assert abs(result.nll[1].item() - dense.item()) > 1e-3
    eager = _eager_with_dropped(model, {layer: ~keep[2, i] for i, layer in enumerate(layers)}, t)
    assert result.nll[2].item() == pytest.approx(F.cross_entropy(eager[30:-1], ids[31:]).item(), rel=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face folder with its tokenizer, a small corpus, and a
    random supervised predictor for it exported as `atskv export` would."""
    root = tmp_path_factory.mktemp("rl")
    tokenizer = tiny_bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **{**COMMON, "vocab_size": len(tokenizer)})
    LlamaForCausalLM(config).save_pretrained(root / "tiny-llama")
    tokenizer.save_pretrained(root / "tiny-llama")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"doc{i}.txt").write_text(synthetic_filler(600, seed=i))
    spec = FeatureSpec(config.hidden_size, SCALAR_FEATURES, len(MANAGED), config.num_key_value_heads)
    torch.manual_seed(1)
    mlp = RelevanceMLP(spec, reduced_width=8, hidden=16).eval()
    export_predictor(
        mlp,
        token_type_table(tokenizer, len(tokenizer)),
        root / "supervised",
        base_model="tiny-llama",
        geometry=model_geometry(config),
        managed_layers=MANAGED,
        training={"stage": "fit", "seed": 7},
    )
    return root


def _hooked_continuation(model, item: RolloutItem, selector, budget) -> RolloutResult:
    """The reference: the context prefilled through the hook (which evicts at its end), then the
    continuation as one more step through it, over what the selector kept."""
    ids = item.ids[None]
    with torch.no_grad(), atskv.sparse(model, selector, budget=budget, dense_layers=2) as session:
        prefill = model(ids[:, : item.context], **with_cache(model, session.new_cache()), logits_to_keep=1)
        rest = model(ids[:, item.context : -1], **with_cache(model, returned_cache(prefill))).logits
    return continuation_scores(prefill.logits[0, -1], rest, ids[0, item.context :])


def test_greedy_rollout_and_a_selectors_kept_set_equal_the_hook(tiny):
    """The rollout of the predictor's greedy top-b, and of the set the learned selector keeps in the
    hook (`selector_keep`), score the continuation as the hook itself does; reading back every
    dropped token gives dense's scores."""
    lm = load_model(str(tiny / "tiny-llama"))
    predictor = load_predictor(tiny / "supervised")
    item = RolloutItem(
        torch.randint(3, len(lm.tokenizer), (60,), generator=torch.Generator().manual_seed(2)), 48, CORPUS
    )
    features = context_features(lm.model, item.ids[:48], MANAGED, predictor.token_types)
    with torch.no_grad():
        keep = GumbelTopKPolicy(12).greedy(predictor_logits(predictor.mlp, features))
    selector = LearnedSelector(predictor=predictor)
    kept = selector_keep(lm.model, item, selector, 12, MANAGED)
    assert torch.equal(kept, keep) and int(kept.sum()) == 12 * kept.shape[0] * kept.shape[1]
    hooked = _hooked_continuation(lm.model, item, selector, 12)
    ours = rollout(lm.model, item, torch.stack([keep, kept, torch.ones_like(keep)]), MANAGED)
    for k in (0, 1):
        assert ours.nll[k].item() == pytest.approx(hooked.nll.item(), rel=1e-5)
        assert bool(ours.exact[k]) == bool(hooked.exact)
    everything = rollout(lm.model, item, keep[None], MANAGED, retrieve=48)
    assert everything.nll.item() == pytest.approx(ours.nll[2].item(), rel=1e-5)  # all 36 dropped read back
    assert ours.nll[2].item() != pytest.approx(ours.nll[0].item(), rel=1e-3)  # and dropping them mattered


def test_retrieval_reads_back_each_querys_best_dropped_tokens():
    """A query reads back the `retrieve` dropped tokens with the highest q·k (max over its group's
    heads) and no others; nothing dropped, nothing read; the kept ones stay as they were."""
    torch.manual_seed(3)
    b, hq, hkv, tq, s, d = 1, 4, 2, 3, 10, 8
    query, key = torch.randn(b, hq, tq, d), torch.randn(b, hkv, s, d)
    dropped = torch.zeros(b, hkv, tq, s, dtype=torch.bool)
    dropped[..., 2:7] = True
    bias = torch.zeros(b, hkv, tq, s).masked_fill(dropped, DROPPED)
    mask = torch.ones(b, 1, tq, s, dtype=torch.bool)
    out = BiasSession({}, retrieve=2)._read_back(query, key, mask, bias)
    rating = torch.einsum("bhgqd,bhsd->bhgqs", query.view(b, hkv, 2, tq, d), key).amax(2)
    best = rating.masked_fill(~dropped, -torch.inf).topk(2, dim=-1).indices
    expected = bias.scatter(-1, best, 0.0)
    assert torch.equal(out, expected) and int((out == DROPPED).sum()) == 3 * b * hkv * tq
    assert torch.equal(BiasSession({}, retrieve=2)._read_back(query, key, mask, torch.zeros_like(bias)),
                       torch.zeros_like(bias))  # fmt: skip
    with pytest.raises(ValueError, match="retrieve must be"):
        BiasSession({}, retrieve=-1)


def test_evaluation_records_and_summary(tiny):
    lm = load_model(str(tiny / "tiny-llama"))
    predictor = load_predictor(tiny / "supervised")
    items = [RolloutItem(random_prompt(40, seed=s)[0], 32, CORPUS) for s in range(2)]
    items += task_items(lm.tokenizer, ["passkey"], [2_000_000], 220)
    records = evaluate_predictors(
        lm.model,
        {"supervised-seed0": predictor.mlp},
        MANAGED,
        predictor.token_types,
        items,
        [0.25, THRESHOLD],
        progress=False,
    )
    records += evaluate_selectors(lm.model, ["h2o"], items, [0.25], MANAGED, progress=False)
    assert len(records) == 3 * (1 + 2) + 3
    for r in records:
        expected = {DENSE: 1.0, "top0.25": math.ceil(0.25 * r["context"]) / r["context"]}.get(r["retention"])
        assert expected is None or r["memory"] == pytest.approx(expected)
    rows = {(r["group"], r["retention"]): r for r in summary(records, {})}
    assert set(rows) == {("dense", DENSE), ("supervised", "top0.25"), ("supervised", THRESHOLD), ("h2o", "top0.25")}
    assert {"memory", "nll", "accuracy", "passkey", "reward"} <= set(rows["supervised", "top0.25"])
    threshold = [r for r in records if r["retention"] == THRESHOLD]
    for source, key in ((CORPUS, "corpus_memory"), ("passkey", "task_memory")):  # memory where each metric is scored
        expected = statistics.fmean(r["memory"] for r in threshold if r["source"] == source)
        assert rows["supervised", THRESHOLD][key][0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="not an evicting"):
        evaluate_selectors(lm.model, ["quest"], items, [0.25], MANAGED)


def test_eval_heldout_runs_learned_among_the_baselines_with_the_given_predictor(tiny, tmp_path, caplog, capsys):
    """`eval heldout --predictor --selector_options` reach the learned baseline."""
    args = ["eval", "heldout", "--model", str(tiny / "tiny-llama"), "--supervised", f"[{tiny / 'supervised'}]",
            "--out", str(tmp_path / "out"), "--corpus", str(tiny / "corpus"),
            "--windows", "1", "--context_tokens", "40", "--continuation_tokens", "4", "--tasks", "[]",
            "--budgets", "[0.25]", "--baselines", "[learned]", "--predictor", str(tiny / "supervised"),
            "--selector_options", "{learned: {refresh_every: 4}}", "--device", "cpu"]
    check_learned_gets_its_options(args, tiny / "supervised", "| learned | top0.25 |", caplog, capsys)


def test_eval_heldout_refuses_a_negative_retrieve_before_loading(capsys):
    assert run_cli(["eval", "heldout", "--model", "/no/such/model", "--retrieve", "-1"]) != 0
    assert "retrieve must be tokens (int >= 0)" in capsys.readouterr().err


# --- the module and the command line ------------------------------------------------------------
def _module(tiny, **kw):
    return PolicyGradientModule(predictor=str(tiny / "supervised"), model=str(tiny / "tiny-llama"), **kw)


def test_kl_is_zero_at_initialisation_and_the_loss_has_a_gradient(tiny):
    module = _module(tiny, samples=3)
    item = RolloutItem(random_prompt(40, seed=3)[0], 32, CORPUS)
    loss, parts = module.item_loss(item)
    assert parts["kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert 0 < parts["memory"] < 1 and parts["nll"] > 0 and "exact" not in parts
    loss.backward()
    assert module.model.w1.weight.grad.abs().sum() > 0
    assert module.frozen.reference.w1.weight.grad is None
    assert all(not p.requires_grad for p in module.frozen.base.parameters())
    module.train()
    assert not module.model.scalar_norm.training  # the supervised running statistics are kept


def test_a_predictor_for_another_model_is_refused(tiny, tmp_path):
    other = tiny_model("qwen3")  # another geometry (head dim 16)
    spec = FeatureSpec(other.config.hidden_size, SCALAR_FEATURES, 2, other.config.num_key_value_heads)
    export_predictor(
        RelevanceMLP(spec, 8, 16),
        torch.zeros(96, dtype=torch.int8),
        tmp_path,
        base_model="tiny-qwen3",
        geometry=model_geometry(other.config),
        managed_layers=MANAGED,
    )
    with pytest.raises(ValueError, match="trained for 'tiny-qwen3'"):
        PolicyGradientModule(predictor=str(tmp_path), model=str(tiny / "tiny-llama"))
    with pytest.raises(ValueError, match="samples must be >= 2"):
        _module(tiny, samples=1)


def _finetune_args(tiny, out, *extra):
    return [
        "finetune",
        "--config",
        "configs/finetune.yaml",
        "--model.predictor",
        str(tiny / "supervised"),
        "--model.model",
        str(tiny / "tiny-llama"),
        "--model.samples",
        "3",
        "--model.lr",
        "0.01",
        "--data.corpus",
        str(tiny / "corpus"),
        "--data.windows",
        "3",
        "--data.context_tokens",
        "48",
        "--data.continuation_tokens",
        "6",
        "--data.tasks",
        "[]",
        "--trainer.max_steps",
        "3",
        "--trainer.accelerator",
        "cpu",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.default_root_dir",
        str(out),
        "--trainer.logger.init_args.save_dir",
        str(out),
        *extra,
    ]


def test_finetune_then_export_then_the_learned_selector(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert run_cli(_finetune_args(tiny, tmp_path / "ft")) == 0
    checkpoint = next((tmp_path / "ft").rglob("last.ckpt"))
    events = EventAccumulator(str(checkpoint.parent.parent)).Reload()
    for curve in ("reward", "nll", "memory", "entropy", "kl"):
        assert len(events.Scalars(f"train/{curve}")) == 3
    assert (
        run_cli(["export", str(checkpoint), "--out", str(tmp_path / "exported"), "--model", str(tiny / "tiny-llama")])
        == 0
    )
    tuned, supervised = load_predictor(tmp_path / "exported"), load_predictor(tiny / "supervised")
    assert tuned.header.managed_layers == tuple(MANAGED) and tuned.header.base_model == "tiny-llama"
    training = tuned.header.training  # what the fine-tuning used, not RelevanceModule's defaults
    assert training["stage"] == "finetune" and training["checkpoint"] == str(checkpoint) and training["steps"] == 3
    assert training["data"]["context_tokens"] == 48 and "_instantiator" not in training["hyperparameters"]
    assert {k: training["hyperparameters"][k] for k in ("alpha", "policy", "samples", "lr")} == {
        "alpha": 0.5,
        "policy": "row_level",
        "samples": 3,
        "lr": 0.01,
    }
    assert "bce_weight" not in training["hyperparameters"]
    assert training["started_from"] == {"predictor": str(tiny / "supervised"), "training": {"stage": "fit", "seed": 7}}
    assert not torch.equal(tuned.mlp.w1.weight, supervised.mlp.w1.weight)  # it trained
    torch.testing.assert_close(tuned.mlp.scalar_norm.running_var, supervised.mlp.scalar_norm.running_var)
    resumed = PolicyGradientModule(predictor=str(checkpoint), model=str(tiny / "tiny-llama"))  # a .ckpt starts too
    torch.testing.assert_close(resumed.model.w1.weight, tuned.mlp.w1.weight)
    again = _finetune_args(tiny, tmp_path / "again", "--model.predictor", str(checkpoint), "--trainer.max_steps", "1",
                           "--model.retrieve", "0.25")  # fmt: skip
    assert run_cli(again) == 0  # and through the CLI (its instantiation once lost the checkpoint's collection),
    # for a two-tier store (a quarter of the context read back)
    lm = load_model(str(tiny / "tiny-llama"))
    item = RolloutItem(random_prompt(40, seed=5)[0], 32, CORPUS)
    kept = selector_keep(lm.model, item, LearnedSelector(predictor=tmp_path / "exported"), 8, MANAGED)
    assert torch.isfinite(rollout(lm.model, item, kept[None], MANAGED).nll).all()


def test_finetune_progress_bar_counts_steps_of_max_steps(tiny, tmp_path, monkeypatch):
    """One bar over the run in optimiser steps (3 steps over 2 epochs of 2 contexts here), not the
    stock bar's batches of an epoch under "Epoch 0/-2"."""
    from atskv.rl.training import StepProgressBar

    at_end = []  # the bar's tasks and the epoch when training ends
    monkeypatch.setattr(StepProgressBar, "on_train_end",
                        lambda self, trainer, module: at_end.append((self.progress.tasks, trainer.current_epoch)))
    args = _finetune_args(tiny, tmp_path, "--data.windows", "2", "--data.batch_size", "1",
                          "--trainer.enable_progress_bar", "true")
    assert run_cli(args) == 0
    ((task,), epochs) = at_end[0]  # Lightning counts the epoch at max_steps as done: two ran
    assert (task.description, task.completed, task.total, epochs) == ("steps", 3, 3, 2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model.alpha", "1.5"], r"alpha .* must lie in \[0, 1\]"),
        (["--model.policy", "gumbel_topk", "--model.budget", "48"], "keeps the whole context of 48 tokens"),
        (["--model.policy", "gumbel_topk", "--model.budget", "0"], "at least 1 token"),
        (["--model.policy", "topk"], "unknown policy 'topk'"),
    ],
)
def test_bad_finetune_input_fails_before_loading(tiny, tmp_path, extra, message, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("atskv.models.load_model", refuse)
    assert run_cli(_finetune_args(tiny, tmp_path, *extra)) == 2
    assert re.search(message, capsys.readouterr().err)
