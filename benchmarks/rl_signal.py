"""How much of `atskv finetune`'s policy gradient is signal: on a few training contexts, the
gradient of `atskv.rl.training.policy_loss` with respect to the logits is drawn REPEATS times
with fresh samples, and split into its parts: the REINFORCE estimate of the performance term,
the exact gradient of the expected memory, and the entropy bonus.

The number that decides whether alpha can act is the component along the all-ones direction of
the logits (raising or lowering every keep probability, i.e. memory): the performance part's mean
over the repeats against its spread, beside the memory part, (1 - alpha) mean(p (1 - p)), which
is exact and the same in every draw, and the entropy bonus' part. The cosine of the whole
gradients at the first two alphas (same samples) says how differently they point.

    python benchmarks/rl_signal.py PREDICTOR --model MODEL [--context_tokens 2048]
"""

from __future__ import annotations

import statistics

import torch

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
    from atskv.rl.training import PolicyGradientModule, RolloutData, policy_loss

    module = PolicyGradientModule(predictor=predictor, model=model, samples=samples)
    base, policy = module.frozen.base, module.policy
    items = RolloutData(module.tokenizer, windows=windows, context_tokens=context_tokens, task_examples=1).items()
    for item in items:
        features = context_features(base, item.ids[: item.context], module.layers, module.frozen.type_table)
        logits = predictor_logits(module.model, features).detach().requires_grad_(True)
        reference = logits.detach()
        p = torch.sigmoid(logits.detach())
        performance_ones, cosines, nll_std, memory_std = [], [], [], []
        for _ in range(repeats):
            selection = policy.sample(logits, samples)
            result = rollout(base, item, selection.keep, module.layers)
            nll_std.append(result.nll.std().item())
            memory_std.append(selection.memory.std().item())
            loss, _ = policy_loss(policy, logits, selection, -result.nll, 1.0, reference, 0.0, 0.0)
            (performance,) = torch.autograd.grad(loss, logits)  # the REINFORCE part alone, alpha = 1
            performance_ones.append(performance.sum().item())
            grads = []
            for alpha in alphas[:2]:
                loss, _ = policy_loss(policy, logits, selection, -result.nll, alpha, reference, entropy_weight, 0.0)
                grads.append(torch.autograd.grad(loss, logits)[0].flatten())
            cosines.append(torch.nn.functional.cosine_similarity(*grads, dim=0).item())
        (entropy_grad,) = torch.autograd.grad(-entropy_weight * policy.entropy(logits), logits)
        mean, spread = statistics.fmean(performance_ones), statistics.stdev(performance_ones)
        print(f"{item.source}: T={item.context}, D={logits.numel()}, mean p={p.mean():.3f}, NLL std over K "
              f"{statistics.fmean(nll_std):.3g}, memory std over K {statistics.fmean(memory_std):.2g}")
        print(f"  cosine of the logit gradients at alpha {alphas[0]} and {alphas[1]} (same samples): "
              f"{statistics.fmean(cosines):.4f}")
        print(f"  along all-ones (loss gradient; + lowers keep probabilities): entropy bonus "
              f"{entropy_grad.sum().item():+.3g}; REINFORCE performance at alpha 1 {mean:+.3g} ± {spread:.3g} "
              f"(over {repeats} draws)")
        for alpha in alphas:
            exact = (1 - alpha) * (p * (1 - p)).mean().item()
            print(f"  alpha {alpha}: exact memory term {exact:+.3g}, performance term {alpha * mean:+.3g} "
                  f"± {alpha * spread:.3g}")


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main)
