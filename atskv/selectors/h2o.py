"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", arXiv:2306.14048): heavy hitters by accumulated attention, plus a recent window.

Each token accumulates the attention mass it receives from every query (summed over the group's
heads, as the hook works per KV head). Default from the paper: half the budget for heavy
hitters, half for the most recent tokens. Query-agnostic and evicting.
"""

from dataclasses import dataclass

import torch

from atskv.attention import check_prompt_sample
from atskv.budget import resolve_budget
from atskv.kernels.evict import newest_share
from atskv.selectors.base import LayerView, Selector


@dataclass
class H2OSelector(Selector):
    name = "h2o"
    fast_path = True
    evicts = True
    needs_attention = True
    recent_fraction: float = 0.5
    prompt_sample: int = 1  # the prompt's mass from every s-th query of a chunk (`sampled_queries`)

    def __post_init__(self):
        check_prompt_sample(self.prompt_sample)

    def observe(self, view: LayerView, attention_mass: torch.Tensor) -> None:
        view.layer.slot_tensor("h2o").add_(attention_mass)

    def mass_accumulator(self, view: LayerView) -> torch.Tensor:
        return view.layer.slot_tensor("h2o")

    def eviction_scores(self, view: LayerView) -> tuple[torch.Tensor, float]:
        """The accumulated mass, the recent window left to the eviction kernel: `scores` in one
        kernel instead of ~8."""
        return view.layer.slot_tensor("h2o"), self.recent_fraction

    def scores(self, view: LayerView):
        budget = resolve_budget(view.budget, view.context[:, :, -1:])
        is_recent = newest_share(view.slot_pos, view.valid[:, :, -1], budget, self.recent_fraction)
        return torch.where(is_recent, torch.inf, view.layer.slot_tensor("h2o")).unsqueeze(2)
