"""The GPU-resident summary of a host tier's keys (`HostRetrieval(summary=...)`) that ranks its pages.

Every token's key lives in host memory (`atskv.runtime.fast.host_pages`); the GPU keeps only enough to
score each page against the step's query, per row and KV head:
- "bounds": Quest's page key min/max (arXiv:2406.10774), 2 * D values a page, 1/8 of the keys at
  16 tokens. A page's bound covers all its tokens at once, so one sharp match among small keys
  scores below a page of broad-range filler and 16-token pages lose needle tokens.
- "int4" (the default): every key in 4 bits with one scale per token (D / 2 + 2 bytes at 16-bit keys,
  13% of K + V at D = 64), scored nearly exactly: a page's score is its best parked token's logit, max
  over the GQA group (a token already resident does not draw its page back). It finds the needles
  that bounds lose (SmolLM2 leaderboard: the host rows at dense's score) for a few times the bounds'
  scoring time (docs/results.md, "The host tier on the fast path").
"""

from __future__ import annotations

import torch

from atskv.kernels.int4_page_scores import int4_page_scores, quantize_int4
from atskv.kernels.quest import masked_page_bounds, quest_page_scores


class PageBounds:
    """Quest's per-page key min/max."""

    def __init__(self, batch: int, kv_heads: int, pages: int, page_size: int, head_dim: int, dtype, device):
        self.page_size = page_size
        self.low = torch.zeros(batch, kv_heads, pages, head_dim, dtype=dtype, device=device)
        self.high = torch.zeros_like(self.low)

    @property
    def nbytes(self) -> int:
        return self.low.nbytes + self.high.nbytes

    def park(self, row: int, keys: torch.Tensor, held: torch.Tensor, count: int) -> None:
        """A row's prompt keys `[1, Hkv, >= count, D]`, the held ones `[1, Hkv, S]`, after its prefill."""
        low, high = masked_page_bounds(keys[:1], held, self.page_size)
        n = min(low.shape[2], self.low.shape[2])
        self.low[row, :, :n], self.high[row, :, :n] = low[0, :, :n], high[0, :, :n]

    def append(self, index: torch.Tensor, keys: torch.Tensor) -> None:
        """One key per row `[B, Hkv, 1, D]` at host index `index` `[B, Hkv, 1]`: its page's bounds
        widened to it, or reset to it when it opens the page."""
        page = (index // self.page_size).unsqueeze(-1).expand_as(keys)
        first = (index % self.page_size == 0).unsqueeze(-1)
        low, high = self.low.gather(2, page), self.high.gather(2, page)
        self.low.scatter_(2, page, torch.where(first, keys, torch.minimum(low, keys)))
        self.high.scatter_(2, page, torch.where(first, keys, torch.maximum(high, keys)))

    def page_scores(self, query: torch.Tensor, parked: torch.Tensor) -> torch.Tensor:
        """`[B, Hkv, P]` float32 for `query` `[B, Hq, D]`; a page's bound covers all its tokens, `parked`
        (`[B, Hkv, N]`) or not."""
        return quest_page_scores(query, self.low, self.high)


class Int4Keys:
    """Every key in int4 with one scale per token (`kernels.int4_page_scores`); a page scores its best
    parked token. An odd head dim is refused when the first keys are parked."""

    def __init__(self, batch: int, kv_heads: int, pages: int, page_size: int, head_dim: int, dtype, device):
        self.page_size = page_size
        self.codes = torch.zeros(batch, kv_heads, pages * page_size, head_dim // 2, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(batch, kv_heads, pages * page_size, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def park(self, row: int, keys: torch.Tensor, held: torch.Tensor, count: int) -> None:
        """A row's prompt keys `[1, Hkv, >= count, D]` after its prefill, its `count` real ones at the front."""
        self.codes[row, :, :count], self.scale[row, :, :count] = quantize_int4(keys[0, :, :count])

    def append(self, index: torch.Tensor, keys: torch.Tensor) -> None:
        """One key per row `[B, Hkv, 1, D]` at host index `index` `[B, Hkv, 1]`, quantised."""
        codes, scale = quantize_int4(keys)
        self.codes.scatter_(2, index.unsqueeze(-1).expand_as(codes), codes)
        self.scale.scatter_(2, index, scale)

    def page_scores(self, query: torch.Tensor, parked: torch.Tensor) -> torch.Tensor:
        """`[B, Hkv, P]` float32 for `query` `[B, Hq, D]`: its best `parked` (`[B, Hkv, N]`) token's logit."""
        return int4_page_scores(query, self.codes, self.scale, self.page_size, parked)


KEY_SUMMARIES = {"bounds": PageBounds, "int4": Int4Keys}
