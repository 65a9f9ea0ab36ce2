"""The adaptive-sparsity controller against direct references: torch.quantile per row, the
closed-form momentum decay, hysteresis, the hard cap under random and adversarial inputs."""

from __future__ import annotations

import math

import pytest
import torch

from atskv.runtime.reference.sparsity import INITIAL_MOMENTUM, LayerPolicy, SparsityBudget, SparsityManager


def fixed_q(q: float, **kw) -> LayerPolicy:
    return LayerPolicy(q_min=q, q_max=q, **kw)


def ragged_active(g: torch.Generator, b: int, h: int, s: int) -> torch.Tensor:
    """Active masks with every count from 0 to s somewhere (0, 1 and s forced in)."""
    counts = torch.randint(0, s + 1, (b, h), generator=g)
    counts.view(-1)[:3] = torch.tensor([0, 1, s])
    order = torch.rand(b, h, s, generator=g).argsort(-1)
    return order < counts.unsqueeze(-1)


def one_row(scores, positions=None, active=None):
    """Lift a 1-D row to [1, 1, S] with its default masks."""
    s = torch.as_tensor(scores, dtype=torch.float32).view(1, 1, -1)
    n = s.shape[-1]
    pos = torch.arange(n).view(1, 1, n) if positions is None else positions
    act = torch.ones(1, 1, n, dtype=torch.bool) if active is None else active
    return s, act, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_quantile_matches_torch_quantile_per_row(dtype):
    g = torch.Generator().manual_seed(0)
    b, h, s = 3, 5, 37
    scores = torch.rand(b, h, s, generator=g, dtype=dtype)
    active = ragged_active(g, b, h, s)
    current = torch.randint(0, 80, (b, h), generator=g)
    policy = LayerPolicy(beta=1.5, q_min=0.2, q_max=0.85, promote_margin=0.1)
    mgr = SparsityManager(policy, SparsityBudget(64, 40, recent=16))
    tau, tau_promote = mgr.thresholds(0, scores, active, current)
    q = mgr.quantile_level(0, current)
    assert tau.shape == tau_promote.shape == (b, h, 1)
    for i in range(b):
        for j in range(h):
            row = scores[i, j][active[i, j]]
            if row.numel() == 0:
                assert tau[i, j, 0] == tau_promote[i, j, 0] == -math.inf
                continue
            want = 1.5 * torch.quantile(row, q[i, j].item())
            want_p = 1.5 * torch.quantile(row, min(1.0, q[i, j].item() + 0.1))
            torch.testing.assert_close(tau[i, j, 0].to(dtype), want)
            torch.testing.assert_close(tau_promote[i, j, 0].to(dtype), want_p)
    assert (tau_promote >= tau).all()


def test_quantile_level_moves_from_q_min_to_q_max_and_saturates():
    mgr = SparsityManager(LayerPolicy(q_min=0.3, q_max=0.9), SparsityBudget(max_active=200, target_active=100))
    current = torch.tensor([[0, 25, 50, 100, 150, 10_000]])
    q = mgr.quantile_level(7, current)
    torch.testing.assert_close(q, torch.tensor([[0.3, 0.45, 0.6, 0.9, 0.9, 0.9]]))
    # and the threshold follows it: fuller rows cut higher on the same scores
    scores = torch.linspace(0, 1, 101).expand(1, 6, 101)
    tau, _ = mgr.thresholds(7, scores, torch.ones_like(scores, dtype=torch.bool), current)
    torch.testing.assert_close(tau.view(-1), q.view(-1))
    # the default `current` is the active count
    active = torch.arange(101).expand(1, 1, 101) < 50
    tau_default, _ = mgr.thresholds(7, scores[:, :1], active)
    tau_explicit, _ = mgr.thresholds(7, scores[:, :1], active, torch.tensor([[50]]))
    assert tau_default.item() == tau_explicit.item() == pytest.approx(0.6 * 49 / 100)


def test_target_defaults_to_cap():
    assert SparsityBudget(max_active=128).target_active == 128


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.7, 0.8, 0.9])
def test_momentum_keeps_a_single_dip_and_demotes_after_the_exact_step_count(lam):
    # token 5 scores lowest every step; fixed q = 0.5 puts it below tau; nothing protected
    mgr = SparsityManager(fixed_q(0.5, momentum=lam), SparsityBudget(max_active=20, sinks=0, recent=0))
    scores, active, pos = one_row(torch.linspace(0.1, 1.0, 20).index_fill(0, torch.tensor([5]), 0.0))
    steps = 1 if lam == 0.0 else math.ceil(math.log(0.5) / math.log(lam))  # first k with lam**k <= 0.5
    if lam == 0.8:
        assert steps == 4
    m = torch.full(scores.shape, INITIAL_MOMENTUM)
    for k in range(1, steps + 1):
        d = mgr.decide(0, scores, active, pos, m, seen=20)
        m = d.momentum
        assert m[0, 0, 5].item() == pytest.approx(lam**k)
        assert bool(d.keep[0, 0, 5]) == (k < steps), f"step {k} of {steps}"
        assert bool(d.demote[0, 0, 5]) == (k == steps)
    # a token above tau recovers: one dip then a high step
    m = torch.full(scores.shape, INITIAL_MOMENTUM)
    d = mgr.decide(0, scores, active, pos, m, seen=20)
    high = scores.clone()
    high[0, 0, 5] = 2.0
    d = mgr.decide(0, high, active, pos, d.momentum, seen=20)
    assert d.keep[0, 0, 5] and d.momentum[0, 0, 5].item() == pytest.approx(lam * lam + (1 - lam))


def test_momentum_of_inactive_slots_is_left_alone():
    mgr = SparsityManager(fixed_q(0.5), SparsityBudget(max_active=8, sinks=0, recent=0))
    scores, _, pos = one_row(torch.rand(8))
    active = torch.tensor([[[True] * 4 + [False] * 4]])
    m = torch.full(scores.shape, 0.3)
    d = mgr.decide(0, scores, active, pos, m, seen=8)
    assert (d.momentum[..., 4:] == 0.3).all() and not (d.momentum[..., :4] == 0.3).any()
    assert not (d.keep | d.demote)[..., 4:].any()


def test_hysteresis_blocks_a_just_demoted_token_between_tau_and_tau_promote():
    budget = SparsityBudget(max_active=32, sinks=0, recent=0)
    mgr = SparsityManager(fixed_q(0.5, promote_margin=0.2), budget)
    scores, active, pos = one_row(torch.linspace(0.0, 1.0, 21))
    tau, _ = mgr.thresholds(0, scores, active)
    assert tau.item() == pytest.approx(0.5)
    # token 9 sits just below tau with a momentum about to fall under 0.5: demoted now
    scores[0, 0, 9] = tau.item() - 1e-3
    m = torch.full(scores.shape, INITIAL_MOMENTUM)
    m[0, 0, 9] = 0.6
    d = mgr.decide(0, scores, active, pos, m, seen=21)
    assert d.demote[0, 0, 9] and d.keep.sum() == 20
    # next refresh over what stayed; the demoted token comes back as a candidate just above tau
    d2 = mgr.decide(0, scores, d.keep, pos, d.momentum, seen=21)
    assert d2.tau_promote.item() > d2.tau.item() + 0.1
    between = torch.tensor([[[(d2.tau.item() + d2.tau_promote.item()) / 2, d2.tau_promote.item() + 1e-3]]])
    valid = torch.ones_like(between, dtype=torch.bool)
    room = torch.tensor([[5]])
    assert SparsityManager.promote(between, valid, d2.tau_promote, room).tolist() == [[[False, True]]]
    # without the margin the same score would flap straight back
    flat = SparsityManager(fixed_q(0.5, promote_margin=0.0), budget)
    d3 = flat.decide(0, scores, d.keep, pos, d.momentum, seen=21)
    assert SparsityManager.promote(between[..., :1], valid[..., :1], d3.tau_promote, room).item()


def test_protected_sinks_and_recent_are_kept_at_score_zero_and_momentum_zero():
    budget = SparsityBudget(max_active=12, sinks=4, recent=8)
    mgr = SparsityManager(fixed_q(0.1), budget)
    s, seen = 40, 40
    scores = torch.ones(2, 3, s)
    positions = torch.arange(s).expand(2, 3, s).clone()
    protected = (positions < 4) | (positions >= seen - 8)
    scores[protected] = 0.0
    active = torch.ones(2, 3, s, dtype=torch.bool)
    m = torch.where(protected, 0.0, INITIAL_MOMENTUM)
    d = mgr.decide(0, scores, active, positions, m, seen=seen)
    # the cap equals sinks + recent: exactly the protected tokens stay, all high scorers go
    assert torch.equal(d.keep, protected)
    assert torch.equal(d.demote, ~protected)
    assert (d.free == 0).all()
    # slots shuffled (positions not in slot order): same tokens
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(1))
    d = mgr.decide(0, scores[..., perm], active, positions[..., perm], m[..., perm], seen=seen)
    assert torch.equal(d.keep, protected[..., perm])


def test_hard_cap_never_exceeded_over_random_steps():
    g = torch.Generator().manual_seed(0)
    b, h, s = 2, 3, 96
    budget = SparsityBudget(max_active=40, target_active=30, sinks=4, recent=16)
    mgr = SparsityManager({0: LayerPolicy(q_min=0.0, q_max=0.3, momentum=0.9), 1: LayerPolicy()}, budget)
    momentum = torch.rand(b, h, s, generator=g)
    for step in range(200):
        seen = int(torch.randint(s, 4 * s, (1,), generator=g))
        # unique positions per row, mixing sinks, recent and middle tokens across the slots
        positions = torch.rand(b, h, seen, generator=g).argsort(-1)[..., :s]
        positions[..., :4] = torch.arange(4)
        positions[..., 4:20] = torch.arange(seen - 16, seen)
        positions = positions.gather(-1, torch.rand(b, h, s, generator=g).argsort(-1))
        active = torch.rand(b, h, s, generator=g) < torch.rand(b, h, 1, generator=g) * 1.2
        if step % 3 == 0:  # adversarial: protected tokens score 0, all others tie or score 1
            protected_pos = (positions < 4) | (positions >= seen - 16)
            scores = torch.where(protected_pos, 0.0, 1.0 if step % 2 else 0.7)
        else:
            scores = torch.rand(b, h, s, generator=g)
        current = torch.randint(0, 100, (b, h), generator=g)
        d = mgr.decide(step % 2, scores, active, positions, momentum, seen=seen, current=current)
        kept = d.keep.sum(-1)
        assert (kept <= budget.max_active).all()
        assert torch.equal(d.free, budget.max_active - kept)
        assert not (d.keep & ~active).any() and torch.equal(d.demote, active & ~d.keep)
        protected = active & ((positions < 4) | (positions >= seen - 16))
        assert not (protected & ~d.keep).any()
        # where the cap cut, every kept unprotected token scores >= every cut token that wanted to stay
        want = active & (protected | (d.momentum > 0.5))
        cut = want & ~d.keep
        assert ((kept == budget.max_active) | ~cut.any(-1)).all()
        lowest_kept = scores.masked_fill(~(d.keep & ~protected), math.inf).amin(-1)
        highest_cut = scores.masked_fill(~cut, -math.inf).amax(-1)
        assert (lowest_kept >= highest_cut).all()
        # promotion into the room left: never more than `free`, only above tau_promote, the best ones
        cand = torch.rand(b, h, 24, generator=g)
        valid = torch.rand(b, h, 24, generator=g) < 0.8
        take = SparsityManager.promote(cand, valid, d.tau_promote, d.free)
        assert (take.sum(-1) <= d.free).all() and (kept + take.sum(-1) <= budget.max_active).all()
        assert not (take & ~(valid & (cand > d.tau_promote))).any()
        left = valid & (cand > d.tau_promote) & ~take
        assert (cand.masked_fill(~take, math.inf).amin(-1) >= cand.masked_fill(~left, -math.inf).amax(-1)).all()
        assert ((take.sum(-1) == d.free) | ~left.any(-1)).all()
        momentum = torch.where(active, d.momentum, torch.rand(b, h, s, generator=g))


def test_cap_ties_go_to_the_newer_token_whatever_the_slot_order():
    mgr = SparsityManager(fixed_q(0.0), SparsityBudget(max_active=3, sinks=0, recent=0))
    scores = torch.full((1, 1, 6), 0.5)
    positions = torch.tensor([[[3, 0, 5, 1, 4, 2]]])
    active = torch.ones(1, 1, 6, dtype=torch.bool)
    d = mgr.decide(0, scores, active, positions, torch.ones(1, 1, 6), seen=6)
    assert sorted(positions[d.keep].tolist()) == [3, 4, 5]


def test_per_layer_policies_differ():
    budget = SparsityBudget(max_active=64, sinks=0, recent=0)
    mgr = SparsityManager({3: fixed_q(0.25), 5: fixed_q(0.75, beta=0.5)}, budget)
    scores, active, _ = one_row(torch.linspace(0, 1, 41))
    assert mgr.thresholds(3, scores, active)[0].item() == pytest.approx(0.25)
    assert mgr.thresholds(5, scores, active)[0].item() == pytest.approx(0.375)
    assert mgr.policy(5).beta == 0.5
    with pytest.raises(ValueError, match=r"no LayerPolicy for layer 4; policies cover layers \[3, 5\]"):
        mgr.thresholds(4, scores, active)
    shared = SparsityManager(fixed_q(0.25), budget)
    assert shared.policy(0) is shared.policy(29)


def test_promote_prefers_the_best_and_fills_an_empty_row():
    cand = torch.tensor([[[0.2, 0.9, 0.6, 0.95, 0.1], [0.7, 0.8, 0.3, 0.9, 0.6]]])
    valid = torch.tensor([[[True, True, True, False, True], [True] * 5]])
    tau_p = torch.tensor([[[0.15], [-math.inf]]])  # second row: nothing active yet
    take = SparsityManager.promote(cand, valid, tau_p, torch.tensor([[2, 3]]))
    assert take.tolist() == [[[False, True, True, False, False], [True, True, False, True, False]]]
    mgr = SparsityManager(LayerPolicy(), SparsityBudget(8, sinks=0, recent=0))
    empty = torch.zeros(1, 1, 4, dtype=torch.bool)
    tau, tau_promote = mgr.thresholds(0, torch.rand(1, 1, 4), empty)
    assert tau.item() == tau_promote.item() == -math.inf


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(momentum=1.0), r"momentum \(lambda\) must lie in \[0, 1\), got 1.0"),
        (dict(momentum=-0.1), r"momentum \(lambda\) must lie in \[0, 1\)"),
        (dict(q_min=0.8, q_max=0.6), r"need 0 <= q_min <= q_max <= 1, got q_min=0.8, q_max=0.6"),
        (dict(q_max=1.2), r"q_min <= q_max <= 1"),
        (dict(beta=0.0), r"beta must be a finite number > 0"),
        (dict(beta=math.nan), r"beta must be a finite number > 0"),
        (dict(promote_margin=1.0), r"promote_margin is a quantile gap in \[0, 1\)"),
    ],
)
def test_bad_policy_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerPolicy(**kwargs)


def test_bad_budget_raises():
    with pytest.raises(ValueError, match=r"max_active=50 cannot hold the 4 sink \+ 64 recent tokens .* at least 68"):
        SparsityBudget(max_active=50)
    with pytest.raises(ValueError, match=r"target_active must lie in \[1, max_active=100\], got 101"):
        SparsityBudget(max_active=100, target_active=101)
    with pytest.raises(ValueError, match="sinks and recent must be >= 0"):
        SparsityBudget(max_active=100, sinks=-1)
    with pytest.raises(TypeError, match="max_active must be an int"):
        SparsityBudget(max_active=100.0)
    with pytest.raises(TypeError, match="LayerPolicy"):
        SparsityManager({0: dict(q_min=0.1)}, SparsityBudget(100))


def test_mismatched_shapes_raise():
    mgr = SparsityManager(LayerPolicy(), SparsityBudget(100))
    scores = torch.rand(1, 2, 5)
    ok = dict(
        active=torch.ones(1, 2, 5, dtype=torch.bool),
        positions=torch.arange(5).expand(1, 2, 5),
        momentum=torch.ones(1, 2, 5),
    )
    for name, bad in [
        ("active", torch.ones(1, 2, 6, dtype=torch.bool)),
        ("positions", torch.arange(5).expand(1, 1, 5)),
        ("momentum", torch.ones(2, 5)),
    ]:
        with pytest.raises(ValueError, match=rf"{name} must have the shape of the scores \[1, 2, 5\]"):
            mgr.decide(0, scores, **{**ok, name: bad}, seen=5)
    with pytest.raises(ValueError, match="active must be a bool mask"):
        mgr.decide(0, scores, **{**ok, "active": torch.ones(1, 2, 5)}, seen=5)
    with pytest.raises(ValueError, match="positions must be integer and momentum float"):
        mgr.decide(0, scores, **{**ok, "positions": torch.zeros(1, 2, 5)}, seen=5)
    with pytest.raises(ValueError, match=r"scores must be \[B, Hkv, S\]"):
        mgr.thresholds(0, scores[0], ok["active"][0])
    with pytest.raises(ValueError, match=r"current must be \[B, Hkv\] = \[1, 2\]"):
        mgr.thresholds(0, scores, ok["active"], torch.tensor([3]))
    with pytest.raises(ValueError, match=r"tau_promote must be \[B, Hkv, 1\] and free \[B, Hkv\]"):
        SparsityManager.promote(scores, ok["active"], torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long))


@pytest.mark.gpu
def test_decide_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(3)
    b, h, s = 2, 4, 300
    mgr = SparsityManager(LayerPolicy(), SparsityBudget(max_active=120, target_active=90, sinks=4, recent=32))
    scores = torch.rand(b, h, s, generator=g)
    active = torch.rand(b, h, s, generator=g) < 0.7
    positions = torch.rand(b, h, 400, generator=g).argsort(-1)[..., :s]
    momentum = torch.rand(b, h, s, generator=g)
    cpu = mgr.decide(0, scores, active, positions, momentum, seen=400)
    gpu = mgr.decide(0, scores.cuda(), active.cuda(), positions.cuda(), momentum.cuda(), seen=400)
    for name in ("keep", "demote", "momentum", "tau", "tau_promote", "free"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name))


@pytest.mark.parametrize("counted_parked", [True, False])
def test_with_parked_tokens_counted_the_tier_settles_at_the_top_share_of_the_context(counted_parked):
    """Static scores, repeated refreshes, demoted tokens leave: counting the parked tokens (total)
    the active tier converges to the top 1 - q of the whole context; over the active ones alone
    it keeps draining towards the protected tokens."""
    g = torch.Generator().manual_seed(0)
    n, q = 1000, 0.8
    manager = SparsityManager(fixed_q(q, momentum=0.5), SparsityBudget(max_active=n, sinks=0, recent=0))
    scores, active, positions = one_row(torch.rand(n, generator=g))
    momentum = torch.full(scores.shape, INITIAL_MOMENTUM)
    for _ in range(40):
        d = manager.decide(0, scores, active, positions, momentum, seen=n, total=n if counted_parked else None)
        active, momentum = d.keep, d.momentum
    kept = int(active.sum())
    if counted_parked:
        assert abs(kept - (1 - q) * n) <= 0.02 * n
        # and it is the top share: every kept token outscores every parked one
        assert scores[active].min() > scores[~active].max()
    else:
        assert kept < 0.05 * n


def test_reserve_frees_room_under_the_cap_from_the_lowest_unprotected_tokens():
    manager = SparsityManager(fixed_q(0.0), SparsityBudget(max_active=6, sinks=1, recent=1))
    scores, active, positions = one_row([0.0, 5.0, 1.0, 4.0, 3.0, 2.0, 0.5])  # 7 tokens, cap 6
    momentum = torch.full(scores.shape, INITIAL_MOMENTUM)
    plain = manager.decide(0, scores, active, positions, momentum, seen=7)
    reserved = manager.decide(0, scores, active, positions, momentum, seen=7, reserve=torch.tensor([[2]]))
    assert plain.keep.sum() == 6 and int(plain.free) == 0
    # 6 - 2 = 4 stay: sink (position 0) and recent (position 6), then the best others (5.0, 4.0)
    assert reserved.keep[0, 0].tolist() == [True, True, False, True, False, False, True]
    assert int(reserved.free) == 2
