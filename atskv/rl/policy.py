"""Retention policies over the predictor's logits of one decision: which context tokens each
managed layer and KV head keeps at the end of the prompt.

Logits are `[*rows, N]` (rows: managed layers x KV heads; N: the context tokens 0..t). Samples
carry a leading sample dim K. Every policy divides logits by a `temperature` first (s = l / T).

- `BernoulliPolicy`: token i is kept with p_i = sigmoid(s_i), independently; memory varies with
  the sample. Log-probability and entropy are exact; `greedy` keeps p_i > 0.5 (l_i > 0).
- `GumbelTopKPolicy(budget)`: k tokens drawn without replacement with probability proportional
  to exp(s) among those left (Plackett-Luce), sampled in one shot by perturbing s with Gumbel
  noise and taking the top k (Kool et al., 2019, "Stochastic Beams and Where to Find
  Them", arXiv:1903.06059); memory is fixed at k. The log-probability is
  exact for the *ordered* selection it sampled (the unordered set would need a sum over k!
  orders): sum_j s_(j) - log sum_{i not yet drawn} exp(s_i). The normaliser after j draws is
  the mass of the tokens never drawn plus that of draws j..k, both sums of positive terms (a
  reverse cumulative logsumexp), so it does not lose precision as the mass left shrinks.
  `greedy` is the top k of the logits, what `LearnedSelector` keeps.
- `RowLevelPolicy`: explores per row instead of per token. Each row draws a level z ~ N(c, 1),
  c the mean of its s, and keeps the tokens with s_i - c + z > 0: the predictor's ranking within
  the row is kept, what is sampled is how much each layer and KV head keeps. Why: with one
  Bernoulli decision per token the REINFORCE estimate's variance grows with the number of
  decisions (~170K per context for SmolLM2 at 2K) while its signal does not, so the estimate is
  noise (docs/results/kernel-notes.md; the GPU runs in docs/results.md); here a context has only
  rows-many actions (84 for SmolLM2). The log-probability is the Gaussian density of the levels
  (its gradient reaches the logits through c); a token is kept with probability Phi(s_i), so
  E[memory] = mean(Phi(s)) exactly; `greedy` keeps s_i > 0 (z = c), as Bernoulli's.

`expected_memory` is E[retained fraction] as a differentiable function of the logits, so the
reward's memory term enters the loss with its exact gradient instead of a REINFORCE estimate
(`atskv.rl.training`): for Bernoulli it is the mean keep probability, mean(sigmoid(s)); for
Gumbel top-k memory is k / N whatever is sampled, a constant with no gradient, so only
performance is learned there.

Entropy is in nats per token decision (a row's entropy divided by N, averaged over rows), so
its weight does not depend on the context length. For Plackett-Luce it is an estimate: along
each sampled order, the sum of the entropies of the j-th draw's distribution over the tokens
left. By the chain rule its expectation is the exact entropy of the ordered selection.

`keep_marginal_logits` gives a per-token keep probability for the KL to the supervised
predictor (`marginal_kl`): exact for Bernoulli; for Plackett-Luce the marginal has no closed
form and is approximated by sigmoid(s_i - c), c half-way between the k-th and (k+1)-th largest
s of the row, which is invariant to shifting a row's logits, as the policy is, and puts about k
tokens above 1/2; for the row-level policy it is exact, Phi(s_i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atskv.budget import check_budget


@dataclass(frozen=True)
class Selection:
    """Sampled retention: `keep` `[K, *rows, N]` bool; `order` `[K, *rows, k]`: the tokens of a
    Plackett-Luce sample in the order drawn; `levels` `[K, *rows]`: a row-level sample's levels."""

    keep: torch.Tensor
    order: torch.Tensor | None = None
    levels: torch.Tensor | None = None

    @property
    def memory(self) -> torch.Tensor:
        """`[K]`: retained fraction of the tokens, over all rows."""
        return self.keep.flatten(1).float().mean(1)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"the policy's temperature must be positive, got {temperature}")


@dataclass(frozen=True)
class BernoulliPolicy:
    """Keep each token independently with probability sigmoid(logit / temperature)."""

    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)

    def check(self, context_tokens: int) -> None:
        """Any context can be decided on (memory is free)."""

    def sample(self, logits: torch.Tensor, num_samples: int, generator: torch.Generator | None = None) -> Selection:
        p = torch.sigmoid(logits.detach().float() / self.temperature)
        u = torch.rand((num_samples, *p.shape), generator=generator, device=p.device)
        return Selection(u < p)

    def log_prob(self, logits: torch.Tensor, selection: Selection) -> torch.Tensor:
        s = logits.float() / self.temperature
        lp = torch.where(selection.keep, F.logsigmoid(s), F.logsigmoid(-s))
        return lp.flatten(1).sum(1)

    def entropy(self, logits: torch.Tensor, selection: Selection | None = None) -> torch.Tensor:
        """Exact mean binary entropy per token (`selection` is not needed)."""
        s = logits.float() / self.temperature
        p = torch.sigmoid(s)
        return -(p * F.logsigmoid(s) + (1 - p) * F.logsigmoid(-s)).mean()

    def expected_memory(self, logits: torch.Tensor) -> torch.Tensor:
        """E[retained fraction] = mean keep probability (every row has the same N tokens)."""
        return torch.sigmoid(logits.float() / self.temperature).mean()

    def keep_marginal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float() / self.temperature

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits > 0


@dataclass(frozen=True)
class GumbelTopKPolicy:
    """Keep `budget` tokens per row (`check_budget`: an int, or a fraction of the context in (0, 1), rounded up),
    drawn without replacement in proportion to exp(logit / temperature) (Plackett-Luce)."""

    budget: int | float
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)
        check_budget(self.budget)

    def tokens(self, context_tokens: int) -> int:
        """k for a context of N tokens."""
        return self.budget if isinstance(self.budget, int) else max(1, math.ceil(self.budget * context_tokens))

    def check(self, context_tokens: int) -> None:
        """Refuse a context in which keeping k tokens is no choice at all (k >= N)."""
        if self.tokens(context_tokens) >= context_tokens:
            raise ValueError(
                f"a Gumbel top-k budget of {self.tokens(context_tokens)} tokens keeps the whole context of "
                f"{context_tokens} tokens: there is nothing to choose; use a budget below the context length"
            )

    def sample(self, logits: torch.Tensor, num_samples: int, generator: torch.Generator | None = None) -> Selection:
        n = logits.shape[-1]
        self.check(n)
        s = logits.detach().float() / self.temperature
        exponential = torch.empty((num_samples, *s.shape), device=s.device).exponential_(generator=generator)
        order = (s - exponential.log()).topk(self.tokens(n), dim=-1).indices  # Gumbel(0, 1) = -log Exp(1)
        return Selection(torch.zeros_like(exponential, dtype=torch.bool).scatter_(-1, order, True), order)

    def _drawn(self, logits: torch.Tensor, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """s (in the dtype of `logits`) broadcast to the samples `[K, *rows, N]`, and s of the drawn
        tokens in the order drawn `[K, *rows, k]`."""
        if selection.order is None:
            raise ValueError("a Plackett-Luce log-probability needs the order of the draws (a GumbelTopKPolicy sample)")
        s = (logits / self.temperature).expand(selection.keep.shape)
        return s, s.gather(-1, selection.order)

    def log_prob(self, logits: torch.Tensor, selection: Selection) -> torch.Tensor:
        s, drawn = self._drawn(logits.float(), selection)
        never = s.masked_fill(selection.keep, -math.inf).logsumexp(-1, keepdim=True)  # tokens never drawn
        still = drawn.flip(-1).logcumsumexp(-1).flip(-1)  # draws j..k
        return (drawn - torch.logaddexp(still, never)).flatten(1).sum(1)

    def entropy(self, logits: torch.Tensor, selection: Selection) -> torch.Tensor:
        """Estimate per token: the entropies of the successive draws along each sampled order,
        summed, averaged over samples and rows, divided by N (float64: exp of the shifted logits)."""
        s, drawn = self._drawn(logits.double(), selection)
        top = s.amax(-1, keepdim=True).detach()
        e, e_drawn = (s - top).exp(), (drawn - top).exp()
        mass = (e * (~selection.keep)).sum(-1, keepdim=True) + e_drawn.flip(-1).cumsum(-1).flip(-1)
        weighted = (e * (s - top) * (~selection.keep)).sum(-1, keepdim=True)
        weighted = weighted + (e_drawn * (drawn - top)).flip(-1).cumsum(-1).flip(-1)
        per_draw = mass.log() - weighted / mass  # H = log Z - E[s], both shifted by `top`
        return (per_draw.sum(-1).mean() / s.shape[-1]).float()

    def expected_memory(self, logits: torch.Tensor) -> torch.Tensor:
        """k / N, fixed by the budget: a constant (no gradient)."""
        n = logits.shape[-1]
        return torch.tensor(self.tokens(n) / n, device=logits.device)

    def keep_marginal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        s = logits.float() / self.temperature
        k = self.tokens(s.shape[-1])
        kth = s.topk(k + 1, dim=-1).values[..., -2:].mean(-1, keepdim=True)
        return s - kth

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        k = self.tokens(logits.shape[-1])
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)


@dataclass(frozen=True)
class RowLevelPolicy:
    """Each row (managed layer x KV head) draws a level z ~ N(mean(s), 1) and keeps the tokens
    with s_i - mean(s) + z > 0: the ranking is the predictor's, the amount kept is sampled."""

    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)

    def check(self, context_tokens: int) -> None:
        """Any context can be decided on (memory is free)."""

    def _centred(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = logits.float() / self.temperature
        return s, s.mean(-1)

    def sample(self, logits: torch.Tensor, num_samples: int, generator: torch.Generator | None = None) -> Selection:
        s, centre = self._centred(logits.detach())
        noise = torch.randn((num_samples, *centre.shape), generator=generator, device=s.device)
        levels = centre + noise
        return Selection((s + noise.unsqueeze(-1)) > 0, levels=levels)  # s_i - c + z = s_i + noise

    def log_prob(self, logits: torch.Tensor, selection: Selection) -> torch.Tensor:
        if selection.levels is None:
            raise ValueError("a row-level log-probability needs the sampled levels (a RowLevelPolicy sample)")
        _, centre = self._centred(logits)
        density = -0.5 * (selection.levels - centre) ** 2 - 0.5 * math.log(2 * math.pi)
        return density.flatten(1).sum(1)

    def entropy(self, logits: torch.Tensor, selection: Selection | None = None) -> torch.Tensor:
        """A row's Gaussian entropy, 0.5 log(2 pi e), per token decision: a constant."""
        return torch.tensor(0.5 * math.log(2 * math.pi * math.e) / logits.shape[-1], device=logits.device)

    def expected_memory(self, logits: torch.Tensor) -> torch.Tensor:
        """P(keep i) = P(z > c - s_i) = Phi(s_i) for z ~ N(c, 1): the mean of Phi(s)."""
        return torch.special.ndtr(logits.float() / self.temperature).mean()

    def keep_marginal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logit(Phi(s)), computed as log Phi(s) - log Phi(-s) (no rounding near 0 or 1)."""
        s = logits.float() / self.temperature
        return torch.special.log_ndtr(s) - torch.special.log_ndtr(-s)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits > 0


Policy = BernoulliPolicy | GumbelTopKPolicy | RowLevelPolicy
POLICIES = {"bernoulli": BernoulliPolicy, "gumbel_topk": GumbelTopKPolicy, "row_level": RowLevelPolicy}


def make_policy(name: str, budget: int | float = 0.1, temperature: float = 1.0) -> Policy:
    """A policy by name; `budget` applies to `gumbel_topk` only."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return GumbelTopKPolicy(budget, temperature) if name == "gumbel_topk" else POLICIES[name](temperature)


def marginal_kl(policy: Policy, logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Mean per-token KL(q || q_ref) of the keep marginals (Bernoulli distributions) of `logits`
    and of the frozen reference's `reference_logits`, under `policy`."""
    a = policy.keep_marginal_logits(logits)
    b = policy.keep_marginal_logits(reference_logits)
    p = torch.sigmoid(a)
    return (p * (F.logsigmoid(a) - F.logsigmoid(b)) + (1 - p) * (F.logsigmoid(-a) - F.logsigmoid(-b))).mean()
