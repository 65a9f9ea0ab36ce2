"""How much of `atskv finetune`'s policy gradient is signal: on a few training contexts, the
REINFORCE gradient of the loss with respect to the logits (as `atskv.rl.training.reinforce_loss`
computes it) is drawn REPEATS times with fresh samples, and compared with the exact gradient of
the expected memory term and with the entropy bonus' gradient.

The number that decides whether alpha can act is the component along the all-ones direction of
the logits (raising or lowering every keep probability, i.e. memory): its mean over the repeats
against its spread, and the exact memory term's value there, (1 - alpha) mean(p (1 - p)) / D.

    python benchmarks/rl_signal.py PREDICTOR --model MODEL [--context_tokens 2048]
"""

from __future__ import annotations

import statistics

import torch

from atskv.rl.reward import leave_one_out, reward
from atskv.rl.rollout import context_features, predictor_logits, rollout


def main(
    predictor: str,
    model: str = "smollm2-135m",
    context_tokens: int = 2048,
    windows: int = 2,
    samples: int = 8,
    repeats: int = 8,
    alphas: list[float] = [0.5, 0.97],  # noqa: B006 (read-only; a list for the CLI)
    entropy_weight: float = 1e-3,
) -> None:
    """
    Args:
        predictor: the supervised predictor (exported folder).
        model: the base model.
        context_tokens: T.
        windows: Austen windows to look at (plus one passkey and one needle prompt).
        samples: K per draw, as in training.
        repeats: independent draws of K samples per context.
        alphas: rewards to compare (same samples for each).
        entropy_weight: the entropy bonus' weight, as in training.
    """
    from atskv.rl.training import PolicyGradientModule, RolloutData

    module = PolicyGradientModule(predictor=predictor, model=model, samples=samples)
    base, policy = module.frozen.base, module.policy
    items = RolloutData(module.tokenizer, windows=windows, context_tokens=context_tokens, task_examples=1).items()
    for item in items:
        features = context_features(base, item.ids[: item.context], module.layers, module.frozen.type_table)
        logits = predictor_logits(module.model, features).detach().requires_grad_(True)
        d = logits.numel()
        p = torch.sigmoid(logits.detach())
        ones = {alpha: [] for alpha in alphas}
        cosines, nll_std, memory_std = [], [], []
        for _ in range(repeats):
            selection = policy.sample(logits, samples)
            result = rollout(base, item, selection.keep, module.layers)
            nll_std.append(result.nll.std().item())
            memory_std.append(selection.memory.std().item())
            grads = {}
            for alpha in alphas:
                rewards = reward(-result.nll, selection.memory, alpha)
                loss = -(leave_one_out(rewards) * policy.log_prob(logits, selection)).mean() / d
                (grads[alpha],) = torch.autograd.grad(loss, logits)
                ones[alpha].append(grads[alpha].sum().item())
            a, b = (grads[alpha].flatten() for alpha in alphas[:2])
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=0).item())
        (entropy_grad,) = torch.autograd.grad(-entropy_weight * policy.entropy(logits), logits)
        print(f"{item.source}: T={item.context}, D={d}, mean p={p.mean():.3f}, NLL std over K "
              f"{statistics.fmean(nll_std):.3g}, memory std over K {statistics.fmean(memory_std):.2g}")
        print(f"  cosine of the logit gradients at alpha {alphas[0]} and {alphas[1]} (same samples): "
              f"{statistics.fmean(cosines):.4f}")
        print(f"  entropy bonus along all-ones: {entropy_grad.sum().item():+.3g}")
        for alpha in alphas:
            exact = (1 - alpha) * (p * (1 - p)).mean().item() / d
            mean, spread = statistics.fmean(ones[alpha]), statistics.stdev(ones[alpha])
            print(f"  alpha {alpha}: REINFORCE along all-ones {mean:+.3g} ± {spread:.3g} (over {repeats} draws); "
                  f"exact memory term {exact:+.3g}")


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main)
