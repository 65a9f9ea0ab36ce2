"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469): keep the prompt tokens that the prompt's last queries attend to.

After the (dense) prefill, the attention of the last `window` queries is summed over those
queries and the group's heads, max-pooled along the tokens (`kernel`, to keep neighbourhoods),
and stored as each prompt token's score. Defaults from the paper's code: window 32, kernel 7,
max pooling. The observation window itself and every token generated after the prompt score
+inf, so the budget is spent on the prompt; tokens are evicted (real memory savings).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atskv.attention import grouped_probs
from atskv.selectors.base import LAST_QUERIES, LayerView, Selector


@dataclass
class SnapKVSelector(Selector):
    name = "snapkv"
    fast_path = True
    evicts = True
    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        check_window(self.window)

    def prefill(self, view: LayerView) -> None:
        view.layer.slot_tensor("snapkv", init=torch.inf).copy_(window_votes(view, self.window, self.kernel))

    def scores(self, view: LayerView):
        return view.layer.slot_tensor("snapkv", init=torch.inf).unsqueeze(2)


def window_votes(view: LayerView, window: int, kernel: int = 7) -> torch.Tensor:
    """SnapKV's score of every slot `[B, Hkv, S]` from a prompt `view`: the attention of its last
    `window` queries, summed over them and the group's heads and max-pooled over `kernel`
    neighbours; +inf for the window's own tokens."""
    w = min(window, view.query.shape[2])
    probs = grouped_probs(view.query[:, :, -w:], view.keys, view.valid[:, :, -w:], view.scaling)
    votes = probs.sum(dim=(2, 3))  # [B, Hkv, S]
    b, h, s = votes.shape
    pooled = F.max_pool1d(votes.view(b * h, 1, s), kernel, stride=1, padding=kernel // 2)
    newest = view.slot_pos.amax(dim=-1, keepdim=True)
    return torch.where(view.slot_pos > newest - w, torch.inf, pooled.view(b, h, s))


def check_window(window: int) -> None:
    """Refuse a window of queries the fast path would not show a selector's `prefill`."""
    if not 1 <= window <= LAST_QUERIES:
        raise ValueError(f"the window of last queries must be 1 to {LAST_QUERIES} (the fast path keeps so many); "
                         f"got {window}")  # fmt: skip
