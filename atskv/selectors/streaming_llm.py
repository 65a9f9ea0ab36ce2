"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv:2309.17453): a few attention-sink tokens plus the most recent window.

Defaults from the paper: 4 sinks; the window is the rest of the budget. Sinks are the first
*valid* tokens of each row, so left padding does not steal them. Query-agnostic and evicting.
"""

from dataclasses import dataclass

import torch

from atskv.selectors.base import LayerView, Selector


@dataclass
class StreamingLLMSelector(Selector):
    name = "streaming_llm"
    fast_path = True
    evicts = True
    sinks: int = 4

    def scores(self, view: LayerView):
        valid = view.valid[:, :, -1]  # [B, Hkv, S]: what the newest query sees
        pos = view.slot_pos.to(torch.float32)
        first = pos.masked_fill(~valid, float("inf")).amin(dim=-1, keepdim=True)
        is_sink = valid & (pos < first + self.sinks)
        return torch.where(is_sink, torch.inf, pos).unsqueeze(2)
